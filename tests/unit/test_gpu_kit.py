"""bench/gpu/run.py's arguments, in this process: a bad number or data folder exits 2 naming it and the fix before
anything is installed, prepared or run (the kit's dry run itself: tests/integration/test_gpu_kit.py); the levers
stage's in-place switches equal a run built with them."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers import ROOT


@pytest.fixture(scope="module")
def kit():
    here = str(ROOT / "bench" / "gpu")
    sys.path.insert(0, here)  # as Python does for the script: stages and install sit beside it
    spec = importlib.util.spec_from_file_location("gpu_kit_run_args", ROOT / "bench" / "gpu" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]
    sys.path.remove(here)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "-1"], "--steps -1: the measured steps per side must be 1 or more"),
    (["--steps", "0"], "--steps 0: the measured steps per side must be 1 or more"),
    (["--warmup-steps", "-2"], "--warmup-steps -2: the steps before measuring must be 0 or more"),
    (["--budget-s", "nan"], "--budget-s nan: give a number of seconds above 30"),
    (["--budget-s", "inf"], "--budget-s inf: give a number of seconds above 30"),
    (["--budget-s", "20"], "--budget-s 20.0: give a number of seconds above 30"),
    (["--data", "{tmp}/none"], "--data {tmp}/none does not exist. Pass a folder written by tools/prepare_data.py"),
    (["--data", "{tmp}/a_file"], "--data {tmp}/a_file is a file, not a prepared data folder."),
    (["--data", "{tmp}"], "--data {tmp} holds no meta.json: it is not a prepared data folder."),
])
def test_a_bad_argument_exits_2_naming_it_before_anything_runs(kit, tmp_path, capsys, argv, message):
    (tmp_path / "a_file").write_text("tokens")
    with pytest.raises(SystemExit) as exit_:  # parse_args is main's first step: nothing installed, prepared or run
        kit.parse_args(["--dry-run", "--out", str(tmp_path / "out"), *(arg.format(tmp=tmp_path) for arg in argv)])
    assert exit_.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


def test_good_arguments_pass_and_a_data_folder_is_made_absolute(kit, tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "meta.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    args = kit.parse_args(["--out", "o", "--data", "data", "--steps", "3", "--warmup-steps", "0", "--budget-s", "60"])
    assert (args.steps, args.warmup_steps, args.budget_s, args.data) == (3, 0, 60.0, tmp_path / "data")


@pytest.mark.parametrize("flag", ["--out", "--work"])
@pytest.mark.parametrize("where, message", [
    ("{tmp}/a_file", "{flag} {tmp}/a_file is a file, not a folder. Pass {flag} a folder you can write to"),
    ("{tmp}/a_file/sub", "{flag} {tmp}/a_file/sub lies under {tmp}/a_file, which is a file, not a folder"),
])
def test_an_out_or_work_folder_that_cannot_be_made_exits_2_naming_it(kit, tmp_path, capsys, flag, where, message):
    (tmp_path / "a_file").write_text("not a folder")
    argv = {"--out": str(tmp_path / "out"), "--work": str(tmp_path / "work")}
    argv[flag] = where.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exit_:
        kit.parse_args(["--dry-run", *(item for pair in argv.items() for item in pair)])
    assert exit_.value.code == 2
    assert message.format(tmp=tmp_path, flag=flag) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing made


@pytest.mark.parametrize("flag", ["--out", "--work"])
def test_an_unwritable_out_or_work_folder_exits_2_naming_it(kit, tmp_path, capsys, monkeypatch, flag):
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = kit.os.access
    monkeypatch.setattr(kit.os, "access", lambda p, mode: False if p == locked else real_access(p, mode))
    argv = {"--out": str(tmp_path / "out"), "--work": str(tmp_path / "work")}
    argv[flag] = str(locked / "sub")
    with pytest.raises(SystemExit) as exit_:
        kit.parse_args(["--dry-run", *(item for pair in argv.items() for item in pair)])
    assert exit_.value.code == 2
    assert f"{flag} {locked}/sub would be made in {locked}, which is not writable" in capsys.readouterr().err


def test_levers_switched_in_place_give_the_loss_of_a_run_built_with_them(tmp_path, monkeypatch):
    """The levers stage's in-place switches (attention implementation, loss head) on a built run give the held
    batch's loss that a run built with those settings gives, and switching back gives the first loss again."""
    from helpers import write_data

    from lmrecipe.config import load_config

    for folder in ("bench", "bench/gpu"):
        monkeypatch.syspath_prepend(str(ROOT / folder))
    import levers

    data = write_data(tmp_path / "data", vocab=384)

    def built(*overrides):
        cfg = load_config(str(ROOT / "recipes" / "tiny.yaml"), [
            f"out_dir={tmp_path / 'run'}", f"data.path={data}", "model.hidden_size=64", "model.num_layers=2",
            "model.num_heads=4", "model.intermediate_size=128", "data.seq_len=32", "train.micro_batch_size=4",
            "train.global_batch_size=8", "train.loss_chunk_tokens=64", *overrides])
        run, _ = levers._build(cfg, tmp_path / "run", foreach=False)
        return run, next(iter(run.train_batches.micro_batches(0)))

    run, batch = built()
    first = levers.held_loss(run, batch)
    levers.use_attention(run, "eager")
    levers.use_loss_head(run, 0)
    switched = levers.held_loss(run, batch)
    other, _ = built("model.attn_implementation=eager", "train.loss_chunk_tokens=0")
    assert switched == pytest.approx(levers.held_loss(other, batch), abs=1e-6)
    assert switched == pytest.approx(first, abs=1e-5)  # the same model: eager and SDPA, chunked and full, agree
    levers.use_attention(run, "sdpa")
    levers.use_loss_head(run, 64)
    assert levers.held_loss(run, batch) == pytest.approx(first, abs=1e-6)
    for each in (run, other):
        each.prefetcher.close()
