"""tools/doctor.py as a user runs it: findings printed for a run folder (also one still being written), --strict's
exit code, and a folder that is not a run refused with exit 2 and no traceback."""

from __future__ import annotations

import json

from helpers import run_script


def write_run(folder, losses: list[float], partial: bool = False):
    folder.mkdir()
    rows = [{"step": 10 * (i + 1), "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "skipped_steps": 0}
            for i, loss in enumerate(losses)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (folder / "metrics.jsonl").write_text(text + ('{"step": 999, "lo' if partial else ""))
    (folder / "run_meta.json").write_text(json.dumps({"config": {"optim": {"lr": 1e-3}, "schedule": {"warmup_steps": 10}}}))
    return folder


def test_the_tool_prints_findings_and_strict_sets_the_exit_code(tmp_path):
    flat = write_run(tmp_path / "flat", [6.0, 6.0, 6.01, 6.0, 5.99, 6.0, 6.0, 6.0] * 2, partial=True)
    out = run_script(["tools/doctor.py", str(flat)])
    assert "16 logged training steps, up to step 160; 1 finding" in out.stdout
    assert "[loss_not_falling] loss not falling after warmup" in out.stdout and "fix: optim.lr=0.01" in out.stdout
    assert run_script(["tools/doctor.py", str(flat), "--strict"], check=False).returncode == 1
    healthy = write_run(tmp_path / "healthy", [6.0, 5.0, 4.5, 4.2, 4.0, 3.9, 3.8, 3.75])
    out = run_script(["tools/doctor.py", str(healthy), "--strict"])
    assert out.stdout.strip().endswith("no findings")


def test_a_folder_that_is_not_a_run_is_refused(tmp_path):
    out = run_script(["tools/doctor.py", str(tmp_path)], check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: {tmp_path} is not a run folder" in out.stderr and "out_dir of a run" in out.stderr
