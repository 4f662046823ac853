"""The start-up checks, listed once (:data:`CHECKS`): a run makes them before it builds anything, and
``train.py --dry-run`` makes the same ones and stops.

:func:`preflight` runs every check of the list in order and goes on past a problem, so all are reported at once; a
check that needs a failed one's result is skipped. It checks the output folder and what a resume would load from it
(a branch's ``out_dir`` outside its source run); the precision on this machine; the trackers' libraries; the
attention kernel and ``model.kernels``; the launch (``WORLD_SIZE`` as the launcher sets it, else 1) against the batch sizes, the parallel
splits and the DeepSpeed JSON; ``checkpoint.remote`` (the dry run only: a run's own remote resume reads it); every
data folder (``meta.json``, sizes, ``data.seq_len``, the vocabulary, the document index); the model against the data
and its position limit, its parallel splits and its attention (with document masking, recurrent layers that cannot
run per document: ``lmrecipe/model/linear_attention.py``). It also gathers the notes a valid but surprising
configuration deserves (a warning in a run, a ``note:`` line in a dry run).

The two modes differ only where a run acts and a dry run must not: a run stages a data folder given as a URL into
``data.cache_dir`` (the dry run reads its meta.json where it is) and a dry run asks object storage what a resume
would download. Two checks need the process group and stay in ``build_run``: the trackers' folders and servers (the
main process looks, every rank learns the answer) and the number of processes Accelerate formed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

from lmrecipe.checkpoint.remote import CheckpointMirror
from lmrecipe.checkpoint.resume import check_branch_out_dir
from lmrecipe.checkpoint.storage import find_resume_checkpoint, step_of_dir
from lmrecipe.cli import check_output_path
from lmrecipe.config import Config
from lmrecipe.config.notes import unreached_steps
from lmrecipe.config.sections import fail_all
from lmrecipe.data.batches import BatchLayout
from lmrecipe.data.format import check_model_vocab, open_data
from lmrecipe.data.remote import check_remote_data
from lmrecipe.data.sources import check_sources, local_sources
from lmrecipe.errors import UserError
from lmrecipe.model.attention import DocumentAttention, check_attention_kernel
from lmrecipe.model.build import build_attention, build_hf_config, check_init_tokenizer
from lmrecipe.model.kernels import check_kernel_arch, check_kernels
from lmrecipe.objstore import READ_PATIENCE_S, check_access, is_remote, transient_errors, unreadable
from lmrecipe.observe.trackers import check_trackers
from lmrecipe.optim import lr_at
from lmrecipe.parallel.launch import check_launch, check_launched_processes
from lmrecipe.parallel.precision import check_precision
from lmrecipe.parallel.splits import check_sequence_parallel_model, check_tensor_parallel_model
from lmrecipe.parallel.topology import Topology, world_size_from_env

T = TypeVar("T")


@dataclass
class Preflight:
    """What the checks found: every problem, the notes, and the results a run builds on (None where a check failed)."""

    cfg: Config
    out_dir: Path
    dry: bool = False
    """The dry run's mode: nothing is staged or written, and the remote resume point is asked for."""
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Valid but surprising settings: a run logs them as warnings, a dry run prints them as ``note:`` lines."""
    lines: list[str] = field(default_factory=list)
    """What a dry run shows of the data (windows per folder)."""
    resume_from: str | Path | None = None
    precision: str | None = None
    world_size: int = 1
    topology: Topology | None = None
    batch: BatchLayout | None = None
    """Rank 0's share of each optimizer step."""
    ds_config: dict | None = None
    meta: dict | None = None
    """The first data folder's meta.json."""
    hf_config: object | None = None
    attention: DocumentAttention | None = None
    sources: list | None = None
    """The data folders on this machine (a run's staged copies of URLs) once their meta.json passed."""
    opened_sources: list | None = None
    """Every data source with what ``open_data`` returned for it (None where one failed or was not opened): a run
    trains on them without opening them again."""
    attention_runs: bool = True
    """The attention kernel can run on this machine (else the model's attention is not built)."""
    kernels_run: bool = True
    """``model.kernels`` can run on this machine (else the architecture is not checked against them)."""

    def check(self, what: Callable[[], T]) -> T | None:
        """``what()``, or None with its UserError's message added to the problems."""
        try:
            return what()
        except UserError as err:
            self.problems.append(str(err))
            return None

    def raise_problems(self, heading: str = "problems found before the start (nothing was trained or written)") -> None:
        """One UserError (exit 2) listing every problem, if any."""
        if self.problems:
            raise fail_all(self.problems, heading=heading)


def check_out_dir(pf: Preflight) -> None:
    pf.check(lambda: check_output_path(pf.out_dir, "out_dir"))
    pf.resume_from = pf.check(lambda: find_resume_checkpoint(pf.cfg.checkpoint.resume, pf.out_dir / "checkpoints"))
    if pf.cfg.checkpoint.branch_from is not None:
        pf.check(lambda: check_branch_out_dir(pf.cfg.checkpoint.branch_from, pf.out_dir))


def check_machine(pf: Preflight) -> None:
    """The precision, the trackers' libraries, the attention kernel and ``model.kernels`` on this machine."""
    pf.precision = pf.check(lambda: check_precision(pf.cfg.train.precision))
    pf.check(lambda: check_trackers(pf.cfg.logging.trackers))
    pf.attention_runs = pf.check(lambda: check_attention_kernel(pf.cfg.model.attn_implementation) or True) is not None
    pf.kernels_run = pf.check(lambda: check_kernels(pf.cfg.model.kernels) or True) is not None


def check_launch_of(pf: Preflight) -> None:
    """The launcher's processes, then the recipe's splits, batch and DeepSpeed JSON against them (a bad
    ``WORLD_SIZE`` is one problem; the rest is judged as for one process)."""
    pf.check(check_launched_processes)
    pf.world_size = pf.check(world_size_from_env) or 1
    cfg = pf.cfg
    launch = pf.check(lambda: check_launch(cfg.workload(), cfg.distributed.deepspeed_config_path(), pf.world_size,
                                           pf.precision or "fp32"))
    if launch is not None:
        pf.topology, pf.batch, pf.ds_config = launch


def check_remote_checkpoint(pf: Preflight) -> None:
    """``checkpoint.remote`` readable with the run's credentials and, on a resume, what it would download first (the
    dry run only: a run's remote resume does both itself)."""
    if not (pf.dry and pf.cfg.checkpoint.remote):
        return
    store = pf.check(lambda: check_access(pf.cfg.checkpoint.remote, "checkpoint.remote", write=False))
    if store is None or pf.cfg.checkpoint.resume != "auto":
        return
    local = step_of_dir(Path(pf.resume_from).name) if pf.resume_from is not None else None
    remote = pf.check(lambda: remote_resume_point(store, pf.out_dir, local))
    if remote is not None:
        pf.resume_from = f"{store.url}/checkpoints/{remote[0]} (newer than the local folder's: downloaded first)"


def remote_resume_point(store, out_dir: Path, local_step: int | None) -> tuple[str, int] | None:
    """What the run's resume would download from ``store`` (:meth:`CheckpointMirror.resume_point`); UserError when
    the remote cannot be read within :data:`READ_PATIENCE_S` per request."""
    mirror = CheckpointMirror(store, out_dir / "checkpoints", rank=0, world_size=1, keep_last=1,
                              patience_s=READ_PATIENCE_S)
    try:
        return mirror.resume_point(local_step)
    except transient_errors() as err:
        raise unreadable(store.url, err, "checkpoint.remote") from None


def check_data(pf: Preflight) -> None:
    """Every data folder's meta.json, tokenizer and vocabulary against the model's settings (its windows are opened by
    :func:`check_windows`, once the model's vocabulary is known). A folder given as a URL: a run stages it into
    ``data.cache_dir``; a dry run reads its meta.json where it is and downloads nothing."""
    data, model = pf.cfg.data, pf.cfg.model
    remote = [s for s in data.source_list() if is_remote(s.path)] if pf.dry else []
    if remote:
        metas = [pf.check(lambda s=s: check_remote_data(s.path, "data.path")) for s in remote]
        pf.lines += [f"data {s.path}: in object storage; staged into data.cache_dir={data.cache_dir} before the "
                     f"first step ({sum(m['splits'][k]['n_tokens'] for k in m['splits']):,} tokens)"
                     for s, m in zip(remote, metas) if m is not None]
        if len(remote) == len(data.source_list()):
            pf.meta = metas[0]
            return
        data = dataclasses.replace(data, sources=[s for s in data.source_list() if not is_remote(s.path)], path=None)
    meta = pf.check(lambda: check_sources(data))
    if meta is None:
        return
    pf.meta = pf.meta or meta
    sources = local_sources(data)  # a run's staged copies (a dry run has only local folders here)
    pf.check(lambda: check_init_tokenizer(model, sources[0].path))
    if not model.vocab_beyond_data:
        pf.check(lambda: check_model_vocab(model.vocab_size, meta, sources[0].path))
    pf.sources = sources


def check_model(pf: Preflight) -> None:
    """The model's configuration against the data (its position limit), the parallel splits and the attention."""
    if pf.meta is None and pf.cfg.model.vocab_size is None:
        return  # its vocabulary comes from the data, which failed
    cfg = pf.cfg
    vocab_size = cfg.model.vocab_size or int(pf.meta["vocab_size"])
    pf.hf_config = pf.check(lambda: build_hf_config(cfg.model, vocab_size, cfg.data.seq_len))
    if pf.hf_config is None:
        return
    if cfg.data.seq_len > pf.hf_config.max_position_embeddings:
        pf.problems.append(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
            f"{pf.hf_config.max_position_embeddings}. Lower data.seq_len or raise model.max_position_embeddings.")
    pf.check(lambda: check_sequence_parallel_model(cfg.distributed.sequence_parallel_size, pf.hf_config))
    pf.check(lambda: check_tensor_parallel_model(cfg.distributed.tensor_parallel_size, pf.hf_config))
    if pf.attention_runs:
        pf.attention = pf.check(lambda: build_attention(cfg.model, cfg.data, pf.hf_config))
    if pf.kernels_run:
        pf.check(lambda: check_kernel_arch(cfg.model.kernels, pf.hf_config))


def check_windows(pf: Preflight) -> None:
    """Every data folder opened with training's checks, its ids against the model's vocabulary (a run trains on what
    they opened: ``opened_sources``), and a note when a validation split holds fewer windows than
    ``data.val_windows`` (each evaluation then reads them all)."""
    if pf.sources is None:
        return  # no local folder, or their meta.json failed
    data = pf.cfg.data
    vocab_size = pf.hf_config.vocab_size if pf.hf_config is not None else \
        pf.cfg.model.vocab_size or int(pf.meta["vocab_size"])
    opened = []
    for i, source in enumerate(pf.sources):
        where = f"data.sources[{i}] ({source.resolved_name()}, {source.path}): " if data.is_mixture() else ""
        try:
            opened.append((source, open_data(source.path, data.seq_len, vocab_size, documents=data.document_masking)))
        except UserError as err:
            pf.problems.append(f"{where}{err}")
            continue
        _, train, val = opened[-1][1]
        pf.lines.append(f"data {source.path}: {len(train):,} training windows and {len(val):,} validation "
                        f"windows of {data.seq_len} tokens")
        if len(val) < data.val_windows:
            pf.notes.append(f"{where or source.path + ': '}the validation split holds {len(val)} windows of "
                            f"{data.seq_len} tokens, fewer than data.val_windows={data.val_windows}: each evaluation "
                            f"reads those {len(val)}. Set data.val_windows={len(val)} to say so, or prepare the data "
                            "with a larger --val-fraction.")
    if len(opened) == len(data.source_list()):
        pf.opened_sources = opened


def add_notes(pf: Preflight) -> None:
    """Valid settings that do not do what a reader may expect."""
    cfg = pf.cfg
    if cfg.schedule.warmup_steps > cfg.train.max_steps:  # allowed: a short smoke run of a long recipe
        last_lr = lr_at(cfg.train.max_steps - 1, cfg.train.max_steps, cfg.optim, cfg.schedule)
        pf.notes.append(f"schedule.warmup_steps={cfg.schedule.warmup_steps} exceeds train.max_steps="
                        f"{cfg.train.max_steps}: the learning rate stops at {last_lr:.3g}, below "
                        f"optim.lr={cfg.optim.lr:.3g}.")
    pf.notes += unreached_steps(cfg.data, cfg.train)  # a stage or ramp point at or past the end
    if cfg.train.precision == "fp8" and not cfg.train.compile:  # bench/gpu/results/2026-11-26T161627-h100.json
        pf.notes.append("train.precision=fp8 with train.compile=none: on one H100 the 1B recipe's fp8 eager ran at "
                        "0.558x bf16's tokens/s (docs/benchmarks/gpu.md). Use train.precision=bf16, or set "
                        "train.compile (fp8 compiled: not measured).")
    zero = pf.topology.zero if pf.topology is not None else None
    reentrant = cfg.train.checkpointing_reentrant
    if zero is not None and zero.stage == 3 and cfg.train.gradient_checkpointing and not reentrant:
        pf.notes.append("ZeRO-3 with non-reentrant activation checkpointing is known to fail; "
                        "train.checkpointing_reentrant=true is the workaround.")


#: Every start-up check, in the order they run (each may use the results of those before it).
CHECKS: tuple[Callable[[Preflight], None], ...] = (
    check_out_dir,
    check_machine,
    check_launch_of,
    check_remote_checkpoint,
    check_data,
    check_model,
    check_windows,
    add_notes,
)


def preflight(cfg: Config, out_dir: str | Path | None = None, dry: bool = False) -> Preflight:
    """Run :data:`CHECKS` over ``cfg`` for a run in ``out_dir`` (default ``cfg.out_dir``; the module docstring);
    nothing is written, and in a dry run nothing staged."""
    pf = Preflight(cfg, Path(cfg.out_dir if out_dir is None else out_dir), dry=dry)
    for check in CHECKS:
        check(pf)
    return pf
