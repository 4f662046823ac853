"""Prepared data folders in object storage (``data.path`` or ``data.sources[].path`` given as ``s3://...``,
``gs://...``, ``file://...``): staged into the node's cache (``data.cache_dir``) before the first step.

One process per node downloads (the first to take the cache entry's lock; the others wait on it and reuse the
result); the download goes to a temporary folder, is verified, and is renamed into place, so a cache entry is
complete or absent. Downloaded: ``meta.json``, the folder's other files (tokens, document index, tokenizer) and, for
a shard set, the shard folders its ``meta.json`` lists; nothing else under the prefix. Verified: every ``.bin``
against the sha256 ``meta.json`` records for it (each shard's against the set's record), every other file by its
size; the usual start-up checks of the format then run on the local copy. A later run reuses the entry while the
remote ``meta.json`` is unchanged (its sha256 is the marker beside the entry), and memory-maps the tokens from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from pathlib import Path

from lmrecipe.data.format import SPLITS, file_sha256
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import install_dir, remove_path, temp_dir_for, write_text_atomic
from lmrecipe.objstore import READ_PATIENCE_S, Store, is_remote, node_lock, retrying, transient_errors, unreadable

logger = logging.getLogger(__name__)

STAGED_MARKER = ".staged"
"""Beside a cache entry (``ENTRY.staged``, outside the folder, whose files a checkpoint's ``hf/`` copies): the sha256
of the remote ``meta.json`` the entry was downloaded for; written after the entry is in place."""
DOWNLOAD_DEADLINE_S = 3600.0
"""How long the download of one folder retries through an outage before the run stops."""


def cache_entry(url: str, cache_dir: str) -> Path:
    """The cache folder of data URL ``url``: readable (the URL's path) and unique (a hash of the whole URL)."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", url.split("://", 1)[-1]).strip("_")[-80:]
    return Path(cache_dir).expanduser() / f"{readable}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def _remote_meta(store: Store, what: str) -> str:
    """The remote ``meta.json`` text; UserError naming the URL and the fix when it cannot be read."""
    fix = ("Upload the folder tools/prepare_data.py wrote (e.g. `aws s3 sync DATA_DIR URL`), or correct the URL; "
           "credentials and endpoint come from AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL.")
    try:
        text = retrying(lambda: store.read_text("meta.json"), f"reading {store.url_of('meta.json')}",
                        deadline=time.monotonic() + READ_PATIENCE_S)
    except PermissionError as err:
        raise fail(f"{what}={store.url}: access denied ({str(err)[:200]}). Set AWS_ACCESS_KEY_ID and "
                   "AWS_SECRET_ACCESS_KEY to credentials that may read it.") from None
    except FileNotFoundError:
        text = None
    except transient_errors() as err:  # botocore's own (EndpointConnectionError) are not OSErrors
        raise unreadable(store.url, err, what) from None
    if text is None:
        raise fail(f"{what}={store.url} holds no meta.json: it is not a prepared data folder. {fix}")
    return text


def check_remote_data(url: str, what: str) -> dict:
    """The remote folder's ``meta.json``, read without downloading anything (``train.py --dry-run``)."""
    return json.loads(_remote_meta(Store.open(url), what))


def stage(url: str, cache_dir: str, what: str = "data.path") -> Path:
    """The local copy of the prepared folder at ``url`` in ``cache_dir``: downloaded and verified unless a complete
    copy of the same ``meta.json`` is there. ``what`` names the key in messages."""
    store = Store.open(url)
    meta_text = _remote_meta(store, what)
    digest = hashlib.sha256(meta_text.encode()).hexdigest()
    entry = cache_entry(url, cache_dir)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with node_lock(entry.with_name(entry.name + ".lock")):
        marker = entry.with_name(entry.name + STAGED_MARKER)
        if marker.is_file() and marker.read_text().strip() == digest:
            logger.info("Data %s: using the cached copy %s", url, entry)
            return entry
        start = time.perf_counter()
        tmp = temp_dir_for(entry)
        try:
            size = _download(store, json.loads(meta_text), tmp, what)
            (tmp / "meta.json").write_text(meta_text)
            marker.unlink(missing_ok=True)
            install_dir(tmp, entry, overwrite=True)
        finally:
            remove_path(tmp)
        write_text_atomic(marker, digest + "\n")
        logger.info("Data %s: downloaded and verified %.1f MB into %s in %.1f s", url, size / 1e6, entry,
                    time.perf_counter() - start)
    return entry


def _download(store: Store, meta: dict, tmp: Path, what: str) -> int:
    """The files the folder's ``meta.json`` describes, into ``tmp``, verified; their bytes."""
    try:
        listing = retrying(store.files, f"listing {store.url}", deadline=time.monotonic() + READ_PATIENCE_S)
    except transient_errors() as err:
        raise unreadable(store.url, err, what) from None
    shards = [str(e["path"]) for e in meta.get("shards", [])] if isinstance(meta.get("shards"), list) else []
    wanted = {rel: size for rel, size in listing.items()
              if rel != "meta.json" and ("/" not in rel or rel.split("/", 1)[0] in shards)}
    expected = {f"{split}.bin": meta["splits"][split].get("sha256") for split in SPLITS if not shards}
    for entry in meta.get("shards", []) if shards else []:
        expected.update({f"{entry['path']}/{split}.bin": entry["splits"][split].get("sha256") for split in SPLITS})
    deadline = time.monotonic() + DOWNLOAD_DEADLINE_S
    for rel in sorted(wanted):
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            retrying(lambda rel=rel: store.get_file(rel, tmp / rel), f"downloading {store.url_of(rel)}",
                     deadline=deadline)
        except transient_errors() as err:
            raise fail(f"{what}={store.url}: downloading {rel} failed ({type(err).__name__}: {str(err)[:200]}). "
                       "Check the object storage and run again.") from None
    problems = [f"{rel} is missing" for rel in expected if rel not in wanted]
    problems += [f"{rel} holds {(tmp / rel).stat().st_size} bytes, not {size}" for rel, size in wanted.items()
                 if (tmp / rel).stat().st_size != size]
    problems += [f"{rel} does not match the sha256 meta.json records" for rel, sha in expected.items()
                 if rel in wanted and sha and file_sha256(tmp / rel) != sha]
    if problems:
        raise fail(f"{what}={store.url}: the downloaded copy is not the folder its meta.json describes: "
                   f"{'; '.join(problems[:5])}. The files under the URL were changed or partly uploaded: upload the "
                   "whole folder tools/prepare_data.py wrote again (meta.json last).")
    return sum(wanted.values())


def staged_path(path: str, cache_dir: str, what: str) -> str:
    """``path`` itself when local, else the local copy of the remote folder (downloaded when needed)."""
    if not is_remote(path):
        return path
    try:
        return str(stage(path, cache_dir, what))
    except UserError:
        raise
    except OSError as err:
        raise fail(f"{what}={path}: staging into data.cache_dir={cache_dir} failed ({err}). Point data.cache_dir at a "
                   "writable local folder with room for the data.") from None
