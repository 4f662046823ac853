"""tools/average_checkpoints.py as a user runs it: the average of a run's last checkpoints, eval.py on it, bad input
(exit 2, one paragraph, nothing written), and the ZeRO-2 checkpoints of 2 processes read in place."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import HALF, STEPS, independent_average, plain_run, run_script, zero_pair

from lmrecipe.checkpoint.storage import step_dir_name


def _read_export(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        out.update(load_file(shard))
    return out


def test_the_script_averages_a_runs_last_checkpoints_and_eval_reads_the_result(tmp_path, tmp_path_factory, tiny_data):
    run = plain_run(tmp_path_factory, tiny_data)
    out = tmp_path / "avg"
    run_script(["tools/average_checkpoints.py", str(run), "--last", "2", "--weights", "1,3", "--out", str(out)])
    checkpoints = [run / "checkpoints" / step_dir_name(s) for s in (STEPS - 1, STEPS)]
    written, want = _read_export(out), independent_average(checkpoints, [0.25, 0.75])
    assert max((written[n] - want[n]).abs().max().item() for n in want) <= 1e-7
    result = json.loads(run_script(["eval.py", str(out), "--data", str(tiny_data), "--max-batches", "2"]).stdout
                        .splitlines()[0])
    assert 0 < result["loss"] < 10

    again = run_script(["tools/average_checkpoints.py", str(run), "--last", "2", "--out", str(out)], check=False)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert "already exists and is not empty" in again.stderr and "--overwrite" in again.stderr
    bad = run_script(["tools/average_checkpoints.py", str(run), "--last", "2", "--weights", "1", "--out",
                      str(tmp_path / "bad")], check=False)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "--weights 1 must be 2 comma-separated" in bad.stderr
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["avg"]


@pytest.mark.slow
def test_zero2_checkpoints_of_two_processes_are_averaged_in_place(tmp_path, tmp_path_factory, tiny_data):
    pair = zero_pair(tmp_path_factory, tiny_data, stage=2)
    checkpoints = [pair["a"] / "checkpoints" / step_dir_name(s) for s in (HALF, STEPS)]
    out = tmp_path / "avg"
    run_script(["tools/average_checkpoints.py", *map(str, checkpoints), "--out", str(out)])
    written, want = _read_export(out), independent_average(checkpoints, [0.5, 0.5])
    assert max((written[n] - want[n]).abs().max().item() for n in want) <= 1e-7
