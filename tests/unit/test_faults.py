"""Bad input and faults, in one process: each ends with one paragraph naming the problem and the fix (exit 2), or
a clean stop; nothing half-written is left. The runs of the scripts themselves are in tests/integration/test_faults.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import ROOT, SEQ_LEN, write_corpus, write_data

from lmrecipe.checkpoint.storage import (
    LATEST,
    STATE_FILE,
    CheckpointStore,
    find_resume_checkpoint,
    read_checkpoint,
    step_dir_name,
)
from lmrecipe.cli import EXIT_FILE_ENV, check_output_path, cli_main
from lmrecipe.config import load_config
from lmrecipe.data.batches import BatchLayout, Prefetcher, TrainBatches
from lmrecipe.data.format import TokenWindows, load_meta, sample_blocks
from lmrecipe.errors import EXIT_INTERRUPTED, EXIT_LOST_PEER, UserError, fail
from lmrecipe.fileio import removing_new_empty_dirs
from lmrecipe.train.callbacks.preemption import STOPS, PreemptionSignal, started_by_launcher

# ---------------------------------------------------------------------------------------------- the scripts' exit


def test_cli_main_exits_130_on_ctrl_c_and_records_how_each_script_ended(tmp_path, monkeypatch, capsys):
    exit_file = tmp_path / "exit.json"
    monkeypatch.setenv(EXIT_FILE_ENV, str(exit_file))
    monkeypatch.delenv("RANK", raising=False)

    def interrupted():
        raise KeyboardInterrupt

    assert cli_main(interrupted)() == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Interrupted (Ctrl-C)" in err and "Traceback" not in err
    assert json.loads(exit_file.read_text())["exit_code"] == EXIT_INTERRUPTED

    def bad_input():
        raise fail("out_dir is wrong. Choose another.")

    assert cli_main(bad_input)() == 2
    assert json.loads(exit_file.read_text()) == {"exit_code": 2, "error": "out_dir is wrong. Choose another.", "rank": 0,
                                                 "crash": False}

    def preempted():
        raise SystemExit(124)

    assert cli_main(preempted)() == 124 and json.loads(exit_file.read_text())["exit_code"] == 124


def test_a_crash_is_recorded_and_kept_over_the_lost_peer_it_causes(tmp_path, monkeypatch):
    """Rank 1 crashes; rank 0 then loses its peer (exit 4) and, although rank 0's record usually wins, the crash
    stays: slurm/train.sbatch must not run a crash again."""
    exit_file = tmp_path / "exit.json"
    monkeypatch.setenv(EXIT_FILE_ENV, str(exit_file))

    def crash():
        raise ValueError("a bug")

    def lost_peer():
        raise fail("Training stopped: rank 1 (pid 7) on vm died.", exit_code=EXIT_LOST_PEER)

    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError):
        cli_main(crash)()
    monkeypatch.setenv("RANK", "0")
    assert cli_main(lost_peer)() == EXIT_LOST_PEER == 4
    assert json.loads(exit_file.read_text()) == {"exit_code": 1, "error": "ValueError: a bug", "rank": 1, "crash": True}
    exit_file.unlink()
    assert cli_main(lost_peer)() == 4 and json.loads(exit_file.read_text())["exit_code"] == 4


@pytest.mark.parametrize("case", ["file", "under_a_file"])
def test_an_output_path_that_cannot_be_created_is_refused(tmp_path, case):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    target = a_file if case == "file" else a_file / "run"
    with pytest.raises(UserError, match="is a file, not a folder" if case == "file" else "lies under .*taken, which is a file"):
        check_output_path(target, "out_dir")
    with pytest.raises(UserError, match="is a folder, not a file"):
        check_output_path(tmp_path, "--output", folder=False)
    assert check_output_path(tmp_path / "new" / "deeper", "out_dir") == tmp_path / "new" / "deeper"


def test_a_failed_start_removes_only_the_empty_folders_it_created(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(UserError), removing_new_empty_dirs(out, out / "checkpoints"):
        (out / "checkpoints").mkdir(parents=True)
        raise fail("bad")
    assert not out.exists()
    kept = tmp_path / "kept"
    with pytest.raises(UserError), removing_new_empty_dirs(kept, kept / "checkpoints"):
        (kept / "checkpoints").mkdir(parents=True)
        (kept / "config.yaml").write_text("written before the failure")
        raise fail("bad")
    assert sorted(p.name for p in kept.iterdir()) == ["config.yaml"]  # only the empty folder went


# ---------------------------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_learning_rate_is_refused(value):
    with pytest.raises(UserError, match=f"optim.lr={float(value)} must be a finite number"):
        load_config("recipes/tiny.yaml", [f"optim.lr={value}"])


def test_a_recipe_that_is_a_folder_or_empty_is_named_as_such(tmp_path):
    with pytest.raises(UserError, match="is a folder, not a file"):
        load_config(ROOT / "recipes")
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(UserError, match="is empty"):
        load_config(tmp_path / "empty.yaml")


def _estimate_memory_main():
    spec = importlib.util.spec_from_file_location("estimate_memory", ROOT / "tools" / "estimate_memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_estimate_memory_blames_nodes_for_zero_nodes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["estimate_memory.py", "recipes/tiny.yaml", "--nodes", "0"])
    assert _estimate_memory_main()() == 2
    assert "--nodes=0 must be at least 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- interrupts


@pytest.fixture
def sigint_as_in_a_terminal():
    """SIGINT handled as in a terminal's foreground process: pytest started in the background inherits it ignored,
    and PreemptionSignal leaves an ignored SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_asks_for_a_stop_with_exit_130_and_close_restores_the_handler(sigint_as_in_a_terminal):
    before = signal.getsignal(signal.SIGINT)
    stop = PreemptionSignal(launched=False)
    try:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # at once: the same Ctrl-C forwarded by a launcher, not a second one
        assert stop.name == "SIGINT" and stop.exit_code == EXIT_INTERRUPTED
        assert stop.requested(SimpleNamespace(num_processes=1), exchange=False)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGINT) is before
    term = PreemptionSignal(launched=False)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert term.name == "SIGTERM" and term.exit_code == 124
    finally:
        term.close()


def test_only_a_process_started_by_a_launcher_stops_when_its_parent_exits(monkeypatch):
    assert not started_by_launcher({"PATH": "/usr/bin", "RANK": "0"})  # plain `python train.py` (nohup ... &)
    assert started_by_launcher({"LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"})  # torchrun, accelerate launch
    one = SimpleNamespace(num_processes=1)
    plain, launched = PreemptionSignal(launched=False), PreemptionSignal(launched=True)
    try:
        monkeypatch.setattr(os, "getppid", lambda: -1)  # the parent is gone: re-parented
        assert not plain.requested(one, exchange=True) and plain.name is None
        assert launched.requested(one, exchange=True) and "launcher" in launched.name
    finally:
        launched.close()
        plain.close()


class TwoRanks:
    """This rank's all-reduce with one peer's: the peer got ``peer_stop`` (or nothing); ``during()`` runs in the middle
    of the exchange (a signal that reaches this rank then)."""

    num_processes, device = 2, torch.device("cpu")

    def __init__(self, peer_stop: str | None = "SIGINT", during=lambda: None):
        self.peer_stop, self.during = peer_stop, during

    def reduce(self, tensor, reduction):
        assert reduction == "sum"
        self.during()
        return tensor + torch.tensor([float(stop == self.peer_stop) for stop in STOPS])


def test_a_rank_without_the_signal_stops_with_the_name_and_code_of_the_rank_that_got_it():
    quiet_rank = PreemptionSignal(launched=False)
    try:
        assert not quiet_rank.requested(TwoRanks(), exchange=False)  # no exchange outside a sync point
        assert quiet_rank.requested(TwoRanks(), exchange=True)
        assert quiet_rank.name == "SIGINT" and quiet_rank.exit_code == 130  # not "a signal" and 124
    finally:
        quiet_rank.close()


def test_a_signal_during_the_exchange_stops_no_rank_until_the_next_exchange():
    late_rank = PreemptionSignal(launched=False)
    try:
        # Its peer saw zeros and trains on: this rank must too, or it waits alone in its checkpoint's collectives.
        during = TwoRanks(peer_stop=None, during=lambda: late_rank._handle(signal.SIGUSR1, None))
        assert not late_rank.requested(during, exchange=True)
        assert late_rank.requested(TwoRanks(), exchange=True)  # the next exchange carries it (and the peer's Ctrl-C)
        assert late_rank.name == "SIGINT" and late_rank.exit_code == 130  # one name, the same on every rank
    finally:
        late_rank.close()


# ---------------------------------------------------------------------------------------------- data


def test_a_token_id_past_meta_outside_the_start_up_sample_stops_the_prefetcher(tmp_path):
    folder = write_data(tmp_path / "data", n_train=140_001)  # more than the sample's 16 blocks of 4096 tokens
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    sampled = np.zeros(len(tokens), dtype=bool)
    for start, stop in sample_blocks(len(tokens)):
        sampled[start:stop] = True
    position = int(np.flatnonzero(~sampled)[len(np.flatnonzero(~sampled)) // 2])
    tokens[position] = 60000
    tokens.tofile(folder / "train.bin")
    windows = TokenWindows(folder, "train", SEQ_LEN)  # start-up passes: the sample does not hold it
    window = position // SEQ_LEN
    with pytest.raises(UserError, match=f"token id 60000 at token {position} .*largest id meta.json records"):
        windows.window(window)
    batches = TrainBatches(windows, BatchLayout(len(windows), len(windows), 1, 0), seed=0)  # one step: every window
    prefetcher = Prefetcher(batches)
    try:
        with pytest.raises(UserError, match="changed or damaged after preparation"):
            prefetcher.get(0)
    finally:
        prefetcher.close()


def test_a_leftover_preparation_folder_names_its_destination(tmp_path):
    write_data(tmp_path / "data")
    leftover = tmp_path / "data.tmp-4242"
    leftover.mkdir()
    with pytest.raises(UserError) as info:
        load_meta(leftover)
    message = str(info.value)
    assert f"interrupted preparation into {tmp_path / 'data'}" in message and "--output " not in message


def test_prepare_refuses_a_vocabulary_it_cannot_train_and_names_a_broken_jsonl_line_once(tmp_path, caplog):
    from lmrecipe.data.prepare.pipeline import prepare

    corpus = write_corpus(tmp_path / "corpus")
    with pytest.raises(UserError, match="--vocab-size 1000000000 is too large"):
        prepare(output=tmp_path / "out", inputs=[corpus], vocab_size=10**9, num_proc=1)
    broken = tmp_path / "docs.jsonl"
    broken.write_text('{"text": "one"}\n{"text": "two"\n{"text": "three"}\n')
    with caplog.at_level(logging.INFO), pytest.raises(UserError) as info:
        prepare(output=tmp_path / "out", inputs=[broken], vocab_size=300, num_proc=1)
    assert "fix or remove the broken line" in str(info.value)
    assert str(info.value).count("JSON parse error") == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # said once, by the UserError
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "docs.jsonl"]


# ---------------------------------------------------------------------------------------------- checkpoints


def published(root: Path, step: int) -> Path:
    """A checkpoint folder published by the real store (manifest, sha256), with a real safetensors weight file."""
    from safetensors.torch import save_file

    store = CheckpointStore(SimpleNamespace(is_main_process=True), root, keep_last=5, background=False,
                            deepspeed=False, publish_timeout_s=10)
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{final.name}"
    tmp.mkdir()
    save_file({"w": torch.arange(64, dtype=torch.float32)}, tmp / "model.safetensors")
    store.publish(tmp, final, {"state": {"step": step}})
    return final


@pytest.mark.parametrize("damage", ["header", "content", "state_file", "no_manifest"])
def test_a_checkpoint_damaged_at_the_same_size_is_named_with_an_earlier_one(tmp_path, damage):
    earlier, damaged = published(tmp_path, 1), published(tmp_path, 2)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "header":
        data[20] = 0xFF  # invalid UTF-8 in the JSON header: safetensors' own "invalid UTF-8 in header"
    elif damage == "content":
        data[-8:] = b"\x7f" * 8  # the last weight changed, header intact
    weights.write_bytes(bytes(data))
    state = json.loads((damaged / STATE_FILE).read_text())
    if damage == "state_file":
        (damaged / STATE_FILE).write_text('{"format_version": 1, "state": ')
    elif damage == "no_manifest":
        del state["manifest"]
        (damaged / STATE_FILE).write_text(json.dumps(state))
    assert weights.stat().st_size == len(data)
    with pytest.raises(UserError) as info:
        read_checkpoint(damaged)
    message = str(info.value)
    assert f"checkpoint.resume={earlier}" in message, message
    if damage in ("header", "content"):
        assert "model.safetensors" in message and "its size is right, its content is not" in message
    read_checkpoint(earlier)  # untouched


def test_resume_or_export_of_a_folder_without_checkpoints_says_so(tmp_path):
    from lmrecipe.export import export_checkpoint

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="is not a training checkpoint .* and holds none") as info:
        find_resume_checkpoint(str(empty), tmp_path / "run" / "checkpoints")
    assert "checkpoint.resume=none" in str(info.value) and str(empty / LATEST) not in str(info.value)
    with pytest.raises(UserError) as info:
        export_checkpoint(empty, tmp_path / "export")
    assert "holds none" in str(info.value) and "checkpoint.resume" not in str(info.value)
    assert not (tmp_path / "export").exists()


# ------------------------------------------------------------------------------------------- the step cap


def test_the_step_cap_lowers_max_steps_to_the_sessions_start_plus_the_cap(tmp_path, tmp_path_factory, tiny_data,
                                                                           monkeypatch, caplog):
    from helpers import wsd_run

    from lmrecipe.train.callbacks.faults import MAX_STEPS_ENV, maybe_cap_steps

    source = wsd_run(tmp_path_factory, tiny_data, 16)  # checkpoints at steps 5, 10, 15 and 16

    def capped(out_dir: Path, *overrides: str) -> int:
        cfg = load_config("recipes/tiny.yaml", [f"out_dir={out_dir}", f"data.path={tiny_data}",
                                                "train.max_steps=100", *overrides])
        return maybe_cap_steps(cfg, out_dir).train.max_steps

    assert capped(tmp_path / "fresh") == 100  # unset: untouched
    monkeypatch.setenv(MAX_STEPS_ENV, "3")
    with caplog.at_level(logging.WARNING):
        assert capped(tmp_path / "fresh") == 3
    assert "LMRECIPE_MAX_STEPS=3: train.max_steps capped from 100 to 3 (this session starts at step 0)" in caplog.text
    assert capped(source) == 19  # resumes from its newest checkpoint, step 16
    assert capped(tmp_path / "branch", f"checkpoint.branch_from={source}/checkpoints/step_00000010") == 13
    assert capped(tmp_path / "fresh", "train.max_steps=2") == 2  # a shorter run is left as it is
    monkeypatch.setenv(MAX_STEPS_ENV, "0")
    with pytest.raises(UserError, match="LMRECIPE_MAX_STEPS='0' is not a number of optimizer steps"):
        capped(tmp_path / "fresh")
