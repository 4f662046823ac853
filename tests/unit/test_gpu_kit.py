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
    sys.path.insert(0, here)  # as Python does for the script: stages sits beside it
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


@pytest.fixture
def levers(monkeypatch):
    for folder in ("bench", "bench/gpu"):
        monkeypatch.syspath_prepend(str(ROOT / folder))
    import levers

    return levers


def test_the_second_build_keeps_the_chunked_loss_where_full_logits_would_not_fit(levers):
    """The H100 call's figures (2026-11-28T014818): full logits' step peak 56.5 GiB on top of the run's 16.2 GiB fits
    the 79.2 GiB device, but not with the 16.2 GiB a first run left behind: then the chunked loss stays, and why."""
    chunked = {"loss_chunk_tokens": 4096}
    windows = {"baseline": {"held_gib": 16.18, "step_peak_gib": 34.76, "levers": chunked},
               "full logits": {"held_gib": 16.18, "step_peak_gib": 56.47, "levers": {"loss_chunk_tokens": 0}},
               "liger": {"held_gib": 16.18, "step_peak_gib": 46.75, "levers": {"loss_chunk_tokens": 0}},
               "varlen": {"error": "OutOfMemoryError: ...", "levers": {"loss_chunk_tokens": 0}}}
    state = {"loss_chunk_tokens": 0}
    assert levers.keep_chunked_loss(windows, state, 4096, 0.0, 79.18) is None and state["loss_chunk_tokens"] == 0
    note = levers.keep_chunked_loss(windows, state, 4096, 16.18, 79.18)
    assert state["loss_chunk_tokens"] == 4096
    assert note.startswith("the second build keeps the chunked loss (train.loss_chunk_tokens=4096): full logits' step "
                           "peak 56.5 GiB + the run's 16.2 GiB + 16.2 GiB the first run left = 88.8 GiB, more than")
    assert levers.keep_chunked_loss(windows, {"loss_chunk_tokens": 4096}, 4096, 50.0, 79.18) is None  # already chunked


def test_a_failed_window_records_its_own_error_and_the_next_starts_from_freed_memory(levers, monkeypatch):
    """Each failed window records the text and place of its own exception (not an earlier one); its gradients and
    the frames its traceback held are freed before the next window."""
    import gc
    import types
    import weakref

    import torch

    model = torch.nn.Linear(4, 4)
    run = types.SimpleNamespace(model=model, accelerator=types.SimpleNamespace(unwrap_model=lambda m: m))
    saved, held = [], []

    def failing_window(run, step, warmup, steps):
        activations = [torch.ones(64)]  # a local of the failing frame, held by the exception's traceback, and in a
        activations.append(activations)  # reference cycle (as autograd's are): only a collection frees it
        held.append(weakref.ref(activations[0]))
        model(torch.ones(2, 4)).sum().backward()
        raise RuntimeError(f"CUDA out of memory in window {len(held)}")

    monkeypatch.setattr(levers, "window", failing_window)
    sweep = object.__new__(levers.Sweep)
    sweep.run, sweep.result, sweep.save, sweep.step = run, {"windows": {}}, saved.append, 0
    sweep.warmup = sweep.steps = 1
    gc.disable()  # freed by free()'s collection, not by one that happens to run
    try:
        for name in ("fused AdamW", "accumulation 16"):
            error = sweep.measure_or_record(name, {"optimizer": "fused AdamW"})
            assert model.weight.grad is None and held[-1]() is None
            assert error is sweep.result["windows"][name] and saved[-1] is sweep.result
    finally:
        gc.enable()
    windows = sweep.result["windows"]
    assert windows["fused AdamW"]["error"] == "RuntimeError: CUDA out of memory in window 1"
    assert windows["accumulation 16"]["error"] == "RuntimeError: CUDA out of memory in window 2"
    assert windows["accumulation 16"]["raised_at"].startswith("test_gpu_kit.py:")
    assert windows["accumulation 16"]["raised_at"].endswith("(failing_window)")
