"""Every tool that writes checks its output before any work (lmrecipe/cli.py: check_tool_output): never into or over a
training checkpoint or a run folder, never over what it reads, never over an existing file without --overwrite; and
what the package writes is as readable as any new file (safetensors alone would leave 0600). Each refusal exits 2 with
one paragraph and leaves the run folder byte for byte as it was."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, script_main, tree_digest

from lmrecipe.checkpoint.storage import LATEST, STATE_FILE, CheckpointStore, step_dir_name
from lmrecipe.cli import CHECKPOINT_STATE_FILE, RUN_FILES, RUN_POINTERS, RUN_RECORD_FILES, check_tool_output
from lmrecipe.errors import UserError
from lmrecipe.fileio import atomic_path, building_dir


def tool_main(script: str):
    """The ``main`` of a script of the repository (``tools/export_hf.py``, ``eval.py``), loaded in this process."""
    return script_main(script)


def published(root: Path, step: int) -> Path:
    """A checkpoint published by the real store (manifest, sha256, ``latest``), with a safetensors weight file."""
    from safetensors.torch import save_file

    store = CheckpointStore(SimpleNamespace(is_main_process=True), root, keep_last=5, background=False,
                            deepspeed=False, publish_timeout_s=10)
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{final.name}"
    tmp.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, tmp / "model.safetensors")
    store.publish(tmp, final, {"state": {"step": step}})
    return final


@pytest.fixture
def run(tmp_path) -> Path:
    """A run folder as training leaves it: config, metrics, report and two checkpoints."""
    out = tmp_path / "runs" / "tiny"
    published(out / "checkpoints", 1)
    published(out / "checkpoints", 2)
    (out / "config.yaml").write_text("out_dir: runs/tiny\n")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (out / "report.md").write_text("# tiny\n")
    return out


def refused(capsys, code: int, *words: str) -> str:
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith("error: ") and all(word in err for word in words), err
    return err


# ---------------------------------------------------------------------------------------------- each tool


def test_export_over_its_own_run_folder_is_refused_and_the_run_is_untouched(run, capsys):
    before = tree_digest(run)
    code = tool_main("tools/export_hf.py")([str(run / "checkpoints" / step_dir_name(2)), str(run), "--overwrite"])
    refused(capsys, code, f"OUT_DIR {run} is the folder of a training run", "Choose a new folder")
    assert tree_digest(run) == before


def test_export_into_a_folder_that_holds_a_run_or_its_source_deeper_down_is_refused(run, tmp_path, capsys):
    other = tmp_path / "old" / "project" / "run2"  # another run, two levels down, without checkpoints
    other.mkdir(parents=True)
    for name in ("config.yaml", "metrics.jsonl"):
        (other / name).write_text("kept\n")
    before = tree_digest(tmp_path)
    source = run / "checkpoints" / step_dir_name(2)
    main = tool_main("tools/export_hf.py")
    refused(capsys, main([str(source), str(tmp_path / "old"), "--overwrite"]),
            f"OUT_DIR {tmp_path / 'old'} holds the run folder {other}", "replacing the folder would delete it")
    refused(capsys, main([str(source), str(run.parent), "--overwrite"]), f"holds {source}, which this command reads")
    refused(capsys, main([str(source), str(source / "export")]), "lies inside the training checkpoint")
    assert tree_digest(tmp_path) == before


def test_eval_output_onto_a_checkpoint_state_or_a_run_file_is_refused_before_any_work(run, capsys):
    before = tree_digest(run)
    checkpoint = run / "checkpoints" / step_dir_name(2)
    main = tool_main("eval.py")
    code = main([str(checkpoint), "--data", "nowhere", "--output", str(checkpoint / STATE_FILE), "--overwrite"])
    refused(capsys, code, "lies inside the training checkpoint", "Choose a path outside the checkpoint")
    # A variation: the run's own metrics, which --overwrite does not unlock.
    code = main([str(checkpoint), "--data", "nowhere", "--output", str(run / "metrics.jsonl"), "--overwrite"])
    refused(capsys, code, "is the run's own metrics.jsonl")
    code = main([str(run), "--data", "nowhere", "--output", str(run / "checkpoints" / LATEST), "--overwrite"])
    refused(capsys, code, "lies inside the checkpoints folder of the training run")
    code = main([str(checkpoint), "--data", "nowhere", "--output", str(run / "report.md")])
    refused(capsys, code, "is the run's own report.md")
    assert tree_digest(run) == before


def test_eval_output_over_an_existing_file_needs_overwrite(tmp_path, capsys):
    result = tmp_path / "eval.json"
    result.write_text("{}\n")
    code = tool_main("eval.py")([str(tmp_path), "--data", "nowhere", "--output", str(result)])
    refused(capsys, code, "already exists. Pass --overwrite")
    assert result.read_text() == "{}\n"
    assert check_tool_output(result, "--output", folder=False, overwrite=True) == result


def test_plan_write_recipe_never_replaces_a_recipe_without_overwrite_nor_its_own_base(tmp_path, capsys):
    recipe = tmp_path / "base.yaml"
    recipe.write_text((ROOT / "recipes" / "tiny.yaml").read_text())
    text = recipe.read_text()
    main = tool_main("tools/plan.py")
    planned = tmp_path / "planned.yaml"
    planned.write_text("# an earlier plan\n")
    base = ["--gpus", "1", "--gpu", "cpu", "--recipe", str(recipe), "--tokens", "1e6"]
    refused(capsys, main([*base, "--write-recipe", str(planned)]), "already exists. Pass --overwrite")
    refused(capsys, main([*base, "--write-recipe", str(recipe), "--overwrite"]), "which this command reads")
    assert recipe.read_text() == text and planned.read_text() == "# an earlier plan\n"


def test_prepare_data_never_replaces_its_own_input(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def f():\n    return 1\n")
    main = tool_main("tools/prepare_data.py")
    refused(capsys, main(["--input", str(corpus), "--output", str(corpus), "--overwrite"]), "which this command reads")
    refused(capsys, main(["--input", str(corpus / "a.txt"), "--output", str(corpus), "--overwrite"]),
            f"holds {corpus / 'a.txt'}")
    assert sorted(p.name for p in corpus.iterdir()) == ["a.txt"]


def test_compare_zero_never_replaces_a_training_run(run, tmp_path, monkeypatch, capsys):
    before = tree_digest(run)
    main = tool_main("tools/compare_zero.py")
    monkeypatch.setattr(sys, "argv", ["compare_zero.py", "recipes/tiny.yaml", "--configs", "none", "--nproc", "2",
                                      "--out", str(run)])
    refused(capsys, main(), "is the folder of a training run")
    # A run of the user's named like a config: --overwrite replaces only the run folders a comparison wrote.
    monkeypatch.setattr(sys, "argv", ["compare_zero.py", "recipes/tiny.yaml", "--configs", "none", "--nproc", "2",
                                      "--out", str(tmp_path / "cmp"), "--overwrite"])
    (tmp_path / "cmp").mkdir()
    os.rename(run, tmp_path / "cmp" / "none")
    refused(capsys, main(), "is not a run of an earlier comparison")
    assert tree_digest(tmp_path / "cmp" / "none") == before


def test_the_guard_knows_the_run_files_by_the_names_their_writers_use():
    from lmrecipe.checkpoint.storage import BEST, PREEMPTED_MARKER
    from lmrecipe.observe.goodput import GOODPUT_FILE
    from lmrecipe.observe.metrics_log import METRICS_FILE
    from lmrecipe.observe.run_meta import RUN_META_FILE
    from lmrecipe.observe.run_report import FINAL_FILE, REPORT_FILE
    from lmrecipe.observe.trackers import MLFLOW_ID_FILE, WANDB_ID_FILE
    from lmrecipe.train.callbacks.spikes import SPIKES_FILE
    from lmrecipe.train.lock import LOCK_FILE

    assert CHECKPOINT_STATE_FILE == STATE_FILE and RUN_POINTERS == (LATEST, BEST)
    assert METRICS_FILE in RUN_RECORD_FILES and "config.yaml" in RUN_RECORD_FILES
    assert {METRICS_FILE, RUN_META_FILE, FINAL_FILE, REPORT_FILE, SPIKES_FILE, PREEMPTED_MARKER, LOCK_FILE,
            WANDB_ID_FILE, MLFLOW_ID_FILE, GOODPUT_FILE} <= RUN_FILES


def test_a_new_path_inside_a_run_folder_and_a_fresh_folder_are_accepted(run, tmp_path):
    assert check_tool_output(run / "export-ema", "OUT_DIR", overwrite=False) == run / "export-ema"
    assert check_tool_output(run / "eval.json", "--output", folder=False) == run / "eval.json"
    assert check_tool_output(tmp_path / "new" / "deeper", "OUT_DIR") == tmp_path / "new" / "deeper"
    with pytest.raises(UserError, match="is the folder of a training run"):
        check_tool_output(run, "OUT_DIR", overwrite=True)


# ---------------------------------------------------------------------------------------------- file modes


@pytest.fixture
def umask():
    """Set the process umask for a test, and restore it."""
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_checkpointed_and_exported_safetensors_are_as_readable_as_other_files(tmp_path, umask):
    from safetensors.torch import save_file

    checkpoint = published(tmp_path / "checkpoints", 1)
    assert _mode(checkpoint / "model.safetensors") == _mode(checkpoint / STATE_FILE) == 0o644
    with building_dir(tmp_path / "export", overwrite=False) as tmp:  # the export's writer
        save_file({"w": torch.zeros(2)}, tmp / "model-00001-of-00001.safetensors")
        (tmp / "config.json").write_text("{}\n")
    assert {_mode(p) for p in (tmp_path / "export").iterdir()} == {0o644}
    with atomic_path(tmp_path / "probe.safetensors") as tmp:
        save_file({"w": torch.zeros(2)}, tmp)
    assert _mode(tmp_path / "probe.safetensors") == 0o644


def test_a_strict_umask_is_kept(tmp_path, umask):
    from safetensors.torch import save_file

    umask(0o077)
    with atomic_path(tmp_path / "w.safetensors") as tmp:
        save_file({"w": torch.zeros(2)}, tmp)
    assert _mode(tmp_path / "w.safetensors") == 0o600
