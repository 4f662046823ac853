"""What every process pays before training: DeepSpeed's ops compiled ahead (tools/build_ops.py) and not again from
a shell that finds another ninja first, and no import of mlflow for DeepSpeed's autotuner, while the mlflow tracker
still imports it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
    """Then run again from a shell whose PATH lists the system's folders alone (not the environment's ``bin``, where
    pip's ninja is; Debian's ninja-build is another version): the ops are not compiled again, their build logs are
    untouched."""
    from torch.utils.cpp_extension import _get_build_directory

    proc = run_script(["tools/build_ops.py"], timeout=900)
    assert "DeepSpeed ops ready: cpu_adam, deepspeed_shm_comm" in proc.stderr, proc.stderr[-3000:]
    logs = [Path(_get_build_directory(name, False)) / ".ninja_log" for name in ("cpu_adam", "deepspeed_shm_comm")]
    before = [log.read_bytes() for log in logs]
    system_path = os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if os.path.isdir(p))
    proc = run_script(["tools/build_ops.py"], timeout=900, env_extra={"PATH": system_path})
    assert "DeepSpeed ops ready: cpu_adam, deepspeed_shm_comm" in proc.stderr, proc.stderr[-3000:]
    assert [log.read_bytes() for log in logs] == before, "the ops were compiled again with another ninja"
