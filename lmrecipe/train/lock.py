"""One training run per ``out_dir``: a lock file that names its holder, and is recognised as stale once it dies.

``out_dir/run.lock`` holds JSON ``{"host", "pid", "started", "slurm_job_id"}`` and is created exclusively by the
main process before the run touches anything else in the folder. A heartbeat thread refreshes its modification
time every ``HEARTBEAT_S`` seconds. Another run refuses to start while the lock is live; it takes the lock over
when the holder is provably gone:

- same host, and the process no longer exists (a ``kill -9``, a crash, a reboot);
- the same SLURM job id (a requeued job, or its training step run again, continuing its own run, on whichever node);
- any host, and no heartbeat for ``STALE_AFTER_S`` seconds (a dead or unreachable host).

The lock is removed when the run ends, including by a preemption stop or a user error.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

from lmrecipe.errors import fail

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunLock:
    def __init__(self, out_dir: str | os.PathLike):
        self.path = Path(out_dir) / LOCK_FILE
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    def _payload(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "slurm_job_id": os.environ.get("SLURM_JOB_ID")}

    def _stale_reason(self, holder: dict) -> str | None:
        """Why the lock ``holder`` no longer runs, or None if it may still be running."""
        mine = self._payload()
        if holder.get("slurm_job_id") and holder.get("slurm_job_id") == mine["slurm_job_id"]:
            return f"it belongs to this SLURM job ({mine['slurm_job_id']}), requeued or run again"
        if holder.get("host") == mine["host"] and not _pid_alive(int(holder.get("pid", -1))):
            return f"process {holder.get('pid')} on this host no longer exists"
        try:
            silent_s = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it was removed"
        if silent_s > STALE_AFTER_S:
            return f"its heartbeat stopped {silent_s:.0f} s ago"
        return None

    def acquire(self) -> None:
        """Take the lock or raise a UserError naming the run that holds it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    holder = json.loads(self.path.read_text() or "{}")
                except (OSError, ValueError):
                    holder = {}
                reason = self._stale_reason(holder)
                if reason is None:
                    raise fail(
                        f"{self.path.parent} is in use by another training run (pid {holder.get('pid')} on "
                        f"{holder.get('host')}, started {holder.get('started')}; lock file {self.path}). Two runs in one "
                        "out_dir would delete each other's checkpoints. Choose another out_dir, or stop that run; if it "
                        f"is dead and on another host, delete {self.path}."
                    ) from None
                logger.warning("Taking over %s: %s.", self.path, reason)
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(self._payload(), fh)
            self.held = True
            self._thread = threading.Thread(target=self._heartbeat, name="run-lock", daemon=True)
            self._thread.start()
            return
        raise fail(f"Could not take {self.path}: other runs keep creating it. Start one run per out_dir.")

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        if not self.held:
            return
        self._stop.set()
        try:
            holder = json.loads(self.path.read_text())
            if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
                self.path.unlink()
        except (OSError, ValueError):
            pass
        self.held = False
