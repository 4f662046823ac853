"""The third-party lines a run does not show, each named once, and the filters that drop them.

:data:`QUIET_LINES` is the table: where a line comes from (a logger, Python's ``warnings``, or a ``print`` of a
library), the pattern of its message and why it is dropped. :func:`quiet` installs the logging and warning filters
(every script's ``setup_logging`` calls it, before the libraries are imported, so their import-time lines are caught
too) and removes them again when verbose; :func:`quiet_prints` drops the printed ones around the calls that print
them. ``logging.verbose=true`` shows them all from the moment the config is read; ``LMRECIPE_VERBOSE=1`` shows them
from the start (the lines printed while libraries are imported come before any config is read).

Only lines that say nothing about this run are listed: a failure of a library that the recipe does not use, a
deprecation inside a library, a per-checkpoint line that the recipe's own "Saved checkpoint" line replaces.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import io
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

VERBOSE_ENV = "LMRECIPE_VERBOSE"
"""``1``: show every line of :data:`QUIET_LINES` (the import-time ones too, which come before the config)."""

LOGGER, WARNING, PRINT = "logger", "warning", "print"


@dataclass(frozen=True)
class QuietLine:
    """One kind of line that is not shown unless verbose."""

    kind: str
    """``logger`` (a logging record), ``warning`` (``warnings.warn``) or ``print`` (stdout/stderr, by a library)."""
    source: str
    """The logger's name; the warning's category name; for a print, the library that prints it."""
    pattern: str
    """A regular expression searched in the message (the line, for a print)."""
    why: str


QUIET_LINES = (
    QuietLine(LOGGER, "torchao",
              r"^Failed to load .*torchao/_C.*\.so|^Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP",
              "torchao's wheel ships a CPython 3.10 and a CUDA-only extension, which cannot load under another Python "
              "or a torch without CUDA; the recipe uses neither (fp8 trains through torch's scaled matmul)"),
    QuietLine(LOGGER, "torchao.kernel.intmm", r"Detected no triton",
              "torchao's int8 matmul kernels need Triton; the recipe does not use them"),
    QuietLine(LOGGER, "torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile",
              "torchao registers its enums with an API that torch now deprecates; nothing for a user to change"),
    QuietLine(LOGGER, "DeepSpeed", r"^Setting accelerator to CPU",
              "DeepSpeed's guess on a machine without a GPU; the run's first line names its device and processes"),
    QuietLine(LOGGER, "accelerate.accelerator",
              r"(Saving current state to|Loading states from|Loading in \d+ custom states$|"
              r"(Saving|Loading) DeepSpeed Model and Optimizer$|"
              r"DeepSpeed Model and Optimizer (saved to|loaded from) )",
              "Accelerate's lines of each checkpoint save and load; the recipe logs one line for each"),
    QuietLine(LOGGER, "accelerate.checkpointing",
              r"((Model weights|Optimizer state|Scheduler state|Sampler state for dataloader \d+|Gradient scaler state|"
              r"Random states) saved in |All (model weights|optimizer states|scheduler states|dataloader sampler "
              r"states|random states) loaded successfully$)",
              "Accelerate's lines of each checkpoint save and load; the recipe logs one line for each"),
    QuietLine(WARNING, "FutureWarning", r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
              "DeepSpeed's ZeRO calls a torch collective that torch now deprecates; nothing for a user to change"),
    QuietLine(WARNING, "FutureWarning", r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
              "DeepSpeed's ZeRO-3 calls a torch collective that torch now deprecates, twice per step and rank; nothing "
              "for a user to change"),
    QuietLine(LOGGER, "botocore.credentials", r"^Found credentials in ",
              "boto3 says where it found the object store's credentials each time a client is made; the run names its "
              "bucket, and a missing or refused credential is an error of its own"),
    QuietLine(PRINT, "deepspeed", r"^DeepSpeed deepspeed\.ops\.comm\.\w+ built successfully$",
              "DeepSpeed prints it on each process when it loads its CPU collectives (built once, then cached)"),
    QuietLine(PRINT, "deepspeed", r"^(Processing zero checkpoint|Parsing checkpoint created by deepspeed|Detected "
              r"checkpoint of type zero stage|Reconstructed fp32 state dict with)",
              "DeepSpeed's progress while the export consolidates ZeRO shards; the export logs its own line"),
    QuietLine(PRINT, "tqdm", r"^\s*(Loading checkpoint shards|Writing model shards):",
              "progress bars of steps that take well under a second (ZeRO consolidation, the export's write)"),
)


TORCHAO_SKIP_ENV = "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"


def torchao_extensions_unloadable() -> bool:
    """Whether torchao is installed and none of its extension binaries (``torchao/_C*.so``) can load here: each is
    built for another CPython, or links torch's CUDA library while this torch has none. Looked up without importing
    torchao or torch."""
    torchao, torch = importlib.util.find_spec("torchao"), importlib.util.find_spec("torch")
    if torchao is None or torchao.origin is None or torch is None or torch.origin is None:
        return False
    binaries = sorted(Path(torchao.origin).parent.glob("_C*.so"))
    torch_has_cuda = any((Path(torch.origin).parent / "lib").glob("libtorch_cuda*.so"))
    here = f"{sys.version_info.major}{sys.version_info.minor}"

    def unloadable(path: Path) -> bool:
        python = re.search(r"\.cpython-(\d+)", path.name)
        if python and python.group(1) != here:
            return True
        with open(path, "rb") as fh:
            head = fh.read(1 << 20)  # the dynamic section's library names lie at the start of the file
        return not torch_has_cuda and b"libtorch_cuda" in head

    return bool(binaries) and all(unloadable(path) for path in binaries)


def maybe_skip_torchao_extensions() -> None:
    """Tell torchao not to try loading extension binaries that cannot load here (each try logs a warning); call
    before torchao is imported. A choice already made in the environment stands."""
    if TORCHAO_SKIP_ENV not in os.environ and torchao_extensions_unloadable():
        os.environ[TORCHAO_SKIP_ENV] = "1"


def verbose_from_env() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


class QuietFilter(logging.Filter):
    """Drops a logger's records whose message matches ``pattern``; passes every other record."""

    def __init__(self, pattern: str):
        super().__init__()
        self.regex = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the handler's to report
            return True
        return self.regex.search(message) is None


def quiet(verbose: bool = False) -> None:
    """Install the filters of :data:`QUIET_LINES` (idempotent), or remove them when ``verbose`` or
    ``$LMRECIPE_VERBOSE`` is set. A logger's filter applies to the records logged through that logger itself,
    whatever handler prints them (DeepSpeed and torch bring their own)."""
    verbose = verbose or verbose_from_env()
    if verbose:
        os.environ[VERBOSE_ENV] = "1"  # quiet_prints and this run's other processes (tools, workers) follow
    for line in QUIET_LINES:
        if line.kind == LOGGER:
            logger = logging.getLogger(line.source)
            for old in [f for f in logger.filters if isinstance(f, QuietFilter)]:
                logger.removeFilter(old)
            if not verbose:
                logger.addFilter(QuietFilter(line.pattern))
        elif line.kind == WARNING:
            warnings.filters[:] = [f for f in warnings.filters
                                   if not (f[0] == "ignore" and getattr(f[1], "pattern", None) == line.pattern)]
            getattr(warnings, "_filters_mutated", lambda: None)()  # the module's cache of decisions is stale now
            if not verbose:
                warnings.filterwarnings("ignore", message=line.pattern, category=getattr(builtins, line.source))


def is_quiet_print(line: str) -> bool:
    """Whether a printed line (a ``\\r`` segment of a progress bar included) is one of :data:`QUIET_LINES`."""
    return any(q.kind == PRINT and re.search(q.pattern, line) for q in QUIET_LINES)


class _LineFilter(io.TextIOBase):
    """A text stream that writes to ``target`` every line (or ``\\r``-separated progress segment) that
    :func:`is_quiet_print` does not match."""

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.pending = ""
        self.dropped = False
        """Whether the last line was dropped: the newline that ends a dropped progress bar goes with it."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *done, self.pending = re.split(r"(?<=[\r\n])", self.pending)
        kept = "".join(part for part in done if self._keep(part))
        if kept:
            self.target.write(kept)
        return len(text)

    def _keep(self, part: str) -> bool:
        if part == "\r" or (part == "\n" and self.dropped):
            return False  # a bare carriage return shows nothing; a dropped bar's closing newline goes with it
        self.dropped = is_quiet_print(part.rstrip("\r\n"))
        return not self.dropped

    def flush(self) -> None:
        if self.pending and self._keep(self.pending):
            self.target.write(self.pending)
        self.pending = ""
        self.target.flush()


@contextlib.contextmanager
def quiet_prints(stdout=None) -> Iterator[None]:
    """Drop the printed lines of :data:`QUIET_LINES` on stdout and stderr inside the block (not when verbose).
    ``stdout``: where the block's standard output goes (default: stdout itself)."""
    out = sys.stdout if stdout is None else stdout
    if verbose_from_env():
        with contextlib.redirect_stdout(out):
            yield
        return
    filtered_out, filtered_err = _LineFilter(out), _LineFilter(sys.stderr)
    try:
        with contextlib.redirect_stdout(filtered_out), contextlib.redirect_stderr(filtered_err):
            yield
    finally:
        filtered_out.flush()
        filtered_err.flush()
