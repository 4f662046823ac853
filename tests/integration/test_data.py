"""The memmap loader: order determinism, rank disjointness, invariance to the batch split, start-up checks.

Data folders here are synthetic (random ids, documents of ``doc_len`` tokens ending in EOS 0), written straight
in the prepared-folder format, so each test controls exactly what the files and meta.json say.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import ROOT, subprocess_env


def test_train_script_reports_bad_data_without_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "train.py", "recipes/tiny.yaml", f"data.path={tmp_path / 'missing'}", f"out_dir={tmp_path / 'run'}"],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "does not exist" in proc.stderr and "prepare_data.py" in proc.stderr
    assert "Traceback" not in proc.stderr
