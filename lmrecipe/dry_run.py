"""``train.py --dry-run``: the checks a run makes before its first step, without training.

:func:`dry_run` takes a loaded configuration (its types, ranges and rules are checked by then) and checks, going on
past each problem so all are reported at once: the output folder and what a resume would load from it (a branch's
``out_dir`` outside its source run); the precision on this machine; the trackers' libraries; the launch
(``WORLD_SIZE`` as the launcher sets it, else 1) against the batch sizes, the parallel splits and the DeepSpeed JSON;
every data folder (``meta.json``, sizes, ``data.seq_len``, the vocabulary, the document index; a folder given as a
URL: its remote meta.json, nothing downloaded); ``checkpoint.remote`` (its bucket and prefix listed with the run's
credentials); the model against the data and its position limit, its parallel splits and its attention. It returns
the start-up line the run would log and a memory estimate per rank; a check that needs a failed one's result is
skipped. It builds no Accelerator and no weights (the model's shape is counted on the meta device) and writes nothing.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import torch

from lmrecipe.model.attention import check_flash_kernel
from lmrecipe.checkpoint.remote import CheckpointMirror
from lmrecipe.checkpoint.resume import check_branch_out_dir
from lmrecipe.checkpoint.storage import find_resume_checkpoint, step_of_dir
from lmrecipe.cli import check_output_path
from lmrecipe.config import Config, DataConfig, ModelConfig, Workload
from lmrecipe.config.notes import unreached_steps
from lmrecipe.config.sections import fail_all
from lmrecipe.data.format import open_data
from lmrecipe.data.remote import check_remote_data
from lmrecipe.data.sources import check_sources
from lmrecipe.errors import UserError
from lmrecipe.planning.memory import MemoryEstimate, ModelShape, estimate_run, format_bytes, model_shape
from lmrecipe.model.build import build_attention, build_hf_config, check_init_tokenizer
from lmrecipe.objstore import READ_PATIENCE_S, check_access, is_remote, transient_errors, unreadable
from lmrecipe.observe.trackers import check_trackers
from lmrecipe.parallel.launch import check_launch, check_launched_processes
from lmrecipe.parallel.precision import check_precision
from lmrecipe.parallel.splits import check_sequence_parallel_model, check_tensor_parallel_model
from lmrecipe.parallel.topology import startup_line, world_size_from_env

T = TypeVar("T")


@dataclass
class DryRunReport:
    """What a dry run found: ``lines`` to show (the start-up line, the estimate, notes) and every ``problems``."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def check(self, what: Callable[[], T]) -> T | None:
        """``what()``, or None with its UserError's message added to the problems."""
        try:
            return what()
        except UserError as err:
            self.problems.append(str(err))
            return None

    def text(self) -> str:
        """The lines, and a last one saying whether a problem was found."""
        verdict = (f"dry run: {len(self.problems)} problem(s), listed below" if self.problems else
                   "dry run: no problem found; nothing was trained or written")
        return "\n".join([*self.lines, verdict])

    def raise_problems(self) -> None:
        """UserError listing every problem (exit 2), if any."""
        if self.problems:
            raise fail_all(self.problems, heading="problems found by the dry run (nothing was trained or written)")


def dry_run(cfg: Config) -> DryRunReport:
    """Every start-up check of ``cfg`` that needs no training (module docstring); nothing is written."""
    report = DryRunReport()
    out_dir = Path(cfg.out_dir)
    report.check(lambda: check_output_path(out_dir, "out_dir"))
    resume_from = report.check(lambda: find_resume_checkpoint(cfg.checkpoint.resume, out_dir / "checkpoints"))
    if cfg.checkpoint.branch_from is not None:
        report.check(lambda: check_branch_out_dir(cfg.checkpoint.branch_from, out_dir))
    precision = report.check(lambda: check_precision(cfg.train.precision))
    report.check(lambda: check_trackers(cfg.logging.trackers))
    problems_before = len(report.problems)
    report.check(lambda: check_flash_kernel(cfg.model.attn_implementation))
    attention_runs = len(report.problems) == problems_before
    report.check(check_launched_processes)
    world_size = report.check(world_size_from_env) or 1  # a bad WORLD_SIZE is one problem; the rest as for one
    work = cfg.workload()
    launch = report.check(lambda: check_launch(work, cfg.distributed.deepspeed_config_path(), world_size,
                                               precision or "fp32"))
    if cfg.checkpoint.remote:
        store = report.check(lambda: check_access(cfg.checkpoint.remote, "checkpoint.remote", write=False))
        if store is not None and cfg.checkpoint.resume == "auto":
            local_step = step_of_dir(resume_from.name) if resume_from is not None else None
            remote = report.check(lambda: remote_resume_point(store, out_dir, local_step))
            if remote is not None:
                resume_from = f"{store.url}/checkpoints/{remote[0]} (newer than the local folder's: downloaded first)"
    meta = report.check(lambda: check_data(cfg.data, cfg.model, report))
    vocab_size = cfg.model.vocab_size or (int(meta["vocab_size"]) if meta else None)
    shape = check_model(work, vocab_size, report, attention_runs) if vocab_size is not None else None
    if shape is not None and launch is not None and precision is not None:
        topology, batch, _ = launch
        report.lines.append("start-up line: " + startup_line(
            shape.n_params, shape.active() if shape.expert_params else None, topology, batch, work.data.seq_len,
            precision, work.train.chunk_tokens(vocab_size)))
        memory = report.check(lambda: estimate_run(shape, work, topology, precision, batch.accum_steps,
                                                   _nodes(world_size)))
        if memory is not None:
            report.lines.append(memory_line(memory, cfg.train.gradient_checkpointing))
            report.lines += device_notes(memory, cfg.train.precision, precision)
    if cfg.schedule.warmup_steps > cfg.train.max_steps:  # allowed (a short smoke run of a long recipe), as in training
        report.lines.append(f"note: schedule.warmup_steps={cfg.schedule.warmup_steps} exceeds train.max_steps="
                            f"{cfg.train.max_steps}: the learning rate never reaches optim.lr={cfg.optim.lr:.3g}.")
    report.lines += [f"note: {note}" for note in unreached_steps(cfg.data, cfg.train)]
    if resume_from is not None:
        report.lines.append(f"note: the run resumes from {resume_from} (checkpoint.resume={cfg.checkpoint.resume}).")
    return report


def device_notes(memory: MemoryEstimate, requested: str, precision: str) -> list[str]:
    """Notes on this machine as the run's: where ``auto`` resolved without a GPU, and an estimate above the GPU's
    memory (an estimate, so a note rather than a refusal)."""
    if not torch.cuda.is_available():
        return [f"note: train.precision=auto resolves to {precision} here (no GPU); on a GPU it is bf16 (fp16 on GPUs "
                "without bf16)."] if requested == "auto" else []
    total = torch.cuda.get_device_properties(0).total_memory
    if memory.device_total <= total:
        return []
    return [f"note: the estimate ({format_bytes(memory.device_total)} per rank) exceeds this GPU's "
            f"{format_bytes(total)}: consider train.gradient_checkpointing=true, a smaller train.micro_batch_size, or a "
            "higher ZeRO stage (tools/estimate_memory.py compares them)."]


def remote_resume_point(store, out_dir: Path, local_step: int | None) -> tuple[str, int] | None:
    """What the run's resume would download from ``store`` (:meth:`CheckpointMirror.resume_point`); UserError when
    the remote cannot be read within :data:`READ_PATIENCE_S` per request."""
    mirror = CheckpointMirror(store, out_dir / "checkpoints", rank=0, world_size=1, keep_last=1,
                              patience_s=READ_PATIENCE_S)
    try:
        return mirror.resume_point(local_step)
    except transient_errors() as err:
        raise unreadable(store.url, err, "checkpoint.remote") from None


def check_data(data: DataConfig, model: ModelConfig, report: DryRunReport) -> dict:
    """Open every data folder with training's start-up checks; a note when a validation split holds fewer windows
    than ``data.val_windows`` (the run then evaluates them all). Returns the first folder's meta.json. A folder given
    as a URL is not downloaded: its meta.json is read where it is."""
    remote = [s for s in data.source_list() if is_remote(s.path)]
    if remote:
        metas = [check_remote_data(s.path, "data.path") for s in remote]
        report.lines += [f"data {s.path}: in object storage; staged into data.cache_dir={data.cache_dir} before the "
                         f"first step ({sum(m['splits'][k]['n_tokens'] for k in m['splits']):,} tokens)"
                         for s, m in zip(remote, metas)]
        if len(remote) == len(data.source_list()):
            return metas[0]
        data = dataclasses.replace(data, sources=[s for s in data.source_list() if not is_remote(s.path)], path=None)
    meta = check_sources(data)
    check_init_tokenizer(model, data.source_list()[0].path)
    vocab_size = model.vocab_size or int(meta["vocab_size"])
    for i, source in enumerate(data.source_list()):
        where = f"data.sources[{i}] ({source.resolved_name()}, {source.path}): " if data.is_mixture() else ""
        try:
            _, train, val = open_data(source.path, data.seq_len, vocab_size, documents=data.document_masking)
        except UserError as err:
            report.problems.append(f"{where}{err}")
            continue
        report.lines.append(f"data {source.path}: {len(train):,} training windows and {len(val):,} validation "
                            f"windows of {data.seq_len} tokens")
        if len(val) < data.val_windows:
            report.lines.append(f"note: {where or source.path + ': '}the validation split holds {len(val)} windows "
                                f"of {data.seq_len} tokens, fewer than data.val_windows={data.val_windows}; each "
                                "evaluation reads all of them.")
    return meta


def check_model(work: Workload, vocab_size: int, report: DryRunReport, attention_runs: bool = True) -> ModelShape | None:
    """The model's shape (counted on the meta device), after the checks training makes of it before building it
    (its attention's only when ``attention_runs``: the kernel can run on this machine)."""
    hf_config = report.check(lambda: build_hf_config(work.model, vocab_size, work.data.seq_len))
    if hf_config is None:
        return None
    if work.data.seq_len > hf_config.max_position_embeddings:
        report.problems.append(
            f"data.seq_len={work.data.seq_len} exceeds the model's max_position_embeddings="
            f"{hf_config.max_position_embeddings}. Lower data.seq_len or raise model.max_position_embeddings.")
    report.check(lambda: check_sequence_parallel_model(work.distributed.sequence_parallel_size, hf_config))
    report.check(lambda: check_tensor_parallel_model(work.distributed.tensor_parallel_size, hf_config))
    if attention_runs:
        report.check(lambda: build_attention(work.model, work.data, hf_config))
    return model_shape(hf_config)


def _nodes(world_size: int) -> int:
    """Nodes of the launch: ``WORLD_SIZE / LOCAL_WORLD_SIZE`` as the launcher sets them, else one."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    return world_size // local if local > 0 and world_size % local == 0 else 1


def memory_line(memory: MemoryEstimate, checkpointing: bool) -> str:
    offloaded = f", {format_bytes(memory.cpu_per_node)} offloaded to each node's CPU memory" if memory.cpu_per_node else ""
    activations = memory.activations_checkpointed if checkpointing else memory.activations
    return (f"memory per rank (estimate, lmrecipe/planning/memory.py): {format_bytes(memory.device_total)} on the device = "
            f"model states {format_bytes(memory.model_states_device)} + activations {format_bytes(activations)} "
            f"(activation checkpointing {'on' if checkpointing else 'off'})"
            + (f" + ZeRO-3 gathered {format_bytes(memory.gathered)}" if memory.gathered else "")
            + (f" + weight EMA {format_bytes(memory.ema)}" if memory.ema else "") + offloaded)
