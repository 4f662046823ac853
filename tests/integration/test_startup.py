"""What every process pays before training: DeepSpeed's ops compiled ahead (tools/build_ops.py), and no import of
mlflow for DeepSpeed's autotuner, while the mlflow tracker still imports it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import ROOT, run_script, subprocess_env

PROBE = """
import sys
from lmrecipe.cli import skip_autotuner_mlflow
{skip}
import accelerate.utils  # imports DeepSpeed, whose autotuner imports mlflow where it is installed
from deepspeed.autotuning import autotuner
print("deepspeed", "mlflow" in sys.modules, autotuner.has_mlflow)
import mlflow
print("tracker", "mlflow" in sys.modules)
"""


def test_deepspeed_imports_without_mlflow_and_mlflow_still_imports():
    got = {}
    for skip in ("", "skip_autotuner_mlflow()"):
        proc = subprocess.run([sys.executable, "-c", PROBE.format(skip=skip)], cwd=ROOT, env=subprocess_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got[bool(skip)] = [line for line in proc.stdout.splitlines() if line.startswith(("deepspeed", "tracker"))]
    assert got[False] == ["deepspeed True True", "tracker True"]  # without the skip: mlflow with DeepSpeed
    assert got[True] == ["deepspeed False False", "tracker True"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the ops of a machine without a GPU")
def test_build_ops_compiles_what_deepspeed_builds_on_first_use_on_a_cpu():
    proc = run_script(["tools/build_ops.py"], timeout=900)
    assert "DeepSpeed ops ready: cpu_adam, deepspeed_shm_comm" in proc.stderr, proc.stderr[-3000:]
