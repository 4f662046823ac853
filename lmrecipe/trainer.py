"""The training loop: ``train_step`` (accumulate / forward / backward / step), then maybe log, maybe eval, maybe save.

``build_run`` sets a run up (Accelerator, data, model, optimizer) and ``train_step`` advances it by one
optimizer step; ``train`` and every benchmark in ``bench/`` call these two, so what is timed is what trains.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import EXIT_PREEMPTED, Checkpointer
from .config import Config, save_config
from .data import Prefetcher, TrainBatches
from .determinism import maybe_set_deterministic
from .distributed import Runtime, build_runtime
from .ema import WeightEMA
from .errors import fail
from .loss import causal_lm_loss, validation_loss
from .memory import attach_model_state_probe
from .mixture import MixtureBatches, TrainingData, check_sources, open_training_data
from .model import build_hf_config, build_model, flops_per_token, param_counts
from .oom import OOMGuard
from .optim import build_optimizer, lr_at, set_lr
from .profiling import StepProfiler, region
from .report import write_run_end
from .reporting import Reporter
from .runlock import RunLock
from .spikes import SpikeGuard

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything besides weights and optimizer state that a resume needs; saved as JSON in each checkpoint.

    Skipped updates are counted on the device as steps go (reading a flag would stall a GPU every step) and
    folded into the fields by :meth:`sync`, which the loop calls at its sync points (log, eval, save, end).
    """

    step: int = 0
    """Optimizer steps completed (the next step to run)."""
    tokens_seen: int = 0
    """Training tokens consumed over all ranks."""
    best_val_loss: float | None = None
    skipped_steps: int = 0
    """Updates skipped for a non-finite loss or gradient norm, over the run (as of the last sync)."""
    consecutive_skips: int = 0
    """Skipped updates in a row up to the last sync."""
    last_val_loss: float | None = None
    last_val_step: int | None = None
    """Step of the latest evaluation (a checkpoint saved at that step is ranked by its loss)."""
    last_val_loss_ema: float | None = None
    """Validation loss of the weight EMA at the latest evaluation (None without ``train.ema_decay``)."""
    evals_without_improvement: int = 0
    """Evaluations in a row whose loss was not below the best before by more than ``train.early_stopping_min_delta``."""
    wall_time_s: float = 0.0
    """Seconds of training over all sessions of the run (as of the last step), for the report's device-hours."""
    skipped_batches: list[int] = field(default_factory=list)
    """Data steps (blocks of ``train.global_batch_size`` samples of the original order) never trained on, because a
    loss spike was rolled back (``lmrecipe/spikes.py``); ascending. Step s reads the s-th data step not listed."""
    rollbacks: int = 0
    """Rollbacks after loss spikes over the run."""
    spike_window: list | None = None
    """The spike rule's window of recent steps' ``[loss, grad_norm]`` (as of the last sync), so a resume judges alike."""

    def __post_init__(self):
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def record_step(self, skipped: torch.Tensor | bool, tokens: int) -> None:
        """Count one optimizer step; ``skipped`` may be a device tensor (no sync) or a bool."""
        self.step += 1
        self.tokens_seen += tokens
        skipped = torch.as_tensor(skipped).long()
        if self._pending is None:
            zero = torch.zeros((), dtype=torch.long, device=skipped.device)
            self._pending = (zero, zero + self.consecutive_skips, zero + self.consecutive_skips)
        total, run, longest = self._pending
        skipped = skipped.to(total.device, non_blocking=True)
        run = (run + 1) * skipped  # length of the current run of skips, 0 after an applied update
        self._pending = (total + skipped, run, torch.maximum(longest, run))

    def sync(self) -> int:
        """Fold the device counters into the fields (one host read); return the longest run of skips since."""
        if self._pending is None:
            return self.consecutive_skips
        total, run, longest = torch.stack(self._pending).tolist()
        self.skipped_steps += total
        self.consecutive_skips = run
        self._pending = None
        return longest

    def record_eval(self, val_loss: float, min_delta: float = 0.0) -> None:
        self.last_val_loss, self.last_val_step = val_loss, self.step
        improved = self.best_val_loss is None or val_loss < self.best_val_loss - min_delta
        self.evals_without_improvement = 0 if improved else self.evals_without_improvement + 1
        self.best_val_loss = val_loss if self.best_val_loss is None else min(self.best_val_loss, val_loss)


@dataclass
class Run:
    """A set-up training run: what ``train_step`` needs, built once by :func:`build_run`."""

    cfg: Config
    runtime: Runtime
    model: torch.nn.Module
    """The prepared model (DDP wrapper or DeepSpeed engine)."""
    optimizer: torch.optim.Optimizer
    data: TrainingData
    """The training data: the sample order and every source's validation windows."""
    prefetcher: Prefetcher
    n_params: int
    flops_per_token: float
    ema: WeightEMA | None = None
    """The weight EMA (``train.ema_decay`` > 0), updated after every optimizer step."""

    @property
    def train_batches(self) -> TrainBatches | MixtureBatches:
        return self.data.train_batches

    @property
    def accelerator(self):
        return self.runtime.accelerator

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.data.seq_len

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.cfg.train.max_steps, self.cfg.optim, self.cfg.schedule)

    def stops_early(self, state: TrainState) -> bool:
        """Early stopping: ``train.early_stopping_patience`` evaluations in a row without improvement."""
        patience = self.cfg.train.early_stopping_patience
        return patience > 0 and state.last_val_step == state.step and state.evals_without_improvement >= patience


@dataclass
class StepResult:
    """What one optimizer step produced. The tensors stay on the device: reading one is a host sync."""

    loss: torch.Tensor
    """Mean training loss of this rank's micro-batches."""
    lr: float
    grad_norm: torch.Tensor | float
    """Global gradient norm before clipping."""
    skipped: torch.Tensor | bool
    """The update was skipped (non-finite loss or gradient norm)."""
    data_time_s: float
    """Seconds the step waited for its batches (prefetched in the background) and their copy to the device."""


SectionTimer = Callable[[str, float], None]
"""Receives (section name, seconds) from ``train_step`` when a benchmark asks for the split of a step."""


def build_run(cfg: Config, out_dir: Path) -> Run:
    """Accelerator first (so ZeRO-3 partitions at construction), then data, model, optimizer, ``prepare``."""
    maybe_set_deterministic(cfg.train.deterministic, cfg.train.seed)  # before CUDA is first used
    runtime = build_runtime(cfg)
    accelerator = runtime.accelerator
    # The data is checked before out_dir is touched: bad data writes nothing.
    meta = check_sources(cfg.data)
    hf_config = build_hf_config(cfg, cfg.model.vocab_size or int(meta["vocab_size"]))
    data = open_training_data(cfg.data, hf_config.vocab_size, runtime.layout, cfg.train.seed)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    if cfg.data.seq_len > hf_config.max_position_embeddings:
        raise fail(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
            f"{hf_config.max_position_embeddings}. Lower data.seq_len or raise model.max_position_embeddings."
        )
    if runtime.zero.stage == 3 and cfg.train.gradient_checkpointing and not cfg.train.checkpointing_reentrant:
        logger.warning("ZeRO-3 with non-reentrant activation checkpointing is known to fail; reentrant is the workaround.")

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, hf_config)
    counts = param_counts(model)
    fpt = flops_per_token(counts["total"], counts["lookup"], hf_config.num_hidden_layers, hf_config.hidden_size, cfg.data.seq_len)
    if cfg.train.compile and not runtime.zero.deepspeed:
        model = torch.compile(model)
    optimizer = build_optimizer(model, cfg.optim, cpu_offload=runtime.zero.offload_optimizer,
                                fused=not runtime.zero.deepspeed and runtime.precision != "fp16")
    model, optimizer = accelerator.prepare(model, optimizer)
    if cfg.train.compile and runtime.zero.deepspeed:
        model.compile()  # DeepSpeed compiles the module it wraps, keeping its own hooks outside the graph
    model.train()
    if cfg.logging.measure_model_states:
        attach_model_state_probe(model, optimizer, out_dir, accelerator.process_index, accelerator.num_processes)

    prefetcher = Prefetcher(data.train_batches, pin_memory=accelerator.device.type == "cuda")
    ema = None
    if cfg.train.ema_decay > 0:
        ema = WeightEMA(model, cfg.train.ema_decay, zero3=runtime.zero.stage == 3, rank=accelerator.process_index,
                        world_size=accelerator.num_processes, is_main=accelerator.is_main_process,
                        device=accelerator.device)
    return Run(cfg, runtime, model, optimizer, data, prefetcher, counts["total"], fpt, ema)


def forward_backward_step(run: Run, inputs: torch.Tensor, targets: torch.Tensor, timer: SectionTimer | None = None) -> torch.Tensor:
    """Loss and gradients of one micro-batch (accumulated; DeepSpeed steps inside at the boundary)."""
    accelerator, model = run.accelerator, run.model
    with accelerator.accumulate(model):
        start = time.perf_counter()
        with region("forward"):
            loss = causal_lm_loss(model, inputs, targets)
        forward_done = time.perf_counter()
        with region("backward"):
            accelerator.backward(loss)
    if timer is not None:
        timer("forward+loss", forward_done - start)
        timer("backward", time.perf_counter() - forward_done)
    return loss.detach()


def optimizer_step(model, optimizer, accelerator, grad_clip: float, deepspeed: bool) -> tuple[torch.Tensor | float, torch.Tensor | bool]:
    """Clip and step, or skip a non-finite update. Returns the pre-clip global grad norm and whether it skipped.

    Without DeepSpeed nothing here reads a tensor on the host: the norm stays on the device, and the fused
    AdamW receives the skip decision as a device flag (``found_inf``, the mechanism GradScaler uses), so a
    non-finite gradient leaves weights, moments and step counts untouched without the CPU waiting for it.
    """
    if deepspeed:
        # The engine already clipped and stepped inside accelerator.backward at the accumulation boundary,
        # and skips the update itself when gradients are not finite.
        skipped_before = model.skipped_steps
        norm = model.get_global_grad_norm()
        norm = torch.as_tensor(float("nan") if norm is None else norm)
        return norm, ~torch.isfinite(norm) | (model.skipped_steps > skipped_before)
    norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if accelerator.scaler is not None:
        # fp16: the GradScaler must see every step, so it can skip an overflow and lower the scale (it syncs).
        optimizer.step()
        skipped = optimizer.step_was_skipped
    else:
        skipped = ~torch.isfinite(norm)
        inner = optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer
        if getattr(inner, "_step_supports_amp_scaling", False):
            inner.grad_scale, inner.found_inf = None, skipped.float()
            optimizer.step()
            inner.found_inf = None
        elif not skipped.item():  # an optimizer without device-side skipping (not the recipe's)
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


def train_step(run: Run, step: int, timer: SectionTimer | None = None) -> StepResult:
    """Optimizer step ``step`` (0-based): set its learning rate, run its micro-batches, update the weights.

    No host synchronisation happens here without DeepSpeed (the loss, norm and skip flag stay on the device);
    the batches of the next step are assembled in the background meanwhile.
    """
    lr = run.lr_at(step)
    set_lr(run.optimizer, lr)
    device = run.accelerator.device
    fetch_start = time.perf_counter()
    with region("data"):
        micro_batches = run.prefetcher.get(step)
    data_time_s = time.perf_counter() - fetch_start
    loss_sum = torch.zeros((), device=device)
    for inputs, targets in micro_batches:
        copy_start = time.perf_counter()
        with region("data"):
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        data_time_s += time.perf_counter() - copy_start
        loss_sum += forward_backward_step(run, inputs, targets, timer)
    optimizer_start = time.perf_counter()
    with region("optimizer"):
        grad_norm, skipped = optimizer_step(run.model, run.optimizer, run.accelerator, run.cfg.optim.grad_clip,
                                            run.runtime.zero.deepspeed)
        if run.ema is not None:
            run.ema.update(skipped)
    if timer is not None:
        timer("data", data_time_s)
        timer("clip+optimizer", time.perf_counter() - optimizer_start)
    return StepResult(loss_sum / len(micro_batches), lr, grad_norm, skipped, data_time_s)


class PreemptionSignal:
    """Records SIGTERM / SIGUSR1, or the death of the launcher, so the loop can finish its step, save and exit.

    A launcher that dies (``accelerate launch`` exits at once on SIGUSR1) leaves its ranks running as orphans:
    they notice their parent changed and stop the same way, with a checkpoint.
    """

    def __init__(self):
        self.name: str | None = None
        self._parent = os.getppid()
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.name = signal.Signals(signum).name

    def requested(self, accelerator, exchange: bool) -> bool:
        """True on every rank when any rank got the signal or lost its launcher.

        One process decides alone at every step. Several exchange their flags (a tiny all-reduce read on the
        host, so a sync) only when ``exchange`` is set, at the loop's sync points: a signal waits at most until
        the next one (``logging.log_every_steps`` steps), and every rank stops at the same step.
        """
        if self.name is None and os.getppid() != self._parent:
            self.name = "the exit of the launcher (parent process)"
        if accelerator.num_processes == 1:
            return self.name is not None
        if not exchange:
            return False
        flag = torch.tensor([1.0 if self.name else 0.0], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def eval_due(cfg: Config, step: int) -> bool:
    every = cfg.train.eval_every_steps
    return step == cfg.train.max_steps or (every > 0 and step % every == 0)


def maybe_evaluate(run: Run, state: TrainState, reporter: Reporter) -> None:
    """Evaluate every ``train.eval_every_steps`` steps and at the last step (with a weight EMA, its weights too).

    The EMA goes first, so the trained weights' loss is measured after they were swapped back (a faulty restore
    would show as a difference from the checkpoint's weights).
    """
    if not eval_due(run.cfg, state.step):
        return

    def losses() -> dict[str, float]:
        return {name: validation_loss(run.model, batches, run.accelerator) for name, batches in run.data.val_sets.items()}

    val_loss_ema = None
    if run.ema is not None:
        with run.ema.swapped_in():
            val_loss_ema = run.data.val_loss(losses())
    per_source = losses()
    val_loss = run.data.val_loss(per_source)
    state.record_eval(val_loss, run.cfg.train.early_stopping_min_delta)
    state.last_val_loss_ema = val_loss_ema
    reporter.eval_done(state, val_loss, per_source if run.data.is_mixture else None, val_loss_ema=val_loss_ema)


def export_source(run: Run, checkpointer: Checkpointer) -> Path | None:
    """The checkpoint the end-of-run export is taken from: with early stopping on, the best by validation loss."""
    if run.cfg.train.early_stopping_patience > 0 and checkpointer.best() is not None:
        return checkpointer.best()
    return checkpointer.latest


def maybe_export(run: Run, checkpoint: Path | None, out_dir: Path) -> Path | None:
    """Export ``checkpoint`` for inference loaders (main process only; the others need not wait)."""
    section = run.cfg.checkpoint
    if not section.export_at_end or checkpoint is None or not run.accelerator.is_main_process:
        return None
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from .export import export_checkpoint

    # Training is over: detach transformers from the live ZeRO-3 config, or building the export's model would
    # enter zero.Init and wait for the other ranks, which have left.
    unset_hf_deepspeed_config()
    return export_checkpoint(checkpoint, out_dir / "export", dtype=section.export_dtype,
                             max_shard_size=section.max_shard_size, overwrite=True, weights=section.export_weights)


def build_checkpointer(run: Run, out_dir: Path) -> Checkpointer:
    cfg = run.cfg
    return Checkpointer(cfg.checkpoint, run.accelerator, out_dir, zero=run.runtime.zero, data_dir=run.data.tokenizer_dir,
                        mixture=run.data.mixture_signature(), seq_len=cfg.data.seq_len,
                        samples_per_step=cfg.train.global_batch_size, max_steps=cfg.train.max_steps,
                        run_config=cfg.to_dict(), lr_schedule=run.lr_at, extra_state=run.ema,
                        publish_timeout_s=cfg.distributed.timeout_s)


def build_spike_guard(run: Run, out_dir: Path, checkpointer: Checkpointer, reporter: Reporter) -> SpikeGuard:
    return SpikeGuard(run.cfg.spike, run.accelerator, out_dir, batches=run.train_batches, prefetcher=run.prefetcher,
                      model=run.model, optimizer=run.optimizer, checkpointer=checkpointer, reporter=reporter,
                      precision=run.runtime.precision)


def build_reporter(run: Run, out_dir: Path, start_step: int, run_meta: dict) -> Reporter:
    cfg, runtime = run.cfg, run.runtime
    return Reporter(cfg.logging, run.accelerator, out_dir, precision=runtime.precision, max_steps=cfg.train.max_steps,
                    start_step=start_step, tokens_per_step=run.tokens_per_step, flops_per_token=run.flops_per_token,
                    run_config=cfg.to_dict(), source_tokens=run.data.tokens_seen, run_meta={
                        "n_params": run.n_params, "flops_per_token": run.flops_per_token,
                        "accum_steps": runtime.layout.accum_steps, "deepspeed_config": runtime.ds_config,
                        "n_train_windows": run.data.n_train_windows,
                        **({"data_mixture": run.data.mixture_signature()} if run.data.is_mixture else {}), **run_meta})


def stop_after_skips(state: TrainState, reporter: Reporter, limit: int) -> None:
    reporter.close(plot=True)
    raise fail(
        f"Stopped at step {state.step}: {limit} or more consecutive updates were skipped because the loss or "
        "gradient norm was not finite (the weights were left unchanged). Try a lower optim.lr, a longer "
        "schedule.warmup_steps, optim.grad_clip=1.0, or train.precision=bf16/fp32 instead of fp16, and resume "
        "from the last checkpoint (checkpoint.resume=auto)."
    )


def train(cfg: Config, recipe: str | None = None) -> TrainState:
    """Train ``cfg`` to ``train.max_steps`` (resuming as ``checkpoint.resume`` says); one run per ``out_dir``.

    ``recipe``: the recipe file ``cfg`` was loaded from, which the run report compares the configuration with.
    """
    out_dir = Path(cfg.out_dir)
    run = build_run(cfg, out_dir)
    lock = RunLock(out_dir)
    if run.accelerator.is_main_process:
        lock.acquire()  # before anything in out_dir is cleaned up or written
    run.accelerator.wait_for_everyone()
    try:
        return train_loop(run, out_dir, recipe)
    finally:
        run.prefetcher.close()
        lock.release()


def train_loop(run: Run, out_dir: Path, recipe: str | None = None) -> TrainState:
    cfg, accelerator, layout = run.cfg, run.accelerator, run.runtime.layout
    checkpointer = build_checkpointer(run, out_dir)
    state = TrainState()
    resumed_from = checkpointer.maybe_resume(run.model, run.optimizer, state)
    if accelerator.is_main_process:
        save_config(cfg, out_dir / "config.yaml")
    reporter = build_reporter(run, out_dir, state.step, {"resumed_from": resumed_from, "recipe": recipe})
    spikes = build_spike_guard(run, out_dir, checkpointer, reporter)
    spikes.load(state)  # a resumed run keeps skipping the batches of spikes rolled back before
    logger.info(
        "model %.2fM params | %d processes x micro-batch %d x accumulation %d = %d sequences of %d tokens | precision %s | %s",
        run.n_params / 1e6, layout.world_size, layout.micro_batch_size, layout.accum_steps,
        layout.global_batch_size, cfg.data.seq_len, run.runtime.precision, run.runtime.zero.describe(),
    )
    if cfg.schedule.warmup_steps > cfg.train.max_steps:
        # Allowed (a short smoke run of a long recipe), but the schedule never reaches its peak: say so.
        logger.warning("schedule.warmup_steps=%d exceeds train.max_steps=%d: the learning rate stops at %.3g, below "
                       "optim.lr=%.3g.", cfg.schedule.warmup_steps, cfg.train.max_steps,
                       run.lr_at(cfg.train.max_steps - 1), cfg.optim.lr)

    stop = PreemptionSignal()
    profiler = StepProfiler(cfg.profile, out_dir, rank=accelerator.process_index, is_main=accelerator.is_main_process,
                            barrier=accelerator.wait_for_everyone)
    oom = OOMGuard(cfg, run.runtime, run.model)
    while state.step < cfg.train.max_steps:
        step_start = time.perf_counter()
        with profiler.step(state.step + 1), oom.step(state.step + 1):
            result = train_step(run, state.step)
        state.record_step(result.skipped, run.tokens_per_step)
        spikes.observe(state, result.loss, result.grad_norm)
        # Host reads happen only at sync points: a logged, evaluated or saved step.
        sync_point = reporter.should_log(state.step) or eval_due(cfg, state.step) or checkpointer.due(state.step)
        longest_skip_run = state.sync() if sync_point else 0
        if sync_point and spikes.maybe_roll_back(state):
            continue  # back at the last checkpoint, with the spike's samples skipped from now on
        if state.step == 1 and cfg.train.compile:
            logger.info("Step 1 took %.1f s, torch.compile's compilation included", time.perf_counter() - step_start)
        reporter.step_done(state, result.loss, result.lr, result.grad_norm, time.perf_counter() - step_start,
                           result.data_time_s)
        if longest_skip_run >= cfg.train.max_consecutive_skips:
            stop_after_skips(state, reporter, cfg.train.max_consecutive_skips)
        maybe_evaluate(run, state, reporter)
        preempted = stop.requested(accelerator, exchange=sync_point)
        if preempted:
            state.sync()  # the checkpoint records the skip counters
        checkpointer.maybe_save(run.model, state, preempted=preempted)
        if preempted:
            reporter.close(plot=True)
            logger.info("Stopped by %s after step %d; checkpoint saved. Resume with checkpoint.resume=auto.",
                        stop.name or "a signal to another rank", state.step)
            # The launcher SIGTERMs the other ranks once one exits: leave together, after rank 0's plot.
            accelerator.wait_for_everyone()
            raise SystemExit(EXIT_PREEMPTED)
        if run.stops_early(state):
            logger.info("Early stopping at step %d: %d evaluations without improvement (best val_loss %.4f).",
                        state.step, state.evals_without_improvement, state.best_val_loss)
            break

    checkpointer.wait()  # a background write in flight (early stopping)
    source = export_source(run, checkpointer)
    export = maybe_export(run, source, out_dir)
    if export is not None:
        logger.info("Exported %s from %s", export, source)
    reporter.close(plot=True)
    if accelerator.is_main_process:
        write_run_end(out_dir, run_outcome(run, state, source, export), cfg.logging.cost_per_device_hour)
    accelerator.end_training()
    return state


def run_outcome(run: Run, state: TrainState, export_from: Path | None, export: Path | None) -> dict:
    """How the run ended, for ``final.json`` and ``run_meta.json``."""
    return {"step": state.step, "tokens_seen": state.tokens_seen, "stopped_early": state.step < run.cfg.train.max_steps,
            "best_val_loss": state.best_val_loss, "last_val_loss": state.last_val_loss,
            "last_val_loss_ema": state.last_val_loss_ema,
            "evals_without_improvement": state.evals_without_improvement, "wall_time_s": state.wall_time_s,
            "rollbacks": state.rollbacks, "skipped_batches": len(state.skipped_batches),
            "export": str(export) if export else None, "export_from": str(export_from) if export_from else None,
            "export_weights": run.cfg.checkpoint.export_weights if export else None}
