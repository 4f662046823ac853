"""The hang watchdog in one process: the budgets, the choice of the stuck rank, the phases the hooks mark, two
watcher threads on a real store naming a frozen peer, and every process group's timeout bounded."""

from __future__ import annotations

import json
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import TINY_OVERRIDES

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.parallel.timeouts import bound_group_timeouts, group_timeouts_s
from lmrecipe.train import hang
from lmrecipe.train import trainer as trainer_module
from lmrecipe.train.callback import Callback
from lmrecipe.train.callbacks.watchdog import Watchdog
from lmrecipe.train.hang import (CHECKPOINT, EVALUATION, EXIT_HANG, FORWARD_BACKWARD, OPTIMIZER, START, STEP_END,
                                 Budgets, HangWatcher, Peer, ProgressBoard)
from lmrecipe.train.step import Gradients, StepResult
from lmrecipe.train.trainer import Trainer

# ---- budgets


def test_auto_budget_is_ten_median_steps_above_the_floor_and_below_the_timeout():
    assert hang.auto_step_budget([], 120, 1800) is None
    assert hang.auto_step_budget([0.2, 0.3, 9.0], 120, 1800) == 120  # 10 x 0.3 s is under the floor
    assert hang.auto_step_budget([20.0, 30.0, 25.0], 120, 1800) == 250
    assert hang.auto_step_budget([500.0], 120, 1800) == pytest.approx(1620)  # 0.9 x timeout_s
    assert hang.auto_step_budget([500.0], 1700, 1800) == 1700  # the floor wins over the cap


def test_each_phase_has_its_budget():
    auto = Budgets(step_s=None, step_floor_s=5, first_step_s=60, checkpoint_s=30, eval_s=20, timeout_s=100)
    assert auto.of_phase(0, START, None, []) == 60
    assert auto.of_phase(3, FORWARD_BACKWARD, 1, []) == 60  # nothing measured yet: the first step's budget
    assert auto.of_phase(1, OPTIMIZER, 1, [2.0]) == 60  # the session's first step
    assert auto.of_phase(5, STEP_END, 1, [2.0]) == 20  # 10 x 2 s
    assert auto.of_phase(5, EVALUATION, 1, [2.0]) == 20 and auto.of_phase(5, CHECKPOINT, 1, [2.0]) == 30
    fixed = Budgets(step_s=7, step_floor_s=5, first_step_s=60, checkpoint_s=30, eval_s=20, timeout_s=100)
    assert fixed.of_phase(2, FORWARD_BACKWARD, 1, []) == 7 and fixed.of_phase(1, FORWARD_BACKWARD, 1, []) == 60


def test_the_board_counts_changes_and_measures_steps_after_the_warmup():
    board = ProgressBoard()
    board.enter(3, FORWARD_BACKWARD)
    board.enter(3, FORWARD_BACKWARD)  # the same place again is no progress
    board.enter(3, OPTIMIZER)
    assert board.mark[:3] == (3, OPTIMIZER, 2)
    for step in (3, 4, 5, 6):
        board.record_step(step, float(step))
    assert board.first_step == 3 and list(board.step_times_s) == [5.0, 6.0]  # steps 3 and 4 are the warm-up


def test_budgets_at_or_above_the_timeout_are_refused_at_load():
    with pytest.raises(UserError, match=r"distributed.hang_first_step_s=900, distributed.hang_checkpoint_s=900.* "
                                        r"below distributed.timeout_s=600"):
        load_config("recipes/tiny.yaml", [*TINY_OVERRIDES, "distributed.timeout_s=600"])
    with pytest.raises(UserError, match="hang_step_s='soon' must be auto or a positive number"):
        load_config("recipes/tiny.yaml", [*TINY_OVERRIDES, "distributed.hang_step_s=soon"])
    cfg = load_config("recipes/tiny.yaml", [*TINY_OVERRIDES, "distributed.timeout_s=600", "distributed.hang_watchdog=false"])
    assert cfg.distributed.fixed_hang_step_s() is None


# ---- the verdict


def record(step, phase, beat=1, in_phase_s=1.0, budget_s=5.0, pid=100, host="node0"):
    return {"beat": beat, "host": host, "pid": pid, "step": step, "phase": phase, "changes": 1,
            "in_phase_s": in_phase_s, "budget_s": budget_s}


def test_the_stuck_rank_is_the_silent_one_else_the_earliest_else_every_rank():
    waiting = {0: record(7, FORWARD_BACKWARD), 1: record(7, FORWARD_BACKWARD), 2: record(7, FORWARD_BACKWARD)}
    assert hang.choose_stuck(waiting, 3, silent={1})[0] == [1]
    assert hang.choose_stuck({0: record(7, FORWARD_BACKWARD)}, 2, silent=set())[0] == [1]  # rank 1 never published
    behind = {**waiting, 2: record(7, OPTIMIZER), 0: record(8, FORWARD_BACKWARD)}
    stuck, why = hang.choose_stuck(behind, 3, silent=set())
    assert stuck == [1] and why.startswith("earliest")
    stuck, why = hang.choose_stuck(waiting, 3, silent=set())
    assert stuck == [0, 1, 2] and why.startswith("every rank is at the same place")
    assert hang.choose_stuck({**waiting, 2: record(7, "error")}, 3, silent=set())[0] == [2]


def test_the_flight_recorder_names_the_rank_behind_in_a_collective():
    assert hang.behind_by_flight_recorder({0: {"0": 41, "1": 3}, 1: {"0": 40, "1": 3}, 2: {"0": 41}}) == [1]
    assert hang.behind_by_flight_recorder({0: {"0": 41}, 1: {"0": 41}}) == []
    trace = json.dumps({"pg_status": {"0": {"last_enqueued_collective": "12"}, "1": {"last_enqueued_collective": "-1"}}})
    assert hang.last_enqueued(trace) == {"0": 12, "1": -1}


def test_the_report_names_the_stuck_rank_and_where_the_others_wait():
    verdict = {"by": 0, "stuck": [1], "why": "frozen: its watchdog went silent", "silent": [1], "live": [0],
               "writer": 0, "records": {"0": record(7, FORWARD_BACKWARD, in_phase_s=12.5, pid=11),
                                        "1": record(7, OPTIMIZER, in_phase_s=13.0, pid=12, host="node1")}}
    text = hang.hang_report(verdict, {0: {"stacks": "hang_stacks_rank0.txt", "enqueued": {"0": 41}}})
    assert text.startswith("# Hang in step 7 (forward/backward)")  # where the live ranks wait
    assert "**Stuck: rank 1 (pid 12 on node1)** last seen in step 7, optimizer, for 13 s (budget 5 s): frozen" in text
    assert "- Waiting: rank 0 (pid 11 on node0) in step 7, forward/backward, for 12 s." in text
    assert "| 0 | node0 | 11 | 7 | forward/backward | 12.5 | 5 | live | hang_stacks_rank0.txt | - (last enqueued: group 0 #41) |" in text
    assert "cannot dump its stacks" in text


# ---- the hooks


def test_the_hooks_mark_each_phase_and_a_save_point_only_when_it_saves(monkeypatch):
    monkeypatch.setattr(trainer_module, "forward_backward",
                        lambda run, step, timer=None: Gradients(0.1, 1, 1, torch.tensor(1.0), None, None, None, 0.0))
    monkeypatch.setattr(trainer_module, "optim_step", lambda run, gradients, timer=None: StepResult(
        gradients.loss_sum, gradients.lr, torch.tensor(1.0), torch.tensor(False), 0.0))
    section = load_config("recipes/tiny.yaml", TINY_OVERRIDES).distributed
    accelerator = SimpleNamespace(num_processes=1, process_index=0, is_main_process=True,
                                  wait_for_everyone=lambda: None, end_training=lambda: None)
    watchdog = Watchdog(section)
    seen: list = []

    class Spy(Callback):  # listed after the watchdog: sees the phase it marked at each hook

        def __getattribute__(self, attr):
            if attr in ("on_start", "before_step", "pre_optim_step", "after_step", "eval_figures", "on_save", "on_end"):
                return lambda trainer, *args: seen.append((attr, *watchdog.board.mark[:2])) or {}
            return super().__getattribute__(attr)

    validation = SimpleNamespace(due=lambda step: step == 2, losses=lambda: {"data": 2.0}, is_mixture=False,
                                 loss=lambda per_source=None: 2.0, generate=lambda step: {})
    run = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(max_steps=2)), tokens_per_step=10,
                          accelerator=accelerator)
    checkpointer = SimpleNamespace(due=lambda step: step == 2)
    Trainer(run, Path("unused"), checkpointer, [watchdog, Spy()], validation=validation).fit()
    assert seen == [("on_start", 0, START),
                    ("before_step", 1, FORWARD_BACKWARD), ("pre_optim_step", 1, OPTIMIZER), ("after_step", 1, STEP_END),
                    ("on_save", 1, STEP_END),  # step 1 saves nothing
                    ("before_step", 2, FORWARD_BACKWARD), ("pre_optim_step", 2, OPTIMIZER), ("after_step", 2, STEP_END),
                    ("eval_figures", 2, EVALUATION), ("on_save", 2, CHECKPOINT), ("on_end", 2, "export/end")]
    assert watchdog.watcher is None  # one process: nothing to watch


# ---- two watchers on a real store


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))


def watcher(store, rank: int, board: ProgressBoard, budgets: Budgets, out: Path, exits: list) -> HangWatcher:
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    peer = Peer(rank, 2, "node0", 1000 + rank, watches=True)  # pids of no process: nothing to kill
    return HangWatcher(peer, board, budgets, out, client, prefix=f"t{id(store)}/", exit=exits.append)


def test_a_frozen_rank_is_killed_only_by_its_own_launchers_ranks(tmp_path, store, monkeypatch):
    """Two launchers on one host (two SLURM "nodes" on one machine): a rank of launcher 1 frozen is not killed by
    launcher 0's ranks, which would make its node's outcome a kill instead of the stop srun sends."""
    killed = []
    monkeypatch.setattr(hang.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    verdict = {"silent": [1], "records": {"1": {"host": "node0", "node": 1, "pid": 4321}}}
    mine = watcher(store, 0, ProgressBoard(), Budgets(4.0, 4.0, 60.0, 60.0, 60.0, 120.0), tmp_path, [])
    mine._kill_frozen_local_peers(verdict)
    assert killed == []
    mine.peer = Peer(0, 2, "node0", 1000, watches=True, node=1)
    mine._kill_frozen_local_peers(verdict)
    assert killed == [(4321, signal.SIGKILL)]


def test_watchers_name_a_frozen_peer_and_end_within_the_budget(tmp_path, store, monkeypatch):
    monkeypatch.setenv("LMRECIPE_EXIT_FILE", str(tmp_path / "exit.json"))
    budgets = Budgets(step_s=1.0, step_floor_s=1.0, first_step_s=1.0, checkpoint_s=1.0, eval_s=1.0, timeout_s=100)
    boards = [ProgressBoard(), ProgressBoard()]
    for board in boards:
        board.first_step = 1
        board.enter(5, FORWARD_BACKWARD)
    exits: list = []
    live = watcher(store, 0, boards[0], budgets, tmp_path, exits).start()
    frozen = watcher(store, 1, boards[1], budgets, tmp_path, exits).start()
    time.sleep(0.3)
    frozen._stop.set()  # its thread stops beating, as a SIGSTOPped process's does
    start = time.monotonic()
    while not exits and time.monotonic() - start < 10:
        time.sleep(0.05)
    assert exits == [EXIT_HANG] and time.monotonic() - start < 1.0 + 2.0
    report = (tmp_path / "hang.md").read_text()
    assert "**Stuck: rank 1 (pid 1001 on node0)** last seen in step 5, forward/backward" in report and "frozen" in report
    assert "- Waiting: rank 0 (pid 1000 on node0) in step 5, forward/backward" in report
    stacks = (tmp_path / "hang_stacks_rank0.txt").read_text()
    assert stacks.count("Thread 0x") >= 2 and "in _dump" in stacks  # every thread: this one and the test's at least
    assert json.loads((tmp_path / "exit.json").read_text())["exit_code"] == EXIT_HANG
    assert not (tmp_path / "hang_stacks_rank1.txt").exists()
    live._stop.set()


def test_a_long_phase_within_its_own_budget_does_not_trip(tmp_path, store):
    budgets = Budgets(step_s=0.5, step_floor_s=0.5, first_step_s=0.5, checkpoint_s=3.0, eval_s=3.0, timeout_s=100)
    boards = [ProgressBoard(), ProgressBoard()]
    exits: list = []
    watchers = [watcher(store, rank, boards[rank], budgets, tmp_path, exits).start() for rank in (0, 1)]
    for board in boards:
        board.first_step = 1
        board.enter(4, CHECKPOINT)  # past the step budget, within the checkpoint's
    time.sleep(1.5)
    for board in boards:
        board.enter(5, FORWARD_BACKWARD)
    for _ in range(6):  # steps of 0.2 s each
        time.sleep(0.2)
        for board in boards:
            board.enter(board.mark[0] + 1, FORWARD_BACKWARD)
    assert exits == [] and not (tmp_path / "hang.md").exists()
    for w in watchers:
        w.close()
    assert json.loads(watchers[0].store.get(watchers[0].key("record", 0)))["phase"] == "closed"


# ---- the collectives' timeout


def test_every_process_group_gets_the_recipes_timeout(tmp_path):
    """DeepSpeed's groups come from ``new_group`` without a timeout: torch's 30 minutes, not the world group's."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        dist.new_group([0])
        assert sorted(group_timeouts_s().values()) == [60.0, 1800.0]
        assert bound_group_timeouts(45) == 2
        assert list(group_timeouts_s().values()) == [45.0, 45.0]
    finally:
        dist.destroy_process_group()
