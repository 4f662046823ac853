"""The run's checkpoints mirrored to object storage (``checkpoint.remote``): uploads, the remote ``latest``, remote
retention, and the download of the newest complete one onto a fresh node.

Layout under the URL: ``checkpoints/step_N/...`` (the local folder's files), ``checkpoints/latest`` and
``checkpoints/best`` (names, as locally), ``checkpoints/.uploads/step_N/rank_NNNNN`` (markers while an upload is in
flight), ``export/`` and the run's report files (uploaded at the end).

Commit order of an upload, after the local atomic publish: every rank uploads the files it owns (:func:`owner`: the
files that name its rank; the main process also the shared ones), then writes its marker holding the checkpoint's
identity (the sha256 of the local ``train_state.json``); the main process waits for every rank's marker, uploads
``train_state.json`` (a remote checkpoint is complete once it is there), then replaces ``latest``, then prunes. A
crash or an outage at any moment leaves ``latest`` naming a complete checkpoint. A download verifies the files
against the manifest (sizes, sha256 of the small ones, safetensors headers) before publishing them locally with the
local store's own atomic rename.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from pathlib import Path
from typing import Callable

from lmrecipe.checkpoint.storage import (
    BEST,
    LATEST,
    STATE_FILE,
    TMP_PREFIX,
    manifest_problems,
    manifest_sizes,
    step_of_dir,
    summary,
)
from lmrecipe.data.format import file_sha256
from lmrecipe.errors import UserError
from lmrecipe.fileio import fsync_dir, write_text_atomic
from lmrecipe.objstore import Store, retrying

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
UPLOADS = ".uploads"
_RANK_IN_NAME = re.compile(r"(?:rank_|zero_pp_rank_)(\d+)")


def owner(rel: str, world_size: int) -> int:
    """The rank that uploads (and downloads) file ``rel`` of a checkpoint: the rank its name holds (``rng/
    rank_00001.safetensors``, DeepSpeed's ``zero_pp_rank_1_...``), modulo the processes; the main process otherwise."""
    match = _RANK_IN_NAME.search(rel.rsplit("/", 1)[-1])
    return int(match.group(1)) % world_size if match else 0


class RemoteLatestError(UserError):
    """The remote ``latest`` names no complete checkpoint: the run stops with this message as it is (it names the
    pointer, what the remote holds and the fix), not as a failed download."""


class RemoteDamagedError(RemoteLatestError):
    """The checkpoint the remote ``latest`` names was downloaded whole and does not match its manifest: named by its
    URL, with the fix, as it is."""


def downloaded_problems(tmp: Path) -> list[str]:
    """What is wrong with a downloaded checkpoint ``tmp`` against its manifest (empty: it is whole)."""
    try:
        saved = json.loads((tmp / STATE_FILE).read_text())
        return manifest_problems(tmp, saved)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return [f"{STATE_FILE} is not a readable checkpoint state ({type(err).__name__})"]


def damaged_remote(url: str, problems: list[str]) -> str:
    """The opening of the message naming remote checkpoint ``url`` whose downloaded files have ``problems``."""
    return f"The remote checkpoint {url} is damaged: {summary(problems)}."


def manifest_of(folder: Path) -> dict[str, int]:
    """A published checkpoint's files (its ``train_state.json``'s manifest) by relative path, with their sizes."""
    return {str(k): int(v) for k, v in json.loads((folder / STATE_FILE).read_text())["manifest"].items()}


class CheckpointMirror:
    """Checkpoints of the local folder ``root`` mirrored under ``store`` (its ``checkpoints/``) by rank ``rank`` of
    ``world_size``. Uploads run on the caller's thread (the callback's worker); every remote call retries through an
    outage until ``should_stop()``, and for at most ``patience_s`` seconds when that is set (what a run waits on
    before its first step: None would keep a requeued job waiting until its time limit)."""

    def __init__(self, store: Store, root: Path, *, rank: int, world_size: int, keep_last: int,
                 should_stop: Callable[[], bool] = lambda: False, after_file: Callable[[str, str], None] | None = None,
                 patience_s: float | None = None):
        self.store = store.child(CHECKPOINTS)
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.keep_last = keep_last
        self.should_stop = should_stop
        self.patience_s = patience_s
        self.after_file = after_file
        """Called with (checkpoint name, file) after each upload (tests' fault injection)."""
        self.bytes_done = 0
        self.superseded: Callable[[], bool] = lambda: False
        """True when a newer checkpoint waits to be uploaded: the main process then stops waiting for the other
        ranks' parts of this one (they may have skipped it for the newer)."""

    def _retry(self, operation, what: str):
        deadline = None if self.patience_s is None else time.monotonic() + self.patience_s
        return retrying(operation, what, deadline=deadline, should_stop=self.should_stop)

    # ---- upload

    def upload(self, folder: Path) -> None:
        """Upload this rank's files of the published checkpoint ``folder``; on the main process, wait for the others,
        then commit (``train_state.json``, ``latest``) and prune. FileNotFoundError when the local folder was pruned
        meanwhile."""
        name = folder.name
        identity = file_sha256(folder / STATE_FILE)
        manifest = manifest_of(folder)
        # A re-save of this step (after a rollback) must not leave the old train_state.json claiming new files.
        self._retry(lambda: self.store.remove(f"{name}/{STATE_FILE}"), f"preparing the upload of {name}")
        for rel in sorted(manifest):
            if owner(rel, self.world_size) != self.rank:
                continue
            self._retry(lambda rel=rel: self.store.put_file(folder / rel, f"{name}/{rel}"), f"uploading {name}/{rel}")
            self.bytes_done += manifest[rel]
            if self.after_file is not None:
                self.after_file(name, rel)
        self._retry(lambda: self.store.write_text(self._marker(name, self.rank), identity), f"finishing {name}")
        if self.rank == 0:
            self._commit(folder, identity)

    def _marker(self, name: str, rank: int) -> str:
        return f"{UPLOADS}/{name}/rank_{rank:05d}"

    def _commit(self, folder: Path, identity: str) -> None:
        name = folder.name
        for rank in range(self.world_size):
            while self._retry(lambda r=rank: self.store.read_text(self._marker(name, r)), f"waiting for rank {rank}'s "
                              f"part of {name}") != identity:
                if self.should_stop() or self.superseded():
                    raise TimeoutError(f"rank {rank} did not finish uploading its part of {name}")
                time.sleep(0.2)
        self._retry(lambda: self.store.put_file(folder / STATE_FILE, f"{name}/{STATE_FILE}"), f"committing {name}")
        self._retry(lambda: self.store.write_text(LATEST, name + "\n"), f"pointing the remote latest at {name}")
        logger.info("Uploaded checkpoint %s to %s", name, self.store.url_of(name))
        self._retry(lambda: self.store.remove(f"{UPLOADS}/{name}"), f"removing the upload markers of {name}")
        self._retry(lambda: self.prune(name), "pruning remote checkpoints")

    def prune(self, newest: str) -> None:
        """Keep the ``keep_last`` newest complete remote checkpoints and the best (the one the local ``best``
        names); delete the others, and incomplete uploads older than ``newest``."""
        newest_step = step_of_dir(newest)
        steps = {n: step_of_dir(n) for n in self.store.names() if step_of_dir(n) is not None}
        complete = sorted((s, n) for n, s in steps.items() if self.store.exists(f"{n}/{STATE_FILE}"))
        keep = {n for _, n in complete[-self.keep_last:]}
        best_file = self.root / BEST
        best = best_file.read_text().strip() if best_file.is_file() else None
        if best in dict(complete).values():
            keep.add(best)
            self.store.write_text(BEST, best + "\n")
        for n, s in sorted(steps.items(), key=lambda item: item[1]):
            if n not in keep and s <= newest_step and self.store.files(n):  # an empty prefix is no checkpoint
                logger.info("Removing %s (checkpoint.keep_last=%d, applied remotely too)", self.store.url_of(n),
                            self.keep_last)
                self.store.remove(n)

    # ---- download

    def latest(self) -> tuple[str, int] | None:
        """(name, step) of the checkpoint the remote ``latest`` names, when it is complete; else None."""
        text = self._retry(lambda: self.store.read_text(LATEST), "reading the remote latest")
        name = (text or "").strip()
        if step_of_dir(name) is None or not self._retry(lambda: self.store.exists(f"{name}/{STATE_FILE}"),
                                                        f"reading {name}"):
            return None
        return name, step_of_dir(name)

    def complete(self) -> list[tuple[int, str]]:
        """(step, name) of every complete remote checkpoint (its ``train_state.json`` is there), oldest first."""
        steps = {n: step_of_dir(n) for n in self.store.names() if step_of_dir(n) is not None}
        return sorted((s, n) for n, s in steps.items() if self.store.exists(f"{n}/{STATE_FILE}"))

    def resume_point(self, local_step: int | None) -> tuple[str, int] | None:
        """(name, step) of the remote checkpoint a resume (``checkpoint.resume=auto``) downloads, or None when the
        local folder (its newest checkpoint at ``local_step``; None: it has none) is as far: the one the remote
        ``latest`` names; without a remote ``latest``, the newest complete one, as locally without a pointer (an
        upload cut between its ``train_state.json`` and the first ``latest``).

        A ``latest`` naming a checkpoint that is not complete there stops the run (:class:`RemoteLatestError`), unless
        the local folder is at that step or later (nothing to download; its upload repairs the pointer). The commit
        order never leaves such a pointer, so the remote run was changed from outside (a checkpoint deleted, a partial
        copy), and neither way on is safe to take silently: starting fresh uploads this run's checkpoints over the
        remote run's, and falling back to the newest complete one rewinds the run past the step ``latest`` promises
        (a user who deleted that checkpoint on purpose says so in one command). So the message names the pointer,
        what the remote holds, and both fixes."""
        text = self._retry(lambda: self.store.read_text(LATEST), "reading the remote latest")
        if text is None:
            complete = self._retry(self.complete, "listing the remote checkpoints")
            if not complete or (local_step is not None and local_step >= complete[-1][0]):
                return None
            logger.info("The remote %s has no latest pointer; its newest complete checkpoint is %s", self.store.url,
                        complete[-1][1])
            return complete[-1][1], complete[-1][0]
        name, step = text.strip(), step_of_dir(text.strip())
        if step is not None and local_step is not None and local_step >= step:
            return None
        if step is not None and self._retry(lambda: self.store.exists(f"{name}/{STATE_FILE}"), f"reading {name}"):
            return name, step
        complete = [n for _, n in self._retry(self.complete, "listing the remote checkpoints")]
        held = f"the complete remote checkpoints are {', '.join(complete)}" if complete else \
            "no remote checkpoint is complete"
        example = complete[-1] if complete else "step_N"
        why = f"no {name}/{STATE_FILE}" if step is not None else "not a checkpoint folder's name, step_N"
        local = "no checkpoint" if local_step is None else f"checkpoints up to step {local_step}"
        raise RemoteLatestError(
            f"The remote latest ({self.store.url_of(LATEST)}) names {name!r}, which is not a complete checkpoint there "
            f"({why}); {held}, and the local folder {self.root} holds {local}. The remote run was changed from "
            "outside (uploads point latest only at a complete checkpoint), and this run would otherwise start over or "
            "rewind and upload its checkpoints over the remote run's. Point the remote latest at the checkpoint to "
            f"resume from (e.g. write {example} into it), or delete it to resume from the newest complete one, or set "
            "checkpoint.remote to another URL for a new run.")

    def fetch_state(self, name: str, tmp: Path) -> dict:
        """Main process: a fresh ``tmp`` holding the remote ``train_state.json`` of ``name``, read;
        :class:`RemoteDamagedError` when it is not a checkpoint's state."""
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self._retry(lambda: self.store.get_file(f"{name}/{STATE_FILE}", tmp / STATE_FILE), f"downloading {name}")
        try:
            saved = json.loads((tmp / STATE_FILE).read_text())
            manifest_sizes(saved)
            return saved
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise self._damaged(name, [f"{STATE_FILE} is not a readable checkpoint state ({type(err).__name__})"])

    def download_share(self, name: str, tmp: Path) -> int:
        """This rank's files of remote checkpoint ``name`` into ``tmp`` (its state file already there); bytes."""
        manifest = manifest_of(tmp)
        done = 0
        for rel, size in sorted(manifest.items()):
            if owner(rel, self.world_size) != self.rank:
                continue
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            self._retry(lambda rel=rel: self.store.get_file(f"{name}/{rel}", tmp / rel), f"downloading {name}/{rel}")
            done += size
        return done

    def _damaged(self, name: str, problems: list[str]) -> RemoteDamagedError:
        others = [n for _, n in self._retry(self.complete, "listing the remote checkpoints") if n != name]
        held = f"the other complete remote checkpoints: {', '.join(others)}" if others else \
            "no other remote checkpoint is complete"
        return RemoteDamagedError(
            f"{damaged_remote(self.store.url_of(name), problems)} Nothing was published: the local folder {self.root} "
            f"is unchanged. Upload the checkpoint again from a whole copy, or write the name of an earlier complete "
            f"checkpoint into {self.store.url_of(LATEST)} to resume from it ({held}), or set checkpoint.remote to "
            "another URL for a new run.")

    def publish_download(self, tmp: Path, final: Path) -> None:
        """Main process: verify ``tmp`` against its manifest (sizes, sha256 of the small files, safetensors headers),
        then rename it to ``final`` and point ``latest`` at it; :class:`RemoteDamagedError` naming the remote
        checkpoint when a file does not match."""
        if problems := downloaded_problems(tmp):
            raise self._damaged(final.name, problems)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        fsync_dir(self.root)
        write_text_atomic(self.root / LATEST, final.name + "\n", durable=True)


def download_dir(root: Path, name: str) -> Path:
    """The temporary folder a download of checkpoint ``name`` is written into (removed by the store at the next start
    when left by a crash)."""
    return root / f"{TMP_PREFIX}{name}"


# --------------------------------------------------------------------------------------------------
# Reading a remote checkpoint or export (eval.py, tools/export_hf.py)

CHECKPOINT_CACHE = "~/.cache/lmrecipe/checkpoints"
_LISTING_MARKER = ".listing_sha256"


def fetch_remote(url: str, cache_dir: str = CHECKPOINT_CACHE) -> Path:
    """A local copy of what ``url`` names: a checkpoint folder, a run (or its ``checkpoints/``) for the checkpoint its
    ``latest`` names, or an export folder. Downloaded into ``cache_dir`` (reused while the remote files are the same;
    one process per machine downloads), a checkpoint verified against its manifest. UserError naming the URL and the
    fix when nothing there is a checkpoint or an export."""
    import hashlib

    from lmrecipe.errors import fail
    from lmrecipe.fileio import install_dir, remove_path, temp_dir_for
    from lmrecipe.objstore import READ_PATIENCE_S, node_lock, retrying, transient_errors, unreadable

    store = Store.open(url)

    def remote(operation, what: str, patience_s: float = READ_PATIENCE_S):
        try:
            return retrying(operation, what, deadline=time.monotonic() + patience_s)
        except PermissionError as err:
            raise fail(f"{url}: access denied ({str(err)[:200]}). Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY to "
                       "credentials that may read it (AWS_ENDPOINT_URL for an S3-compatible server).") from None
        except transient_errors() as err:  # botocore's own (EndpointConnectionError) are not OSErrors
            raise unreadable(url, err) from None

    def read(rel: str) -> str | None:
        return remote(lambda: store.read_text(rel), f"reading {store.url_of(rel)}")

    source, checkpoint = store, True
    if read(STATE_FILE) is None:
        for pointer in (f"{CHECKPOINTS}/{LATEST}", LATEST):
            name = (read(pointer) or "").strip()
            if step_of_dir(name) is not None:
                source = store.child(pointer.rsplit("/", 1)[0] + "/" + name if "/" in pointer else name)
                break
            if name:
                raise fail(f"{store.url_of(pointer)} names {name[:80]!r}, not a checkpoint folder (step_N). Write the "
                           "name of a complete checkpoint beside it into it (e.g. step_00001000), or pass the URL of "
                           "one checkpoint (.../checkpoints/step_N).")
        else:
            if read("config.json") is None:
                raise fail(f"{url} holds no training checkpoint (no {STATE_FILE}, no checkpoints/{LATEST}) and no "
                           "export (no config.json). Pass the URL of a run uploaded with checkpoint.remote, of one of "
                           "its checkpoints/step_N, or of its export/.")
            checkpoint = False
    files = remote(source.files, f"listing {source.url}")
    if checkpoint:
        files = {rel: size for rel, size in files.items() if not rel.startswith(".")}
    digest = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
    name = source.url.rstrip("/").rsplit("/", 1)[-1]
    dest = Path(cache_dir).expanduser() / f"{hashlib.sha256(source.url.encode()).hexdigest()[:12]}" / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    with node_lock(dest.parent / ".lock"):
        marker = dest / _LISTING_MARKER
        if marker.is_file() and marker.read_text().strip() == digest:
            logger.info("Using %s, downloaded before from %s", dest, source.url)
            return dest
        tmp = temp_dir_for(dest)
        try:
            for rel in sorted(files):
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                remote(lambda rel=rel: source.get_file(rel, tmp / rel), f"downloading {source.url_of(rel)}",
                       patience_s=600)
            if checkpoint and (problems := downloaded_problems(tmp)):
                raise fail(f"{damaged_remote(source.url, problems)} Upload it again from a whole copy, or pass the URL "
                           f"of another checkpoint of the run ({source.url.rsplit('/', 1)[0]}/step_N).")
            (tmp / _LISTING_MARKER).write_text(digest + "\n")
            install_dir(tmp, dest, overwrite=True)
        finally:
            remove_path(tmp)
    logger.info("Downloaded %s (%.1f MB) to %s", source.url, sum(files.values()) / 1e6, dest)
    return dest
