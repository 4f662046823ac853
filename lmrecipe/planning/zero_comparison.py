"""ZeRO stage comparison: one recipe trained under several DeepSpeed configs, measured side by side.

Each config runs ``train.py`` through ``accelerate launch`` (as slurm/launch.sh would on one node) into
``OUT/<config>/``, sequentially; the results are read back from the run folders (``metrics.jsonl``,
``run_meta.json``, ``memory_rank*.json``) and written as ``results.csv``, ``results.md`` and
``memory_throughput.png``.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from lmrecipe.config import (
    Config,
    DataConfig,
    DistributedConfig,
    ModelConfig,
    Workload,
    load_config,
    resolve_deepspeed_config,
)
from lmrecipe.data.batches import BatchLayout
from lmrecipe.data.format import load_meta
from lmrecipe.errors import UserError, fail
from lmrecipe.fileio import atomic_path, write_text_atomic
from lmrecipe.launch import accelerate_launch_cmd
from lmrecipe.planning.memory import MemoryEstimate, ModelShape, estimate_run, format_bytes, model_shape, read_measured
from lmrecipe.model.build import build_hf_config
from lmrecipe.observe.metrics_log import read_metrics
from lmrecipe.observe.plots import plot_memory_throughput
from lmrecipe.parallel.launch import check_launch as check_distributed_launch
from lmrecipe.parallel.precision import resolve_precision
from lmrecipe.parallel.topology import Topology

logger = logging.getLogger(__name__)

DEFAULT_CONFIGS = ("none", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
BASELINE = "none"
COMPARE_LOG = "train.log"
"""Each run's output, written into its folder before it starts: it also marks the folder as a comparison's."""

# Run-control settings of every comparison run (not hyperparameters): a loss at every step to compare,
# a fresh start, and no export.
_RUN_OVERRIDES = ("logging.log_every_steps=1", "logging.progress_bar=false", "checkpoint.resume=none",
                  "checkpoint.every_steps=0", "checkpoint.export_at_end=false", "train.eval_every_steps=0",
                  "logging.measure_model_states=true")


def ds_config_path(name: str) -> str | None:
    """``none`` -> no DeepSpeed; ``zero2`` -> ``ds_configs/zero2.json``; a path to a JSON file as is; a ``+option``
    suffix (:func:`config_overrides`) is not part of the path."""
    path = resolve_deepspeed_config(name.split("+")[0])
    return None if path is None else path.as_posix()


def config_overrides(name: str) -> list[str]:
    """The recipe overrides of a config's ``+option`` suffixes: ``zero3+sp2`` trains ZeRO-3 with
    ``distributed.sequence_parallel_size=2``; ``zero2+tp2`` with DeepSpeed AutoTP over 2 ranks
    (``distributed.tensor_parallel_size=2``); ``zero2+ep2`` with DeepSpeed AutoEP splitting an MoE model's experts
    over 2 ranks (``distributed.expert_parallel_size=2``); ``zero2+fp8`` with ``train.precision=fp8``;
    ``zero2+muon`` with ``optim.name=muon`` (and ``optim.grad_clip=0``, which Muon under DeepSpeed needs)."""
    overrides = []
    for option in name.split("+")[1:]:
        if option.startswith("sp") and option[2:].isdigit():
            overrides.append(f"distributed.sequence_parallel_size={int(option[2:])}")
        elif option.startswith("tp") and option[2:].isdigit():
            overrides.append(f"distributed.tensor_parallel_size={int(option[2:])}")
        elif option.startswith("ep") and option[2:].isdigit():
            overrides.append(f"distributed.expert_parallel_size={int(option[2:])}")
        elif option == "fp8":
            overrides.append("train.precision=fp8")
        elif option == "muon":
            overrides += ["optim.name=muon", "optim.grad_clip=0"]
        else:
            raise fail(f"Config {name!r}: unknown option +{option}. Options: +spN (Ulysses sequence parallelism over "
                       "N ranks, e.g. zero3+sp2), +tpN (AutoTP tensor parallelism over N ranks, e.g. zero2+tp2), +epN (AutoEP "
                       "expert parallelism over N ranks, an MoE recipe, e.g. zero2+ep2), +fp8 (train.precision=fp8), "
                       "+muon (optim.name=muon).")
    return overrides


def config_label(name: str) -> str:
    return Path(name).stem if name.endswith(".json") else name


def config_for(recipe: str, overrides: list[str], name: str, run_overrides: list[str] = ()) -> Config:
    """The recipe as config ``name`` trains it: its DeepSpeed JSON (or none) and its ``+option`` overrides, checked
    by the config rules (``lmrecipe/config/rules.py``) as ``train.py`` checks them. ``run_overrides`` come before
    the config's own settings (a comparison's run control)."""
    ds_path = ds_config_path(name)
    return load_config(recipe, [*overrides, *run_overrides,
                                f"distributed.deepspeed_config={ds_path if ds_path else 'null'}",
                                *config_overrides(name)])


@dataclass
class ConfigResult:
    """One row of results.csv."""

    config: str
    status: str
    """ok, or why the run has no results."""
    tokens_per_sec: float | None = None
    """Median tokens/s over all processes, steps after the first (which pays for start-up work)."""
    memory_per_rank_gb: float | None = None
    """GPU: the allocator's peak on rank 0. CPU: the measured model-state bytes of the largest rank."""
    peak_allocated_gb: float | None = None
    """GPU only: torch.cuda.max_memory_allocated on rank 0 over the run."""
    model_states_measured_mb: float | None = None
    """Weights + gradients + optimizer states held by the largest rank, measured from the tensors (MB = 1e6 B)."""
    model_states_estimated_mb: float | None = None
    """The same from lmrecipe.planning.memory's formulas."""
    measured_over_estimated: float | None = None
    model_states_offloaded_mb: float | None = None
    """Part of the measured model states in CPU memory while training on GPUs (offload)."""
    final_loss: float | None = None
    max_loss_diff_vs_none: float | None = None
    """Largest |loss - loss of the no-DeepSpeed run| at any logged step."""
    seconds: float | None = None
    """Wall time of the whole run, start-up included."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child_env() -> dict:
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a comparison started inside a launched job must not inherit its topology
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _launch(distributed: DistributedConfig, script_args: list[str], num_processes: int) -> list[str]:
    if num_processes == 1:
        return [sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), *script_args]
    return accelerate_launch_cmd(distributed, script_args, num_processes, _free_port())


def run_comparison(recipe: str, overrides: list[str], configs: list[str], steps: int, num_processes: int,
                   out: Path, overwrite: bool = False) -> list[ConfigResult]:
    """Train ``recipe`` for ``steps`` steps under each config and collect one :class:`ConfigResult` each."""
    if steps < 2:
        raise fail(f"--steps={steps}: at least 2 steps are needed (model states are measured in the second).")
    labels = [config_label(c) for c in configs]
    if len(set(labels)) != len(labels):
        raise fail(f"Configs {configs} repeat a name; each needs its own folder under {out}.")
    runs = []
    for name, label in zip(configs, labels):  # check every config before the first run, as training would
        ds_path = ds_config_path(name)
        run_control = [*_RUN_OVERRIDES, f"train.max_steps={steps}", f"out_dir={out / label}"]
        try:
            cfg = config_for(recipe, overrides, name, run_control)
            check_launch(cfg.workload(), ds_path, num_processes, 1, resolve_precision(cfg.train.precision))
        except UserError as err:
            raise refusal_of(name, f"cannot train on {num_processes} processes (--nproc)", err) from None
        args = [recipe, *overrides, *run_control, f"distributed.deepspeed_config={ds_path if ds_path else 'null'}",
                *config_overrides(name)]
        check_replaceable(out / label, overwrite)
        runs.append((label, cfg, args))
    for source in runs[0][1].data.source_list():  # every config reads the same data, which training checks first
        load_meta(source.path)
    out.mkdir(parents=True, exist_ok=True)

    results = []
    for i, (label, cfg, args) in enumerate(runs, start=1):
        run_dir = out / label
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        log_path = run_dir / COMPARE_LOG
        logger.info("[%d/%d] %s: training %d steps on %d processes (log: %s)", i, len(runs), label, steps, num_processes, log_path)
        start = time.perf_counter()
        with open(log_path, "w") as log:  # first, so that a later --overwrite knows the folder as a comparison's
            proc = subprocess.run(_launch(cfg.distributed, args, num_processes), stdout=log, stderr=subprocess.STDOUT,
                                  env=_child_env())
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
            logger.error("[%d/%d] %s: failed with exit code %d after %.0f s. Last lines of %s:\n%s",
                         i, len(runs), label, proc.returncode, seconds, log_path, tail)
            results.append(ConfigResult(label, f"failed (exit {proc.returncode})", seconds=seconds))
            continue
        result = collect_result(label, cfg.workload(), run_dir, seconds)
        results.append(result)
        logger.info("[%d/%d] %s: done in %.0f s | %s tok/s | final loss %s | model states %s per rank (estimate %s)",
                    i, len(runs), label, seconds, _fmt(result.tokens_per_sec, ",.0f"), _fmt(result.final_loss, ".4f"),
                    _mb(result.model_states_measured_mb), _mb(result.model_states_estimated_mb))
    add_loss_differences(results, out)
    return results


def refusal_of(name: str, why: str, err: UserError) -> UserError:
    """``err`` (a refusal of config ``name``) as one message that names the config first; ``why`` says what it was
    checked for (e.g. ``cannot train on 3 processes``)."""
    text = str(err)
    if "\n- " not in text:  # one paragraph (a list of broken rules keeps its lines)
        text = " ".join(text.split())
    return fail(f"Config {name} {why}: {text}", exit_code=err.exit_code)


def check_replaceable(run_dir: Path, overwrite: bool) -> None:
    """UserError unless ``run_dir`` is absent, or (with ``overwrite``) a run of an earlier comparison: one that holds
    the :data:`COMPARE_LOG` a comparison writes first. A training run of the user's own is never replaced."""
    if not (run_dir.exists() or run_dir.is_symlink()):
        return
    if not overwrite:
        raise fail(f"{run_dir} exists. Pass --overwrite to replace it, or choose another --out.")
    if not run_dir.is_dir() or not (run_dir / COMPARE_LOG).is_file():
        raise fail(f"{run_dir} is not a run of an earlier comparison (it has no {COMPARE_LOG}): --overwrite replaces "
                   "only those, and this may be a training run or other files of yours. Choose another --out, or move "
                   f"{run_dir} away.")


def _mb(value: float | None) -> str:
    return "n/a" if value is None else format_bytes(value * 1e6)


def collect_result(label: str, work: Workload, run_dir: Path, seconds: float) -> ConfigResult:
    """Read one finished run folder back into a result row."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    meta = json.loads((run_dir / "run_meta.json").read_text())
    later = [r["tokens_per_sec"] for r in rows if r["step"] > 1] or [r["tokens_per_sec"] for r in rows]
    on_gpu = "gpu" in meta.get("hardware", {})
    peak_alloc = max((r["peak_mem_gb"] for r in rows), default=None) if on_gpu else None

    measured = read_measured(run_dir)
    largest = max(measured, key=lambda m: m["total"]) if measured else None
    states_mb = largest["total"] / 1e6 if largest else None
    offloaded_mb = largest["by_device"].get("cpu", 0) / 1e6 if largest and on_gpu else None

    estimated = estimate_for_run(work, meta)
    estimated_mb = estimated.model_states / 1e6
    return ConfigResult(
        config=label, status="ok",
        tokens_per_sec=statistics.median(later) if later else None,
        memory_per_rank_gb=peak_alloc if on_gpu else (states_mb / 1e3 if states_mb is not None else None),
        peak_allocated_gb=peak_alloc,
        model_states_measured_mb=states_mb,
        model_states_estimated_mb=estimated_mb,
        measured_over_estimated=states_mb / estimated_mb if states_mb is not None else None,
        model_states_offloaded_mb=offloaded_mb,
        final_loss=rows[-1]["loss"] if rows else None,
        seconds=seconds,
    )


def estimate_for_run(work: Workload, meta: dict) -> MemoryEstimate:
    """lmrecipe.planning.memory's estimate for the topology and precision the run actually had."""
    shape = model_shape(build_hf_config(work.model, recipe_vocab_size(work.model, work.data), work.data.seq_len))
    precision = meta.get("precision") or resolve_precision(work.train.precision)
    return estimate_config(work, shape, work.distributed.deepspeed_config_path(), int(meta["world_size"]), 1, precision)


def recipe_vocab_size(model: ModelConfig, data: DataConfig, override: int | None = None) -> int:
    """``override`` if given, else model.vocab_size, else the vocabulary of the recipe's data folder."""
    if override is not None:
        return override
    if model.vocab_size is not None:
        return model.vocab_size
    folder = data.source_list()[0].path  # the sources of a mixture share one tokenizer
    if (Path(folder) / "meta.json").is_file():
        return int(load_meta(folder)["vocab_size"])
    raise fail(
        f"The vocabulary size is unknown: model.vocab_size is null and {folder}/meta.json does not exist. "
        "Set model.vocab_size=N, prepare the data, or pass --vocab-size N."
    )


def check_launch(work: Workload, ds_path: str | Path | None, world_size: int, num_nodes: int,
                 precision: str) -> tuple[Topology, BatchLayout, dict | None]:
    """What training checks of a launch before its first step (:func:`lmrecipe.parallel.launch.check_launch`), for
    one config on ``num_nodes`` nodes. Returns the topology, the batch layout and the filled DeepSpeed config (None
    without DeepSpeed); UserError naming the reason and the fix."""
    if world_size < 1 or num_nodes < 1 or world_size % num_nodes:
        raise fail(f"world size {world_size} must be a positive multiple of the node count {num_nodes}.")
    return check_distributed_launch(work, ds_path, world_size, precision)


def estimate_config(work: Workload, shape: ModelShape, ds_path: str | Path | None, world_size: int, num_nodes: int,
                    precision: str) -> MemoryEstimate:
    """Per-rank memory of the recipe's workload (``Config.workload()``) under one DeepSpeed config (None = no
    DeepSpeed), refused as training would refuse it (:func:`check_launch`)."""
    topology, batch, _ = check_launch(work, ds_path, world_size, num_nodes, precision)
    return estimate_run(shape, work, topology, precision, batch.accum_steps, num_nodes)


def add_loss_differences(results: list[ConfigResult], out: Path) -> None:
    """Fill ``max_loss_diff_vs_none``: the largest loss gap to the no-DeepSpeed run at any common step."""
    if not any(r.config == BASELINE and r.status == "ok" for r in results):
        return
    baseline = {r["step"]: r["loss"] for r in read_metrics(out / BASELINE / "metrics.jsonl") if "loss" in r}
    for result in results:
        if result.status != "ok":
            continue
        losses = {r["step"]: r["loss"] for r in read_metrics(out / result.config / "metrics.jsonl") if "loss" in r}
        common = sorted(set(losses) & set(baseline))
        if common:
            result.max_loss_diff_vs_none = max(abs(losses[s] - baseline[s]) for s in common)


def write_results(results: list[ConfigResult], out: Path, steps: int, num_processes: int) -> None:
    """results.csv, results.md and memory_throughput.png under ``out``."""
    names = [f.name for f in fields(ConfigResult)]
    with atomic_path(out / "results.csv") as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=names)
        writer.writeheader()
        for result in results:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(result).items()})
    write_text_atomic(out / "results.md", results_markdown(results, steps, num_processes))
    ok = [r for r in results if r.status == "ok" and r.memory_per_rank_gb is not None and r.tokens_per_sec is not None]
    if ok:
        plot_memory_throughput([r.config for r in ok], [r.memory_per_rank_gb for r in ok],
                               [r.tokens_per_sec for r in ok], out / "memory_throughput.png")


def results_markdown(results: list[ConfigResult], steps: int, num_processes: int) -> str:
    on_gpu = any(r.peak_allocated_gb is not None for r in results)
    gpu_header = "peak allocated per rank (GB) | " if on_gpu else ""
    lines = [
        f"# ZeRO comparison: {num_processes} processes, {steps} steps",
        "",
        f"| config | tokens/s | {gpu_header}model states per rank, measured (MB) | estimated (MB) | measured / estimated "
        "| final loss | max loss diff vs none | status |",
        "|---|---:|" + ("---:|" if on_gpu else "") + "---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        gpu = f"{_fmt(r.peak_allocated_gb, '.3f')} | " if on_gpu else ""
        lines.append(
            f"| {r.config} | {_fmt(r.tokens_per_sec, ',.0f')} | {gpu}{_fmt(r.model_states_measured_mb, '.2f')} "
            f"| {_fmt(r.model_states_estimated_mb, '.2f')} | {_fmt(r.measured_over_estimated, '.3f')} "
            f"| {_fmt(r.final_loss, '.4f')} | {_fmt(r.max_loss_diff_vs_none, '.2e')} | {r.status} |"
        )
    lines += [
        "",
        "- tokens/s: median over steps after the first, all processes together.",
        *(["- Peak allocated: the CUDA allocator's peak on rank 0 over the run (`peak_mem_gb`)."] if on_gpu else []),
        "- Model states: weights + gradients + optimizer states held by the largest rank, measured from the tensors "
        "during the second step, offloaded ones included (lmrecipe/planning/memory.py). The figure plots "
        + ("the allocator's peak." if on_gpu else "these."),
        "- Estimated: lmrecipe/planning/memory.py's formulas for the same model, world size, precision and config.",
        "- Loss differences are against the `none` (no DeepSpeed) run at every logged step.",
        "",
    ]
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)
