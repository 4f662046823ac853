"""``checkpoint.remote``: the run's checkpoints, export and report mirrored to object storage.

:func:`build_remote_callbacks` checks when the run is built that the URL can be written (exit 2 naming the URL and
the fix otherwise). :class:`RemoteResume` (before checkpointing's resume), with ``checkpoint.resume=auto``, downloads
the newest complete remote checkpoint when the local folder has none or an older one (a job requeued onto a fresh
node), each rank its share. :class:`RemoteUpload` (after the checkpoint's save) uploads each published checkpoint on
a worker thread per rank, so the loop never waits; one upload runs at a time and a newer checkpoint supersedes one
still queued. At the end it waits for the uploads (a progress bar, at most ``checkpoint.remote_wait_s``) and uploads
the export, before the report is written; :class:`RemoteReport` uploads the report last. What could not be uploaded
in time is named (and recorded in ``final.json``). The files and the commit order are
``lmrecipe/checkpoint/remote.py``'s.

Test fault: ``LMRECIPE_FAULT_KILL_UPLOAD=step_N:K`` kills the main process (SIGKILL) after it uploaded K files of
checkpoint ``step_N``; ``step_N+:K`` of the first checkpoint from ``step_N`` on that is uploaded (a loaded machine can
supersede ``step_N`` itself).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

from lmrecipe.checkpoint.remote import CheckpointMirror, RemoteLatestError, download_dir
from lmrecipe.checkpoint.storage import (
    PREEMPTED_MARKER,
    STATE_FILE,
    TMP_PREFIX,
    find_resume_checkpoint,
    step_dir_name,
    step_of_dir,
)
from lmrecipe.config import CheckpointConfig
from lmrecipe.errors import EXIT_USER_ERROR, UserError, fail
from lmrecipe.fileio import remove_path
from lmrecipe.objstore import READ_PATIENCE_S, Store, check_access, retrying, transient_errors, unreadable
from lmrecipe.train.callback import Callback
from lmrecipe.train.lock import LOCK_FILE

logger = logging.getLogger(__name__)

KILL_FAULT_ENV = "LMRECIPE_FAULT_KILL_UPLOAD"
_RUN_FILES_SKIPPED = {LOCK_FILE, PREEMPTED_MARKER}  # this session's own markers, not the run's result


def _kill_fault() -> tuple[str, int] | None:
    value = os.environ.get(KILL_FAULT_ENV, "").strip()
    if not value:
        return None
    name, count = value.split(":")
    return name, int(count)


class Uploader:
    """One worker thread of this rank: uploads the checkpoints submitted to it, the newest first when several wait."""

    def __init__(self, mirror: CheckpointMirror):
        self.mirror = mirror
        self.pending: Path | None = None
        self.last: Path | None = None
        """The newest checkpoint submitted."""
        self.pinned: set[Path] = set()
        """The local store's pinned checkpoints: one submitted here is not pruned before its upload ends."""
        self.active: Path | None = None
        self.stopping = False
        self.uploaded: list[str] = []
        self._cond = threading.Condition()
        mirror.should_stop = lambda: self.stopping
        self._thread = threading.Thread(target=self._loop, name="checkpoint-upload", daemon=True)
        self._thread.start()

    def submit(self, folder: Path) -> None:
        with self._cond:
            if self.pending is not None:
                logger.info("Upload of %s superseded by %s (uploads are slower than saves)", self.pending.name,
                            folder.name)
                self.pinned.discard(self.pending)
            self.pinned.add(folder)
            self.pending = self.last = folder
            self._cond.notify_all()

    def superseded(self) -> bool:
        return self.pending is not None

    def busy(self) -> bool:
        return self.pending is not None or self.active is not None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self.pending is None and not self.stopping:
                    self._cond.wait()
                if self.stopping and self.pending is None:
                    return
                self.active, self.pending = self.pending, None
            try:
                self._upload(self.active)
            except Exception as err:  # noqa: BLE001 - a failed upload never stops training; it is named at the end
                if not self.stopping:
                    logger.warning("Upload of checkpoint %s to %s failed (%s: %s); the remote latest still names the "
                                   "last checkpoint uploaded whole, and the next save uploads again.", self.active,
                                   self.mirror.store.url, type(err).__name__, str(err)[:300])
            with self._cond:
                self.pinned.discard(self.active)
                self.active = None
                self._cond.notify_all()

    def _upload(self, folder: Path) -> None:
        tmp = folder.with_name(f"{TMP_PREFIX}{folder.name}")
        while tmp.exists() and not self.stopping:  # a background write not yet published
            time.sleep(0.05)
        if not (folder / STATE_FILE).is_file():
            logger.info("Checkpoint %s was not published (or was pruned); not uploaded", folder)
            return
        self.mirror.upload(folder)
        self.uploaded.append(folder.name)

    def wait(self, timeout_s: float, progress: bool) -> list[str]:
        """Block until idle or ``timeout_s`` has passed (then stop the worker); the checkpoints not uploaded."""
        deadline = time.monotonic() + timeout_s
        bar = None
        if progress and self.busy():
            from tqdm import tqdm

            bar = tqdm(desc="uploading checkpoints", unit="B", unit_scale=True, leave=False)
        start_bytes = self.mirror.bytes_done
        with self._cond:
            while self.busy() and time.monotonic() < deadline:
                self._cond.wait(0.2)
                if bar is not None:
                    bar.n = self.mirror.bytes_done - start_bytes
                    bar.refresh()
            self.stopping = True
            self._cond.notify_all()
        if bar is not None:
            bar.close()
        # Older checkpoints still queued or failed are superseded by the newest: it alone is what a resume needs.
        return [self.last.name] if self.last is not None and self.last.name not in self.uploaded else []

    def close(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)


class RemoteResume(Callback):
    """With ``checkpoint.resume=auto``: the newest complete remote checkpoint downloaded (each rank its share) and
    published locally when it is newer than the local folder's, before checkpointing's resume reads it. Each remote
    call retries through an outage for at most :data:`READ_PATIENCE_S`, and a signal (SIGTERM, Ctrl-C) stops the
    wait at once: the run then exits with the signal's code, the local folder unchanged."""

    def __init__(self, section: CheckpointConfig, accelerator, root: Path, store: Store, preemption):
        self.section = section
        self.accelerator = accelerator
        self.root = root
        self.store = store
        self.preemption = preemption
        self.downloaded: str | None = None

    def on_start(self, trainer) -> None:
        acc = self.accelerator
        mirror = CheckpointMirror(self.store, self.root, rank=acc.process_index, world_size=acc.num_processes,
                                  keep_last=self.section.keep_last, patience_s=READ_PATIENCE_S,
                                  should_stop=lambda: self.preemption.name is not None)
        name = self._everyone(lambda: self._plan(mirror, trainer) if self.section.resume == "auto" else None)
        if name is None:
            return
        start = time.perf_counter()
        tmp = download_dir(self.root, name)
        try:
            done = self._everyone(lambda: mirror.download_share(name, tmp), every_rank=True)
            self._everyone(lambda: mirror.publish_download(tmp, self.root / name))
        except UserError:
            if acc.is_main_process:  # every rank is past its share (the failure was gathered): nothing left half-written
                remove_path(tmp)
            raise
        logger.info("Downloaded checkpoint %s from %s (%.1f MB on this rank, %.1f s) to resume on this node", name,
                    self.store.url, done / 1e6, time.perf_counter() - start)
        self.downloaded = name

    def _everyone(self, work, every_rank: bool = False):
        """``work()`` on the main process (or on every rank), its result given to every rank; a failure anywhere stops
        every rank with one message naming the remote, the local folder (unchanged) and the way out."""
        from accelerate.utils import broadcast_object_list, gather_object

        outcome = [None, None]  # (result, (error, exit code))
        if every_rank or self.accelerator.is_main_process:
            try:
                outcome[0] = work()
            except RemoteLatestError as err:  # not a failed download: the remote's state, named with its fix
                outcome[1] = (str(err), err.exit_code)
            except (UserError, *transient_errors()) as err:
                outcome[1] = self._failure(err)
        if every_rank:
            errors = [e for e in gather_object([outcome[1]]) if e is not None]
            outcome[1] = errors[0] if errors else None
        else:
            broadcast_object_list(outcome)
        if outcome[1] is not None:
            raise fail(*outcome[1])
        return outcome[0]

    def _failure(self, err: BaseException) -> tuple[str, int]:
        """(message, exit code) of a download that failed with ``err``, or that a signal stopped."""
        if self.preemption.name is not None:
            return (f"Stopped by {self.preemption.name} while waiting for object storage ({self.store.url}) before the "
                    f"first step; nothing was downloaded and the local folder {self.root} is unchanged. Run the same "
                    "command again to resume (checkpoint.resume=auto).", self.preemption.exit_code)
        waited = f" (each request retried for {READ_PATIENCE_S:.0f} s)" if not isinstance(err, UserError) else ""
        return (f"Downloading the newest checkpoint of {self.store.url} failed{waited}: {type(err).__name__}: "
                f"{str(err)[:300]}. The local folder {self.root} is unchanged; check the object storage and run "
                "again, or pass checkpoint.resume=none to start fresh.", EXIT_USER_ERROR)

    def _plan(self, mirror: CheckpointMirror, trainer) -> str | None:
        """Main process: the remote checkpoint to download (its ``train_state.json`` fetched into the temporary
        folder), or None. One this run cannot resume from (another run's: another seed, model or data) is refused
        from its ``train_state.json`` alone, the temporary folder removed: nothing else is downloaded."""
        local = find_resume_checkpoint("auto", self.root)
        remote = mirror.resume_point(step_of_dir(local.name) if local is not None else None)
        if remote is None:
            return None
        logger.info("The remote %s holds %s, newer than the local folder's %s: downloading it", mirror.store.url,
                    remote[0], local.name if local is not None else "(none)")
        tmp = download_dir(self.root, remote[0])
        try:
            saved = mirror.fetch_state(remote[0], tmp)
            trainer.checkpointer.resumer.check_compatible(saved, mirror.store.url_of(remote[0]), trainer.run.model)
        except RemoteLatestError:
            remove_path(tmp)
            raise
        except UserError as err:  # the remote is another run's: its refusal as it is, and where a new run goes
            remove_path(tmp)
            raise RemoteLatestError(
                f"{err} Nothing was downloaded: the local folder {self.root} is unchanged. A new run needs its own "
                f"checkpoint.remote (another URL), or it would upload its checkpoints over those of "
                f"{mirror.store.url}.") from None
        except BaseException:
            remove_path(tmp)
            raise
        return remote[0]

    def outcome(self, trainer) -> dict:
        return {"remote_downloaded": self.downloaded}


class RemoteUpload(Callback):
    """Uploads every published checkpoint in the background; at the end waits for them and uploads the export (before
    the report is written, so ``final.json`` says what was not uploaded); :class:`RemoteReport` then uploads the
    report."""

    follows = ("ExportAtEnd",)  # at the end it uploads the export

    def __init__(self, section: CheckpointConfig, accelerator, out_dir: Path, store: Store, *, progress: bool,
                 preemption):
        self.section = section
        self.accelerator = accelerator
        self.out_dir = out_dir
        self.store = store
        self.progress = progress
        self.preemption = preemption
        self.missing: list[str] = []
        self.deadline = time.monotonic()
        """When the end of the run stops waiting for uploads (set at ``on_end``)."""
        after_file = None
        if (fault := _kill_fault()) is not None and accelerator.is_main_process:
            counted: dict[str, int] = {}
            target, from_on = fault[0].removesuffix("+"), fault[0].endswith("+")

            def after_file(name: str, rel: str) -> None:
                if name == target or (from_on and name > target):  # step folder names are zero-padded
                    counted[name] = counted.get(name, 0) + 1
                    if counted[name] >= fault[1]:
                        logger.warning("Killing this process during the upload of %s (%s)", name, KILL_FAULT_ENV)
                        os.kill(os.getpid(), signal.SIGKILL)

        self.mirror = CheckpointMirror(store, out_dir / "checkpoints", rank=accelerator.process_index,
                                       world_size=accelerator.num_processes, keep_last=section.keep_last,
                                       after_file=after_file)
        self.uploader = Uploader(self.mirror)
        self.mirror.superseded = self.uploader.superseded
        self.reader = CheckpointMirror(store, out_dir / "checkpoints", rank=accelerator.process_index,
                                       world_size=accelerator.num_processes, keep_last=section.keep_last,
                                       patience_s=READ_PATIENCE_S, should_stop=lambda: preemption.name is not None)
        """The same remote, read on the main thread at the start: each call waits through an outage for a while,
        not (as the background uploads do) until the end of the run."""

    def on_start(self, trainer) -> None:
        from accelerate.utils import broadcast_object_list

        self.uploader.pinned = trainer.checkpointer.store.pinned
        # A checkpoint published locally but never uploaded (the previous session ran out of time or lost the
        # server): upload it now.
        latest = [None, None]  # (the local checkpoint to upload, why the remote latest could not be read)
        if self.accelerator.is_main_process:
            local = trainer.checkpointer.latest
            try:
                remote = self.reader.latest() if local is not None else None
                if local is not None and (remote is None or step_of_dir(local.name) > remote[1]):
                    latest[0] = local.name
            except transient_errors() as err:
                latest[1] = (str(unreadable(self.reader.store.url_of("latest"), err)), EXIT_USER_ERROR)
                if self.preemption.name is not None:
                    latest[1] = (f"Stopped by {self.preemption.name} while reading {self.reader.store.url_of('latest')} "
                                 "before the first step. Run the same command again to resume "
                                 "(checkpoint.resume=auto).", self.preemption.exit_code)
        broadcast_object_list(latest)
        if latest[1] is not None:
            raise fail(*latest[1])
        if latest[0] is not None:
            self.uploader.submit(trainer.checkpointer.root / latest[0])

    def on_save(self, trainer) -> None:
        forced = trainer.stop is not None and trainer.stop.save
        if forced or trainer.checkpointer.due(trainer.state.step):
            self.uploader.submit(trainer.checkpointer.root / step_dir_name(trainer.state.step))

    def on_end(self, trainer) -> None:
        self._finish(trainer)
        export = self.out_dir / "export"
        if self.accelerator.is_main_process and export.is_dir():
            upload_files(self.store, self.out_dir, sorted(p for p in export.rglob("*") if p.is_file()), self.deadline,
                         "export")

    def on_error(self, trainer, err: BaseException):
        # A crash: what was published is still worth uploading (a requeued job resumes from it).
        if not isinstance(err, KeyboardInterrupt):
            self._finish(trainer)
        else:
            self.uploader.close()
        return None

    def _finish(self, trainer) -> None:
        self.deadline = time.monotonic() + self.section.remote_wait_s
        self.missing = self.uploader.wait(self.section.remote_wait_s, self.progress and self.accelerator.is_main_process)
        self.uploader.close()
        if self.missing:
            logger.warning(
                "Not uploaded to %s within checkpoint.remote_wait_s=%g s: %s. The local copies in %s are complete; "
                "the remote latest still names the last checkpoint uploaded whole. A later session of this run that trains "
                "(a resume, or train.max_steps raised) uploads the newest local checkpoint when it starts (a finished "
                "run run again does nothing); or copy the folder yourself (e.g. `aws s3 sync "
                "%s %s/checkpoints/NAME`) and write its name into %s/checkpoints/latest last.", self.store.url,
                self.section.remote_wait_s, ", ".join(self.missing), trainer.checkpointer.root,
                trainer.checkpointer.root / "NAME", self.store.url, self.store.url)

    def outcome(self, trainer) -> dict:
        return {"remote": self.store.url, "remote_not_uploaded": self.missing}


class RemoteReport(Callback):
    """The run folder's own files (report, final.json, metrics, config, plot) uploaded at the very end, main process,
    within what is left of ``checkpoint.remote_wait_s``."""

    follows = ("Reporting", "LayerStats")  # the run's report and plots are written before they are uploaded

    def __init__(self, upload: RemoteUpload):
        self.upload = upload

    def on_end(self, trainer) -> None:
        up = self.upload
        if up.accelerator.is_main_process:
            files = [p for p in sorted(up.out_dir.iterdir()) if p.is_file() and p.name not in _RUN_FILES_SKIPPED]
            upload_files(up.store, up.out_dir, files, up.deadline, "report")


def upload_files(store: Store, base: Path, files: list[Path], deadline: float, what: str) -> bool:
    """Upload ``files`` (paths under ``base``, kept relative) retrying until ``deadline``; False, after a WARNING
    naming what is missing, when that was not enough."""
    try:
        for path in files:
            rel = path.relative_to(base).as_posix()
            retrying(lambda path=path, rel=rel: store.put_file(path, rel), f"uploading {rel}", deadline=deadline)
    except Exception as err:  # noqa: BLE001 - the run's result is local; name what is missing
        logger.warning("The run's %s was not uploaded to %s within checkpoint.remote_wait_s (%s: %s); it is in %s.",
                       what, store.url, type(err).__name__, str(err)[:200], base)
        return False
    logger.info("Uploaded the run's %s to %s", what, store.url)
    return True


def build_remote_callbacks(section: CheckpointConfig, accelerator, out_dir: Path, *, progress: bool,
                           preemption) -> tuple[Callback | None, Callback | None, Callback | None]:
    """The three callbacks of ``checkpoint.remote`` (the resume, the uploads, the report; None each when it is unset),
    after checking that the URL can be written (every rank gets the main process's verdict: exit 2 naming the URL
    and the fix). ``preemption``: the run's ``PreemptionSignal`` (its ``name`` once a signal came, its ``exit_code``;
    callbacks do not import each other); it stops a wait for object storage before the first step."""
    if not section.remote:
        return None, None, None
    from accelerate.utils import broadcast_object_list

    verdict = [None]
    if accelerator.is_main_process:
        try:
            check_access(section.remote, "checkpoint.remote")
        except UserError as err:
            verdict = [str(err)]
    broadcast_object_list(verdict)
    if verdict[0] is not None:
        raise fail(verdict[0])
    store = Store.open(section.remote)
    upload = RemoteUpload(section, accelerator, out_dir, store, progress=progress, preemption=preemption)
    return RemoteResume(section, accelerator, out_dir / "checkpoints", store, preemption), upload, RemoteReport(upload)
