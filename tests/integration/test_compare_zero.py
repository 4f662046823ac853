"""tools/compare_zero.py's refusals. The comparison itself (2 processes, no DeepSpeed against ZeRO-3, its results
table and plot) runs through slurm/compare_zero.sbatch in tests/integration/test_slurm_cluster.py."""

from helpers import run_script


def test_compare_zero_never_replaces_an_earlier_comparison(tmp_path):
    out = tmp_path / "compare"
    (out / "none").mkdir(parents=True)
    (out / "none" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    again = run_script(["tools/compare_zero.py", "recipes/tiny.yaml", "--configs", "none", "--out", str(out)], check=False)
    assert again.returncode == 2 and "--overwrite" in again.stderr, again.stderr
    assert (out / "none" / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched
