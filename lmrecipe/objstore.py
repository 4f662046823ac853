"""Object storage (``s3://``, ``gs://``, ``file://``, any fsspec URL): the one client the checkpoint mirror and the
data cache use.

fsspec (and s3fs for ``s3://``, gcsfs for ``gs://``) are imported only when a URL is used, from the ``[remote]``
extra. For S3 the endpoint, region and credentials come from the standard variables: ``AWS_ENDPOINT_URL_S3`` or
``AWS_ENDPOINT_URL`` (an S3-compatible server; unset: AWS), ``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (or any other source botocore reads: profiles, instance roles). For GCS, gcsfs reads
``GOOGLE_APPLICATION_CREDENTIALS`` or the machine's default credentials.

:func:`retrying` repeats an operation through an outage with back-off (a WARNING when it starts, an INFO when it
ends); :func:`check_access` proves at start-up that the URL can be written, read and listed, and turns every reason
it cannot into one message naming the URL and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable, TypeVar

from lmrecipe.errors import UserError, fail

logger = logging.getLogger(__name__)

T = TypeVar("T")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 10.0
"""Back-off between attempts of an operation that failed: doubled from the first up to the largest."""
READ_PATIENCE_S = 60.0
"""How long a read that a command waits on before it can start (a pointer, a listing, a small file) retries through
an outage before the command stops with a message: a requeued job must not sit until its time limit."""


def is_remote(path) -> bool:
    """Whether ``path`` is a URL (``scheme://...``) rather than a local path."""
    return "://" in str(path)


def scheme_of(url: str) -> str:
    return str(url).split("://", 1)[0].lower()


def endpoint_from_env() -> str | None:
    """The S3 endpoint of an S3-compatible server (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``), or None."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def _missing_client(url: str, module: str) -> Exception:
    if module == "gcsfs":  # not in the [remote] extra: the tests have no GCS server to check it against
        return fail(f"{url} is Google Cloud Storage, which needs the gcsfs package: `pip install -e \".[remote]\" "
                    "gcsfs` (with gcsfs's version equal to fsspec's).")
    return fail(f"{url} is object storage, which needs the {module} package: install the optional client libraries "
                f"with `pip install -e \".[remote]\"` (fsspec, s3fs).")


def open_filesystem(url: str):
    """(fsspec filesystem, path inside it) of ``url``; UserError naming ``pip install -e ".[remote]"`` when the
    client is not installed."""
    try:
        import fsspec
    except ImportError:
        raise _missing_client(url, "fsspec") from None
    scheme = scheme_of(url)
    require_bucket(url)
    options: dict = {}
    if scheme in ("s3", "s3a"):
        try:
            import s3fs  # noqa: F401 - fsspec's s3 implementation
        except ImportError:
            raise _missing_client(url, "s3fs") from None
        # One attempt per call and short connection timeouts: retrying() owns the retries, so an outage is logged
        # and the back-off is this module's, not botocore's.
        options = {"endpoint_url": endpoint_from_env(), "skip_instance_cache": True, "use_listings_cache": False,
                   "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 1}}}
        if region := os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"):
            options["client_kwargs"] = {"region_name": region}
    elif scheme in ("file", "local"):
        options = {"auto_mkdir": True}  # object stores have no folders to create; a local filesystem has
    elif scheme in ("gs", "gcs"):
        try:
            import gcsfs  # noqa: F401
        except ImportError:
            raise _missing_client(url, "gcsfs") from None
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except (ImportError, ValueError) as err:
        raise fail(f"{url}: fsspec cannot open this URL ({err}). Use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or "
                   "file:///PATH, and install the clients with `pip install -e \".[remote]\"`.") from None
    except OSError as err:  # a scheme whose client connects when opened (ftp://, sftp://): no server there
        raise fail(f"{url}: cannot connect to open this URL ({type(err).__name__}: {_short(err)}). Check that the "
                   "server runs and the host name is right, or use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or "
                   "file:///PATH.") from None
    return fs, path.rstrip("/")


@contextlib.contextmanager
def node_lock(path):
    """An exclusive lock on file ``path`` across the processes of this machine (released when the holder dies): one
    process downloads into a cache entry while the others wait, then find it complete."""
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def permanent(err: BaseException) -> bool:
    """An error that retrying cannot mend: no permission, no such bucket or key, a bad request."""
    if isinstance(err, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return True
    return isinstance(err, OSError) and err.errno in (errno.EINVAL, errno.EACCES, errno.EPERM)


def transient_errors() -> tuple[type[BaseException], ...]:
    """The exception types an outage raises (connection refused, timeouts, server errors)."""
    types: list[type[BaseException]] = [OSError, ConnectionError, TimeoutError]
    try:
        import botocore.exceptions as bce

        types += [bce.BotoCoreError, bce.ClientError]
    except ImportError:
        pass
    try:
        import aiohttp

        types.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(types)


def retrying(operation: Callable[[], T], what: str, *, deadline: float | None = None,
             should_stop: Callable[[], bool] | None = None) -> T:
    """``operation()``, repeated with back-off while it fails with a transient error.

    ``what`` names it in the log (one WARNING when the outage starts, one INFO when it ends). Raises the last error
    when ``deadline`` (``time.monotonic()``) has passed or ``should_stop()`` is true, and at once for a permanent
    error (:func:`permanent`).
    """
    delay, failures = BACKOFF_FIRST_S, 0
    while True:
        try:
            result = operation()
        except transient_errors() as err:
            if permanent(err) or (deadline is not None and time.monotonic() + delay > deadline) or (
                    should_stop is not None and should_stop()):
                raise
            if failures == 0:
                logger.warning("Object storage unreachable while %s (%s: %s); retrying with back-off up to %.0f s "
                               "apart. Training goes on; the local files are intact.", what, type(err).__name__,
                               str(err)[:200], BACKOFF_MAX_S)
            failures += 1
            _sleep(delay, should_stop)
            delay = min(2 * delay, BACKOFF_MAX_S)
            continue
        if failures:
            logger.info("Object storage reachable again: %s succeeded after %d failed attempts", what, failures)
        return result


def _sleep(seconds: float, should_stop: Callable[[], bool] | None) -> None:
    """Sleep, waking early once ``should_stop()`` is true (the end of a run must not wait out a long back-off)."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0 and not (should_stop is not None and should_stop()):
        time.sleep(min(left, 0.1))


@dataclass
class Store:
    """A folder of object storage: ``url`` and paths relative to it (``/``-separated)."""

    url: str
    fs: object
    root: str

    @classmethod
    def open(cls, url: str) -> "Store":
        fs, root = open_filesystem(url)
        return cls(url.rstrip("/"), fs, root)

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def child(self, rel: str) -> "Store":
        return Store(self.url_of(rel), self.fs, self.path(rel))

    def put_file(self, local, rel: str) -> None:
        self.fs.put_file(str(local), self.path(rel))

    def get_file(self, rel: str, local) -> None:
        self.fs.get_file(self.path(rel), str(local))

    def write_text(self, rel: str, text: str) -> None:
        """One object (an S3 PUT replaces an object atomically: a reader sees the old text or the new)."""
        self.fs.pipe_file(self.path(rel), text.encode())

    def read_text(self, rel: str) -> str | None:
        """The object's text, or None when there is none. Bytes that are not UTF-8 read as U+FFFD: the caller's
        check of what the text should say (a checkpoint's name, a marker) then names the object."""
        try:
            return self.fs.cat_file(self.path(rel)).decode(errors="replace")
        except FileNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def names(self, rel: str = "") -> list[str]:
        """The names directly under ``rel`` (empty when there is nothing)."""
        try:
            return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(rel), detail=False))
        except FileNotFoundError:
            return []

    def files(self, rel: str = "") -> dict[str, int]:
        """Every object under ``rel``, by path relative to ``rel``, with its size in bytes."""
        base = self.path(rel).rstrip("/") + "/"
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {p[len(base):] if p.startswith(base) else p.split(base.lstrip("/"), 1)[-1]: int(info.get("size") or 0)
                for p, info in found.items() if info.get("type") != "directory"}

    def remove(self, rel: str) -> None:
        """Delete the objects under ``rel`` (or the object), if any."""
        try:
            self.fs.rm(self.path(rel), recursive=True)
        except FileNotFoundError:
            pass


def check_access(url: str, what: str, write: bool = True) -> Store:
    """The store of ``url`` once a small object was written, read back, listed and deleted there (``write=False``:
    once the bucket and the prefix were listed, which needs the credentials too, and nothing is written); UserError
    naming ``what`` (the key), the URL and the fix for a missing client, missing bucket, wrong credentials or an
    endpoint that does not answer."""
    require_bucket(url, what)
    store = Store.open(url)
    probe = f".lmrecipe-access-check-{uuid.uuid4().hex[:12]}"
    endpoint = endpoint_from_env()
    where = f" at {endpoint}" if endpoint and scheme_of(url) in ("s3", "s3a") else ""
    try:
        if scheme_of(url) in ("s3", "s3a", "gs", "gcs"):
            # The bucket first: some S3-compatible servers create a missing bucket on the first write.
            store.fs.ls(_bucket(url))
        if write:
            store.write_text(probe, "ok\n")
            if store.read_text(probe) != "ok\n":
                raise OSError(errno.EIO, "the object read back differs from the one written")
        store.names()
        if write:
            store.remove(probe)
    except FileNotFoundError as err:
        raise fail(f"{what}={url}: the bucket does not exist{where} ({_short(err)}). Create it (e.g. `aws s3 mb "
                   f"s3://{_bucket(url)}`, or in the provider's console) or correct the URL.") from None
    except PermissionError as err:
        raise fail(f"{what}={url}: access denied{where} ({_short(err)}): the credentials are wrong or may not write "
                   "there. Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (GCS: GOOGLE_APPLICATION_CREDENTIALS) to "
                   "credentials that may read, write, list and delete under that prefix.") from None
    except transient_errors() as err:
        raise fail(f"{what}={url}: object storage{where} cannot be written ({type(err).__name__}: {_short(err)}). "
                   f"{_outage_fix()}.") from None
    return store


def unreadable(url: str, err: BaseException, what: str | None = None) -> "UserError":
    """The UserError of a read of ``url`` (the value of key ``what``, if any) that failed through its retries: the
    error and the fix."""
    endpoint = endpoint_from_env()
    where = f" at {endpoint}" if endpoint and scheme_of(url) in ("s3", "s3a") else ""
    return fail(f"{what + '=' if what else ''}{url}: object storage{where} could not be read (after retrying; "
                f"{type(err).__name__}: {_short(err)}). {_outage_fix()}, then run the "
                "command again.")


def require_bucket(url: str, what: str | None = None) -> None:
    """UserError when an object-storage URL (``s3://``, ``gs://``) names no bucket (``s3://``, ``s3:///PREFIX``):
    asked, the client would blame the endpoint or the credentials."""
    scheme = scheme_of(url)
    if scheme in ("s3", "s3a", "gs", "gcs") and not _bucket(url):
        raise fail(f"{what + '=' if what else ''}{url} names no bucket: the bucket comes right after {scheme}://. "
                   f"Write the URL as {scheme}://BUCKET/PREFIX (e.g. {scheme}://my-bucket/runs/NAME).")


def _outage_fix() -> str:
    if endpoint_from_env():
        return "Check AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) and that the server is running and answers"
    return ("Check the network, the URL and the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
            "AWS_DEFAULT_REGION; AWS_ENDPOINT_URL for an S3-compatible server)")


def _short(err: BaseException) -> str:
    return str(err).replace("\n", " ")[:200] or type(err).__name__


def _bucket(url: str) -> str:
    return str(url).split("://", 1)[-1].split("/", 1)[0]
