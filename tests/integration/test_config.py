"""Config schema: every recipe loads, precedence, strictness, and errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT, subprocess_env


def test_cli_user_error_exits_2_without_traceback():
    proc = subprocess.run(
        [sys.executable, "train.py", "recipes/tiny.yaml", "optim.lrr=1"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Did you mean optim.lr?" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_reports_every_bad_key_at_once_and_exits_2():
    proc = subprocess.run(
        [sys.executable, "train.py", "recipes/tiny.yaml", "optim.lrr=1", "train.max_stepz=3", "train.seed=x"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "3 problems in the configuration" in proc.stderr
    assert "Did you mean optim.lr?" in proc.stderr and "Did you mean train.max_steps?" in proc.stderr
    assert "train.seed='x' must be an integer" in proc.stderr
