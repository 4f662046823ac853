"""The real ``accelerate launch``: asked for 2 processes without ``--multi_gpu``, it starts the script once, which
refuses to train (exit 2) instead of training on one process silently."""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT, subprocess_env


def test_the_real_launcher_without_multi_gpu_is_refused(tmp_path):
    # Refused by the start-up checks, before out_dir is written, with every other problem they find (the data).
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "train.py",
                           "recipes/tiny.yaml", f"out_dir={out}", f"data.path={tmp_path / 'no_data'}"],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stderr
    assert "error: 2 problems found before the start" in proc.stderr, proc.stderr
    assert "- accelerate launch was asked for 2 processes (--num_processes 2)" in proc.stderr
    assert "no_data' does not exist" in proc.stderr
    assert "--multi_gpu --num_processes 2" in proc.stderr and "returned non-zero exit status 2" in proc.stderr
    assert not out.exists()
