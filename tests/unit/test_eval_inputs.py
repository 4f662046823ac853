"""What eval.py (and tools/export_hf.py, through the same reader) are given: a run folder whose run is saving and
pruning, a checkpoints/latest pointer file, a folder where a task file belongs, numbers lm-eval would refuse only after
the loss computation. Each resolves to a checkpoint, or exits 2 with one paragraph before any work."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import script_main

from lmrecipe.checkpoint.storage import BEST, LATEST, STATE_FILE, step_dir_name
from lmrecipe.errors import UserError
from lmrecipe.export import follow_pointer, read_newest


def eval_main():
    return script_main("eval.py")


def checkpoint(root: Path, step: int) -> Path:
    """A complete checkpoint folder as the reader sees it (its train_state.json), with ``latest`` aimed at it."""
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / STATE_FILE).write_text('{"format_version": 1}\n')
    (root / LATEST).write_text(path.name + "\n")
    return path


def pruned_while_read(pruned: list[Path]):
    """A reader that finds each checkpoint in ``pruned`` deleted under it, as a run's ``keep_last`` deletes one (the
    folder renamed away, then removed), and fails as transformers does on a folder that is gone."""

    def read(path: Path) -> str:
        if path in pruned:
            shutil.rmtree(path)
            raise ValueError(f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path / 'hf'}'")
        return path.name

    return read


@pytest.fixture
def run(tmp_path) -> Path:
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2, 3):
        checkpoint(root, step)
    return tmp_path / "run"


def test_a_run_folder_whose_newest_checkpoint_is_pruned_while_read_gives_the_next_newest(run, caplog):
    ckpts = run / "checkpoints"
    assert read_newest(run, pruned_while_read([ckpts / step_dir_name(3)])) == (ckpts / step_dir_name(2), "step_00000002")
    assert "was deleted while it was read" in caplog.text


def test_when_every_checkpoint_is_pruned_while_read_the_reader_exits_2_naming_them(run):
    ckpts = run / "checkpoints"
    every = [ckpts / step_dir_name(s) for s in (1, 2, 3)]
    with pytest.raises(UserError, match=r"checkpoint step_00000003, step_00000002, step_00000001 were deleted while "
                                        "being read .* no complete one is left"):
        read_newest(run, pruned_while_read(every))
    single = checkpoint(run.parent / "other", 7)
    with pytest.raises(UserError, match=f"Checkpoint {single} was deleted while it was read"):
        read_newest(single, pruned_while_read([single]))


def test_an_error_of_a_checkpoint_that_is_still_there_is_its_own(run):
    def broken(path: Path):
        raise UserError(f"Checkpoint {path} is damaged")

    with pytest.raises(UserError, match="step_00000003 is damaged"):
        read_newest(run, broken)


def test_the_latest_and_best_pointer_files_are_followed(run):
    ckpts = run / "checkpoints"
    (ckpts / BEST).write_text(step_dir_name(2) + "\n")
    assert follow_pointer(ckpts / LATEST) == ckpts / step_dir_name(3)
    assert read_newest(ckpts / BEST, lambda path: path.name) == (ckpts / step_dir_name(2), "step_00000002")
    (ckpts / LATEST).write_text("step_00000009\n")
    with pytest.raises(UserError, match="points to 'step_00000009', which is not a checkpoint folder"):
        follow_pointer(ckpts / LATEST)


class _Model:
    """What load_for_inference does with a loaded model: sets its config's use_cache, calls eval()."""

    config = type("Config", (), {})()

    def eval(self):
        return self


def test_eval_of_the_latest_pointer_file_reads_the_checkpoint_it_names(run, monkeypatch):
    import lmrecipe.export as export

    seen = []
    monkeypatch.setattr(export, "_load_checkpoint", lambda ckpt, dtype, weights: seen.append(ckpt) or (_Model(), None, 32))
    export.load_for_inference(run / "checkpoints" / LATEST)
    assert seen == [run / "checkpoints" / step_dir_name(3)]


def test_tasks_given_a_folder_name_it_as_a_folder(tmp_path, capsys):
    tasks = tmp_path / "my_tasks"
    tasks.mkdir()
    (tasks / "arith.jsonl").write_text('{"context": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0}\n')
    assert eval_main()([str(tmp_path), "--tasks", str(tasks)]) == 2
    err = capsys.readouterr().err
    assert f"Task {tasks} is a folder, not a task file (it holds {tasks / 'arith.jsonl'}" in err, err
    assert "does not exist" not in err and "Traceback" not in err
    assert eval_main()([str(tmp_path), "--lm-eval", str(tasks)]) == 2
    assert "is a folder, not a task: pass the folder with --include-path" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value, words", [
    ("--limit", "-1", "--limit -1: give the number of items to score per task, 1 or more"),
    ("--limit", "0", "--limit 0: give the number of items"),
    ("--num-fewshot", "-3", "--num-fewshot -3: give the number of solved examples before each item, 0 or more"),
])
def test_lm_eval_numbers_are_refused_before_any_work(tmp_path, capsys, flag, value, words):
    # The model path and the data folder do not exist: anything that did work would fail on them first.
    code = eval_main()([str(tmp_path / "no_model"), "--data", str(tmp_path / "no_data"), "--lm-eval", "next_line",
                        flag, value])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err
