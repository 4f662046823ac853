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
