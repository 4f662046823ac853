"""The scripts on a real run (the session's shared ``plain`` run, read-only here): eval.py follows the
``checkpoints/latest`` pointer file, tools/export_hf.py writes a new export inside the run, and what they and the
run wrote is readable as any new file is (safetensors alone leaves 0600). The refusals themselves are unit tests
(tests/unit/test_output_paths.py, tests/unit/test_eval_inputs.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import STEPS, plain_run, run_script

from lmrecipe.checkpoint.storage import LATEST, step_dir_name
from lmrecipe.fileio import new_file_mode


@pytest.fixture(scope="module")
def plain(tmp_path_factory, tiny_data) -> Path:
    return plain_run(tmp_path_factory, tiny_data)


def _modes(folder: Path, pattern: str) -> set[int]:
    return {p.stat().st_mode & 0o777 for p in folder.rglob(pattern)}


def test_eval_of_the_latest_pointer_file_evaluates_the_checkpoint_it_names(plain, tiny_data, tmp_path):
    result = tmp_path / "eval.json"
    args = ["--data", str(tiny_data), "--max-batches", "1", "--batch-size", "4", "--output", str(result)]
    run_script(["eval.py", str(plain / "checkpoints" / LATEST), *args])
    named = run_script(["eval.py", str(plain / "checkpoints" / step_dir_name(STEPS)), *args, "--overwrite"])
    assert json.loads(result.read_text()) == json.loads(named.stdout.strip().splitlines()[0])


def test_the_run_and_a_tool_export_write_safetensors_readable_as_any_new_file(plain, tmp_path):
    mode = new_file_mode()  # what the test process gives a new file (the run and the tool inherit its umask)
    assert _modes(plain / "checkpoints", "*.safetensors") == {mode}
    assert _modes(plain / "export", "*") == {mode}
    out = tmp_path / "export"
    run_script(["tools/export_hf.py", str(plain), str(out), "--dtype", "fp32"])
    assert _modes(out, "*") == {mode} and any(out.glob("*.safetensors"))
    assert os.access(next(out.glob("*.safetensors")), os.R_OK)
