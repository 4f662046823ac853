"""The hang watcher: a thread on every rank that names a rank stuck past its phase's budget and ends the run.

The main thread only marks where it is (:class:`ProgressBoard`: the step, the phase and when it entered it; Python
assignments, no tensor read). The thread (:class:`HangWatcher`) publishes one record per rank in the launcher's store
(torchrun's agent holds it; else rank 0's ``MASTER_ADDR:MASTER_PORT``), through a client of its own, so it goes on
while the main thread is blocked in a collective: its beat count (a frozen process stops counting) and that progress.
The watchers (local ranks 0 and 1 of each node) read every record; when a rank's phase lasts longer than its budget
(:class:`Budgets`) the first of them posts a verdict. Then every live rank dumps its Python stacks (all threads) and
the flight recorder's collectives (when ``TORCH_FR_BUFFER_SIZE`` was set before the process group existed), the lowest
live rank writes ``hang.md`` (:func:`hang_report`), each live rank kills a frozen peer on its own node, records
:data:`EXIT_HANG` in ``$LMRECIPE_EXIT_FILE`` and leaves with it (``os._exit``: its main thread is blocked). A deadline
ends the process :data:`EXIT_GRACE_S` after the verdict whatever the dumps do (a dead filesystem).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

from lmrecipe.cli import record_exit
from lmrecipe.fileio import atomic_path, write_text_atomic

logger = logging.getLogger(__name__)

EXIT_HANG = 3
"""The exit code of a run the watchdog ended (a launcher reports 1; ``$LMRECIPE_EXIT_FILE`` keeps 3)."""
HANG_FILE = "hang.md"
EXIT_GRACE_S = 40.0
"""After a verdict, a rank leaves at the latest this many seconds later, its dumps written or not."""
WARMUP_STEPS = 2
"""The session's first steps, never measured for ``hang_step_s=auto`` (compilation, allocator growth)."""
AUTO_STEP_FACTOR = 10.0
"""``auto``: this many times the median step time."""
AUTO_CAP = 0.9
"""``auto`` stays below this share of ``distributed.timeout_s``, so the watchdog speaks before the collective's timeout."""

START, FORWARD_BACKWARD, OPTIMIZER, STEP_END = "start", "forward/backward", "optimizer", "step end"
EVALUATION, CHECKPOINT, END, ERROR, CLOSED = "evaluation", "checkpoint", "export/end", "error", "closed"
PHASE_ORDER = {START: 0, FORWARD_BACKWARD: 1, OPTIMIZER: 2, STEP_END: 3, EVALUATION: 4, CHECKPOINT: 5, END: 6,
               ERROR: 7, CLOSED: 8}
"""Where each phase lies within a step: the rank earliest in (step, phase) is the one the others wait for."""


class ProgressBoard:
    """What the main thread tells the watcher: ``mark`` = (step, phase, changes, monotonic time it entered), replaced
    whole (one assignment: the thread reads a consistent tuple), and the measured step times."""

    def __init__(self):
        self.mark: tuple[int, str, int, float] = (0, START, 0, time.monotonic())
        self.first_step: int | None = None
        """The session's first step (resumed runs start above 1)."""
        self.step_times_s: deque[float] = deque(maxlen=100)
        """Seconds of the last steps after the session's first :data:`WARMUP_STEPS`."""

    def enter(self, step: int, phase: str) -> None:
        step_now, phase_now, changes, _ = self.mark
        if (step, phase) != (step_now, phase_now):
            self.mark = (step, phase, changes + 1, time.monotonic())

    def record_step(self, step: int, seconds: float) -> None:
        if self.first_step is None:
            self.first_step = step
        if step >= self.first_step + WARMUP_STEPS:
            self.step_times_s.append(seconds)


@dataclass(frozen=True)
class Budgets:
    """Each phase's budget in seconds (``distributed.hang_*_s``)."""

    step_s: float | None
    """A fixed step budget, or None for auto."""
    step_floor_s: float
    first_step_s: float
    checkpoint_s: float
    eval_s: float
    timeout_s: float

    @classmethod
    def of(cls, section) -> "Budgets":
        """From the ``distributed`` section."""
        return cls(section.fixed_hang_step_s(), section.hang_step_floor_s, section.hang_first_step_s,
                   section.hang_checkpoint_s, section.hang_eval_s, section.timeout_s)

    def step_budget(self, step_times_s) -> float | None:
        """A training step's phase budget; None until ``auto`` has a measured step."""
        if self.step_s is not None:
            return self.step_s
        return auto_step_budget(step_times_s, self.step_floor_s, self.timeout_s)

    def of_phase(self, step: int, phase: str, first_step: int | None, step_times_s) -> float:
        """The budget of ``phase`` in optimizer step ``step`` (the session's first is ``first_step``)."""
        if phase == EVALUATION:
            return self.eval_s
        if phase in (CHECKPOINT, END, ERROR, CLOSED):
            return self.checkpoint_s
        budget = self.step_budget(step_times_s)
        if phase == START or budget is None or first_step is None or step <= first_step:
            return self.first_step_s
        return budget

    def smallest(self) -> float:
        return min(self.step_s or self.step_floor_s, self.first_step_s, self.checkpoint_s, self.eval_s)


def auto_step_budget(step_times_s, floor_s: float, timeout_s: float) -> float | None:
    """max(``floor_s``, min(10 x the median of ``step_times_s``, 0.9 x ``timeout_s``)); None without a time."""
    times = list(step_times_s)
    if not times:
        return None
    return max(floor_s, min(AUTO_STEP_FACTOR * statistics.median(times), AUTO_CAP * timeout_s))


# ---- the verdict: who is stuck, from every rank's record (pure functions)


def silent_ranks(beat_age_s: dict[int, float], silence_s: float) -> set[int]:
    """Ranks whose beat has not changed for more than ``silence_s``: frozen (stopped, or holding Python's lock)."""
    return {rank for rank, age in beat_age_s.items() if age > silence_s}


def choose_stuck(records: dict[int, dict], world_size: int, silent: set[int]) -> tuple[list[int], str]:
    """The stuck rank(s) and why: a rank that never published, else a silent one, else one that left the loop with an
    error, else the one(s) earliest in (step, phase); when every rank is at the same place, all of them (the flight
    recorder may then tell, :func:`behind_by_flight_recorder`)."""
    missing = [rank for rank in range(world_size) if rank not in records]
    if missing:
        return missing, "never reached the training loop (no watchdog record)"
    if silent:
        return sorted(silent), "frozen: its watchdog went silent (a stopped process, or one holding Python's lock)"
    errored = sorted(rank for rank, record in records.items() if record["phase"] == ERROR)
    if errored:
        return errored, "left the loop with an error and did not end"
    active = {rank: (r["step"], PHASE_ORDER.get(r["phase"], 0)) for rank, r in records.items() if r["phase"] != CLOSED}
    earliest = min(active.values())
    behind = sorted(rank for rank, where in active.items() if where == earliest)
    if len(behind) < len(active):
        return behind, "earliest in (step, phase): the others wait for it"
    return behind, "every rank is at the same place (a shared cause: a filesystem, a collective every rank entered)"


def behind_by_flight_recorder(enqueued: dict[int, dict[str, int]]) -> list[int]:
    """Ranks that enqueued fewer collectives than another rank on some process group (their flight recorders' last
    enqueued sequence number, by group), or []: the one the others wait for in a collective."""
    if len(enqueued) < 2:
        return []
    groups = set.intersection(*(set(seqs) for seqs in enqueued.values()))
    behind: set[int] = set()
    for group in groups:
        seqs = {rank: seqs[group] for rank, seqs in enqueued.items()}
        if min(seqs.values()) < max(seqs.values()):
            behind.update(rank for rank, seq in seqs.items() if seq == min(seqs.values()))
    return sorted(behind)


def hang_report(verdict: dict, dumps: dict[int, dict]) -> str:
    """``hang.md``: the verdict (step, phase, the stuck ranks and why), then every rank's record and its dumps."""
    records = {int(rank): record for rank, record in verdict["records"].items()}
    stuck, silent = verdict["stuck"], set(verdict["silent"])
    waiting = [rank for rank in sorted(records) if rank not in stuck and records[rank]["phase"] != CLOSED]
    # Where the run stands: the waiting ranks' place (a frozen rank's record is up to one beat old), else the stuck's.
    places = [records[rank] for rank in waiting] or [records[rank] for rank in stuck if rank in records]
    first = min(places, key=lambda r: (r["step"], PHASE_ORDER.get(r["phase"], 0))) if places else None
    where = f"in step {first['step']} ({first['phase']})" if first else "at the start"
    lines = [f"# Hang {where}", ""]
    for rank in stuck:
        record = records.get(rank)
        seen = " last seen" if rank in silent else ""
        at = (f"{seen} in step {record['step']}, {record['phase']}, for {record['in_phase_s']:.0f} s (budget "
              f"{record['budget_s']:.0f} s)") if record else ""
        who = f"rank {rank} (pid {record['pid']} on {record['host']})" if record else f"rank {rank}"
        lines.append(f"- **Stuck: {who}**{at}: {verdict['why']}."
                     + (" A frozen process cannot dump its stacks; the live ranks on its node killed it." if rank in
                        silent else ""))
    for rank in waiting:
        record = records[rank]
        lines.append(f"- Waiting: rank {rank} (pid {record['pid']} on {record['host']}) in step {record['step']}, "
                     f"{record['phase']}, for {record['in_phase_s']:.0f} s.")
    lines += ["", f"Seen by rank {verdict['by']}; the run ended with exit code {EXIT_HANG} (a launcher reports 1; "
              "`$LMRECIPE_EXIT_FILE` keeps 3). Each live rank's Python stacks (all threads) are in "
              "`hang_stacks_rank<N>.txt`, its flight recorder's collectives (with `TORCH_FR_BUFFER_SIZE` set) in "
              "`hang_flight_rank<N>.json`. Resume with checkpoint.resume=auto.", "",
              "| rank | host | pid | step | phase | in phase (s) | budget (s) | heartbeat | stacks | flight recorder |",
              "|---:|---|---:|---:|---|---:|---:|---|---|---|"]
    for rank in sorted(records):
        r, dump = records[rank], dumps.get(rank, {})
        beat = "silent (frozen)" if rank in silent else "live"
        flight = dump.get("flight") or "-"
        if dump.get("enqueued"):
            flight += " (last enqueued: " + ", ".join(f"group {g} #{s}" for g, s in sorted(dump["enqueued"].items())) + ")"
        lines.append(f"| {rank} | {r['host']} | {r['pid']} | {r['step']} | {r['phase']} | {r['in_phase_s']:.1f} | "
                     f"{r['budget_s']:.0f} | {beat} | {dump.get('stacks') or '-'} | {flight} |")
    return "\n".join(lines) + "\n"


def hang_message(verdict: dict, out_dir: Path) -> str:
    """The one line every rank logs and records as its error."""
    records = {int(rank): record for rank, record in verdict["records"].items()}
    named = ", ".join(f"rank {rank}" + (f" (pid {records[rank]['pid']} on {records[rank]['host']}, step "
                                        f"{records[rank]['step']}, {records[rank]['phase']})" if rank in records else "")
                      for rank in verdict["stuck"])
    return (f"Training stopped by the hang watchdog: {named} made no progress within its budget ({verdict['why']}). "
            f"See {out_dir / HANG_FILE}. Resume with checkpoint.resume=auto.")


# ---- the thread


@dataclass(frozen=True)
class Peer:
    """This process as the records name it."""

    rank: int
    world_size: int
    host: str
    pid: int
    watches: bool
    """Whether this rank reads every record (local ranks 0 and 1)."""
    node: int = 0
    """Its launcher's rank among the launchers (torchrun's ``GROUP_RANK``): two launchers may share a host."""


def this_peer(rank: int, world_size: int, environ=os.environ) -> Peer:
    local_rank = int(environ.get("LOCAL_RANK", "0"))
    return Peer(rank, world_size, socket.gethostname(), os.getpid(), watches=local_rank < 2,
                node=int(environ.get("GROUP_RANK", "0")))


def launcher_store(timeout_s: float, environ=os.environ):
    """A new client of the launcher's store (``MASTER_ADDR:MASTER_PORT``: torchrun's agent, or rank 0's), or None."""
    import torch.distributed as dist

    host, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def store_prefix(environ=os.environ) -> str:
    """Keys of this launch's attempt only (an agent's store outlives a restarted attempt)."""
    return f"lmrecipe/hang/{environ.get('TORCHELASTIC_RUN_ID', 'run')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class HangWatcher:
    """The daemon thread of the module docstring. ``exit`` ends the process (tests pass their own)."""

    def __init__(self, peer: Peer, board: ProgressBoard, budgets: Budgets, out_dir: Path, store, *,
                 prefix: str = "", exit: Callable[[int], None] = os._exit):
        self.peer, self.board, self.budgets, self.out_dir = peer, board, budgets, Path(out_dir)
        self.store, self.prefix, self._exit = store, prefix, exit
        self.poll_s = min(5.0, max(0.25, budgets.smallest() / 20))
        # Four missed beats; below half a budget, so a peer frozen when its phase began is silent by its verdict.
        self.silence_s = min(max(2.0, 4 * self.poll_s), budgets.smallest() / 2)
        self.acting = threading.Event()
        """Set once a verdict is being carried out (the main thread's error path then waits for the exit)."""
        self._stop = threading.Event()
        self._beat = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (beat, monotonic time it last changed)
        self._thread = threading.Thread(target=self._run, name="lmrecipe-hang-watchdog", daemon=True)

    def key(self, *parts) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def start(self) -> "HangWatcher":
        self._publish()
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching; this rank's record says it has closed (no peer waits for it any more)."""
        if self.acting.is_set():
            return
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 10)
        self.board.enter(self.board.mark[0], CLOSED)
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the store may be gone with the launcher at the end
            pass

    def wait_for_exit(self) -> None:
        """Block until the verdict's exit (called by the main thread when its collective breaks meanwhile)."""
        time.sleep(EXIT_GRACE_S + 5)

    # ---- each beat

    def record(self) -> dict:
        step, phase, changes, since = self.board.mark
        budget = self.budgets.of_phase(step, phase, self.board.first_step, self.board.step_times_s)
        return {"beat": self._beat, "host": self.peer.host, "node": self.peer.node, "pid": self.peer.pid, "step": step,
                "phase": phase, "changes": changes, "in_phase_s": round(time.monotonic() - since, 3), "budget_s": budget}

    def _publish(self) -> None:
        self._beat += 1
        self.store.set(self.key("record", self.peer.rank), json.dumps(self.record()))

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_s):
            try:
                self._publish()
                verdict = self._posted_verdict()
                if verdict is None and self.peer.watches:
                    verdict = self._look()
                failures = 0
            except Exception as err:  # noqa: BLE001 - a store that does not answer must not end the thread
                failures += 1
                if failures == 1:
                    logger.warning("hang watchdog: the launcher's store did not answer (%s); retrying", err)
                continue
            if verdict is not None:
                self._act(verdict)
                return

    def _posted_verdict(self) -> dict | None:
        key = self.key("verdict")
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def _look(self) -> dict | None:
        """Read every record; post and return a verdict when a rank stalls past its budget."""
        now = time.monotonic()
        records: dict[int, dict] = {}
        keys = [self.key("record", rank) for rank in range(self.peer.world_size)]
        if self.store.check(keys):
            values = self.store.multi_get(keys)
        else:  # some rank has not started its watchdog yet
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        beat_age: dict[int, float] = {}
        for rank, value in enumerate(values):
            if value is None:
                continue
            record = json.loads(value)
            beat, changed = self._seen.get(rank, (None, now))
            if beat != record["beat"]:
                changed = now
            self._seen[rank] = (record["beat"], changed)
            beat_age[rank] = now - changed
            record["in_phase_s"] = round(record["in_phase_s"] + beat_age[rank], 3)  # a frozen rank's stall grows
            records[rank] = record
        stalled = [rank for rank, r in records.items() if r["phase"] != CLOSED and r["in_phase_s"] > r["budget_s"]]
        if not stalled:
            return None
        silent = silent_ranks({r: age for r, age in beat_age.items() if records[r]["phase"] != CLOSED}, self.silence_s)
        stuck, why = choose_stuck(records, self.peer.world_size, silent)
        live = sorted(set(records) - silent - {r for r in records if records[r]["phase"] == CLOSED})
        verdict = {"by": self.peer.rank, "stuck": stuck, "why": why, "silent": sorted(silent), "live": live,
                   "writer": live[0] if live else self.peer.rank, "records": records}
        posted = self.store.compare_set(self.key("verdict"), "", json.dumps(verdict))
        return json.loads(posted)  # the first watcher's verdict wins

    # ---- the verdict carried out

    def _act(self, verdict: dict) -> None:
        self.acting.set()
        deadline = threading.Timer(EXIT_GRACE_S, self._exit, (EXIT_HANG,))
        deadline.daemon = True
        deadline.start()
        rank = self.peer.rank
        try:
            dump = self._dump()
        except Exception as err:  # noqa: BLE001 - the report and the exit come first
            logger.warning("hang watchdog: the dumps failed: %s", err)
            dump = {}
        try:
            self.store.set(self.key("dump", rank), json.dumps(dump))
            if rank == verdict["writer"]:
                self._write_report(verdict, dump)
            else:
                self._wait_for([self.key("written")], EXIT_GRACE_S / 2)
                if self.store.check([self.key("written")]):
                    verdict = json.loads(self.store.get(self.key("written")))  # the flight recorder may have refined it
        except Exception as err:  # noqa: BLE001 - still kill the frozen peers and leave
            logger.warning("hang watchdog: %s", err)
        self._kill_frozen_local_peers(verdict)
        message = hang_message(verdict, self.out_dir)
        logger.error("%s", message)
        record_exit(rank, EXIT_HANG, message)
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._exit(EXIT_HANG)
        deadline.cancel()  # reached only where ``exit`` returns (tests)

    def _dump(self) -> dict:
        """This rank's stacks and flight recorder, written beside ``hang.md``; what was written."""
        rank, written = self.peer.rank, {}
        try:
            name = f"hang_stacks_rank{rank}.txt"
            with atomic_path(self.out_dir / name) as tmp, open(tmp, "w") as fh:
                fh.write(f"# rank {rank}, pid {self.peer.pid} on {self.peer.host}: every thread's Python stack\n")
                fh.flush()
                faulthandler.dump_traceback(fh, all_threads=True)
            written["stacks"] = name
        except OSError as err:
            logger.warning("hang watchdog: could not write the stacks: %s", err)
        trace = flight_recorder_trace()
        if trace is not None:
            try:
                name = f"hang_flight_rank{rank}.json"
                write_text_atomic(self.out_dir / name, trace)
                written["flight"] = name
            except OSError as err:
                logger.warning("hang watchdog: could not write the flight recorder: %s", err)
            written["enqueued"] = last_enqueued(trace)
        return written

    def _write_report(self, verdict: dict, own: dict) -> None:
        live = verdict["live"]
        keys = {rank: self.key("dump", rank) for rank in live}
        self._wait_for(list(keys.values()), EXIT_GRACE_S / 3)
        dumps = {rank: json.loads(self.store.get(key)) if self.store.check([key]) else {} for rank, key in keys.items()}
        dumps[self.peer.rank] = own
        if verdict["why"].startswith("every rank is at the same place"):
            behind = behind_by_flight_recorder({r: d["enqueued"] for r, d in dumps.items() if d.get("enqueued")})
            if behind:
                verdict.update(stuck=behind, why="fewest collectives enqueued (flight recorder): the others wait "
                                                 "for it in a collective")
        write_text_atomic(self.out_dir / HANG_FILE, hang_report(verdict, dumps))
        self.store.set(self.key("written"), json.dumps(verdict))

    def _wait_for(self, keys: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.1)

    def _kill_frozen_local_peers(self, verdict: dict) -> None:
        """SIGKILL the silent ranks on this node (this host, this launcher): a stopped process would otherwise hold the
        launcher for its grace period (about 30 s under torchrun). Another launcher's ranks are its node's to end."""
        for rank in verdict["silent"]:
            record = verdict["records"].get(str(rank)) or verdict["records"].get(rank)
            if record and record["host"] == self.peer.host and record.get("node", 0) == self.peer.node \
                    and record["pid"] != self.peer.pid:
                try:
                    os.kill(record["pid"], signal.SIGKILL)
                except OSError:
                    pass


def flight_recorder_trace() -> str | None:
    """torch's flight recorder as JSON (its collectives), or None when it is off (``TORCH_FR_BUFFER_SIZE`` unset)."""
    if int(os.environ.get("TORCH_FR_BUFFER_SIZE", "0") or 0) <= 0:
        return None
    try:
        import torch

        trace = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True, onlyActive=False)
        return trace.decode() if isinstance(trace, bytes) else trace
    except (AttributeError, RuntimeError, UnicodeDecodeError) as err:
        logger.warning("hang watchdog: no flight recorder: %s", err)
        return None


def last_enqueued(trace: str) -> dict[str, int]:
    """Each process group's last enqueued collective (sequence number) in a flight-recorder trace."""
    try:
        status = json.loads(trace).get("pg_status", {})
        return {group: int(s["last_enqueued_collective"]) for group, s in status.items()}
    except (ValueError, KeyError, TypeError):
        return {}
