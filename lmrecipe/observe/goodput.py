"""Goodput: where the run's wall time went, ``out_dir/goodput.json`` and the report's "Goodput" section.

Every session of the run (a launch, a resume) keeps one entry, which the main process rewrites at every logged step,
after every checkpoint and at the end (:class:`SessionLedger`): when the process started, the step it started at,
and its seconds of start-up (process start to the first step: imports, building the model, the resume), of training
steps (the trainer's step times) and of data wait inside them, of checkpoints, of evaluations, of steps a rollback
discarded, the cumulative step seconds at each checkpoint it saved, and when it last wrote.

:func:`summarize` turns the sessions into the run's account. The wall time runs from the first session's process start
to the last session's last record. A step is *repeated* when a later session resumed from a checkpoint before it (its
seconds: the session's step seconds after that checkpoint) or a rollback discarded it. A *restart* is the time from
a session's last record to the next session's process start: the steps after the last record, the failure, its
detection and the relaunch. *Productive* is the time in training steps that stand, less their data wait; the goodput
is its share of the wall time. What no category holds (logging between steps, a rollback's reload) is *other*. The
last record is written before the end's export and report, which the account leaves out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import psutil

from lmrecipe.fileio import write_json_atomic

GOODPUT_FILE = "goodput.json"

CATEGORIES = (("productive_s", "productive steps (time in steps that stand, data wait left out)"),
              ("startup_s", "start-up (process start to the first step: imports, model, resume)"),
              ("restart_s", "restarts (a session's last record to the next session's start)"),
              ("repeated_s", "repeated steps (after the checkpoint a resume or a rollback went back to)"),
              ("checkpoint_s", "checkpoints"),
              ("eval_s", "evaluation"),
              ("data_wait_s", "waiting for data (inside steps)"),
              ("other_s", "other (logging between steps, a rollback's reload)"))


def process_start() -> float:
    """This process's start (seconds since the epoch)."""
    return psutil.Process().create_time()


class SessionLedger:
    """This session's entry of ``goodput.json``: the seconds of each kind, and the cumulative step seconds at each
    checkpoint it saved (what a later resume from that checkpoint repeats is measured from them)."""

    def __init__(self, start_step: int, started_at: float):
        self.entry = {"started_at": started_at, "start_step": start_step, "updated_at": started_at,
                      "last_step": start_step, "startup_s": 0.0, "steps_s": 0.0, "data_wait_s": 0.0,
                      "checkpoint_s": 0.0, "eval_s": 0.0, "rolled_back_s": 0.0, "saved": {str(start_step): 0.0}}

    def add(self, key: str, seconds: float) -> None:
        self.entry[key] += seconds

    def step_done(self, step: int, step_s: float, data_wait_s: float) -> None:
        self.entry["steps_s"] += step_s
        self.entry["data_wait_s"] += data_wait_s
        self.entry["last_step"] = step

    def saved(self, step: int) -> None:
        self.entry["saved"][str(step)] = self.entry["steps_s"]

    def rolled_back(self, step: int) -> None:
        """The run went back to the checkpoint of ``step``: the step seconds since it are repeated."""
        since = self.entry["saved"].get(str(step), 0.0)
        self.entry["rolled_back_s"] += max(self.entry["steps_s"] - self.entry["rolled_back_s"] - since, 0.0)
        self.entry["saved"] = {k: v for k, v in self.entry["saved"].items() if int(k) <= step}
        self.entry["saved"][str(step)] = self.entry["steps_s"] - self.entry["rolled_back_s"]

    def write(self, out_dir: Path) -> None:
        """Rewrite this session's entry in ``goodput.json`` (the earlier sessions' kept; a fresh start drops them)."""
        self.entry["updated_at"] = time.time()
        sessions = [s for s in read_sessions(out_dir) if s["started_at"] != self.entry["started_at"]]
        if self.entry["start_step"] == 0:
            sessions = []  # a fresh start: the earlier sessions trained a history this run has dropped
        write_json_atomic(out_dir / GOODPUT_FILE, {"sessions": [*sessions, self.entry]})


def read_sessions(out_dir: Path) -> list[dict]:
    """The sessions of ``goodput.json`` in order ([] when there is none, or it is unreadable)."""
    try:
        return json.loads((Path(out_dir) / GOODPUT_FILE).read_text())["sessions"]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def summarize(sessions: list[dict]) -> dict | None:
    """The run's account (:data:`CATEGORIES`, ``wall_s``, ``goodput``) from its sessions; None without any."""
    if not sessions:
        return None
    total = {key: 0.0 for key, _ in CATEGORIES}
    for i, session in enumerate(sessions):
        for key in ("startup_s", "checkpoint_s", "eval_s", "data_wait_s"):
            total[key] += session[key]
        repeated = session["rolled_back_s"]
        if i + 1 < len(sessions):
            after = sessions[i + 1]
            repeated += _repeated_by_resume(session, after["start_step"])
            total["restart_s"] += max(after["started_at"] - session["updated_at"], 0.0)
        total["repeated_s"] += repeated
        total["productive_s"] += max(session["steps_s"] - repeated - session["data_wait_s"], 0.0)
    wall_s = sessions[-1]["updated_at"] - sessions[0]["started_at"]
    total["other_s"] = max(wall_s - sum(total.values()), 0.0)
    return {**total, "wall_s": wall_s, "goodput": total["productive_s"] / wall_s if wall_s > 0 else None,
            "sessions": len(sessions)}


def _repeated_by_resume(session: dict, resumed_at: int) -> float:
    """The step seconds of ``session`` after the checkpoint the next session resumed from (all of them when it saved
    no checkpoint at or before that step)."""
    kept = session["steps_s"] - session["rolled_back_s"]
    saved = {int(step): seconds for step, seconds in session["saved"].items() if int(step) <= resumed_at}
    return kept - saved[max(saved)] if saved else kept


def slowest_rank_wait_s(rows: list[dict]) -> float | None:
    """Seconds the logged intervals' steps spent on the slowest rank's forward beyond the median rank's (the
    straggler instrument's ``compute_s_max`` - ``compute_s_median`` per step, times the interval's steps): time the
    other ranks waited for it; None when no row carries the figures."""
    timed = [r for r in rows if "compute_s_max" in r and "compute_s_median" in r]
    if not timed:
        return None
    return sum((r["compute_s_max"] - r["compute_s_median"]) * (r.get("interval_steps") or 1) for r in timed)


def report_lines(out_dir: Path, rows: list[dict]) -> list[str]:
    """The report's "Goodput" section from ``goodput.json`` and the metrics ``rows``; nothing when the run wrote no
    ``goodput.json``."""
    account = summarize(read_sessions(out_dir))
    if account is None:
        return []
    wall_s = account["wall_s"]
    lines = ["## Goodput", "",
             f"{_pct(account['goodput'])} of the wall time ({wall_s:,.1f} s from the first process start to the last "
             f"record, {account['sessions']} session(s)) went into productive steps (`{GOODPUT_FILE}`).", "",
             "| where the wall time went | seconds | share |", "| --- | --- | --- |"]
    lines += [f"| {name} | {account[key]:,.1f} | {_pct(account[key] / wall_s if wall_s > 0 else None)} |"
              for key, name in CATEGORIES]
    waited = slowest_rank_wait_s(rows)
    if waited is not None:
        lines += ["", f"Inside the steps, the slowest rank's forward took {waited:,.1f} s more than the median rank's "
                      "over the logged intervals: time the other ranks waited for it (`distributed.stragglers`)."]
    return lines + [""]


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f} %"
