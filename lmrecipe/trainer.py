"""The training loop: accumulate / forward / backward / step, then maybe log, maybe eval, maybe save."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import checkpoint as ckpt
from .config import Config, save_config
from .data import BatchLayout, TrainBatches, ValBatches, load_meta, open_data
from .distributed import build_accelerator, offloads_optimizer, zero_stage
from .errors import fail
from .memory import attach_model_state_probe
from .model import build_hf_config, build_model, flops_per_token, param_counts
from .optim import build_optimizer, lr_at, set_lr
from .reporting import Reporter

logger = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything besides weights and optimizer state that a resume needs; saved as JSON in each checkpoint."""

    step: int = 0
    """Optimizer steps completed (the next step to run)."""
    tokens_seen: int = 0
    """Training tokens consumed over all ranks."""
    best_val_loss: float | None = None
    skipped_steps: int = 0
    """Updates skipped for a non-finite loss or gradient norm, over the run."""
    consecutive_skips: int = 0
    last_val_loss: float | None = None
    last_val_step: int | None = None
    """Step of the latest evaluation (a checkpoint saved at that step is ranked by its loss)."""

    def record_eval(self, val_loss: float) -> None:
        self.last_val_loss, self.last_val_step = val_loss, self.step
        self.best_val_loss = val_loss if self.best_val_loss is None else min(self.best_val_loss, val_loss)


def causal_lm_loss(model, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in fp32 (targets are the inputs shifted by one, so no token is dropped)."""
    logits = model(input_ids=inputs).logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction=reduction)
    return loss if reduction == "mean" else loss.view(targets.shape)


@torch.no_grad()
def evaluate(model, val_batches: ValBatches, accelerator) -> float:
    """Mean validation loss over the fixed windows, identical for any split over ranks."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for inputs, targets, valid in val_batches:
        per_token = causal_lm_loss(model, inputs.to(accelerator.device), targets.to(accelerator.device), "none")
        total[0] += (per_token.sum(dim=1).double() * valid.to(accelerator.device)).sum()
        total[1] += valid.sum() * targets.shape[1]
    total = accelerator.reduce(total, reduction="sum")
    model.train(was_training)
    return (total[0] / total[1]).item()


def _optimizer_step(model, optimizer, accelerator, grad_clip: float, uses_deepspeed: bool) -> tuple[float, bool]:
    """Clip and step (or skip a non-finite update). Returns the pre-clip global grad norm and whether it skipped."""
    if uses_deepspeed:
        # The engine already clipped and stepped inside accelerator.backward at the accumulation boundary,
        # and skips the update itself when gradients are not finite.
        skipped_before = model.skipped_steps
        norm = model.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, model.skipped_steps > skipped_before or not math.isfinite(norm)
    norm = float(accelerator.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf")))
    if accelerator.scaler is not None:
        # fp16: the GradScaler must see every step, so it can skip an overflow and lower the scale.
        optimizer.step()
        skipped = optimizer.step_was_skipped
    else:
        skipped = not math.isfinite(norm)
        if not skipped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


def train(cfg: Config) -> TrainState:
    out_dir = Path(cfg.out_dir)
    accelerator, ds_config, precision = build_accelerator(cfg)
    uses_deepspeed = ds_config is not None
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()

    meta = load_meta(cfg.data.path)
    hf_config = build_hf_config(cfg, cfg.model.vocab_size or int(meta["vocab_size"]))
    _, train_windows, val_windows = open_data(cfg.data.path, cfg.data.seq_len, hf_config.vocab_size)
    if cfg.data.seq_len > hf_config.max_position_embeddings:
        raise fail(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's max_position_embeddings="
            f"{hf_config.max_position_embeddings}. Lower data.seq_len or raise model.max_position_embeddings."
        )
    if zero_stage(ds_config) == 3 and cfg.train.gradient_checkpointing and not cfg.train.checkpointing_reentrant:
        logger.warning("ZeRO-3 with non-reentrant activation checkpointing is known to fail; reentrant is the workaround.")

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg, hf_config)
    counts = param_counts(model)
    fpt = flops_per_token(counts["total"], counts["lookup"], hf_config.num_hidden_layers, hf_config.hidden_size, cfg.data.seq_len)
    if cfg.train.compile:
        model = torch.compile(model)
    optimizer = build_optimizer(model, cfg.optim, cpu_offload=offloads_optimizer(ds_config))
    model, optimizer = accelerator.prepare(model, optimizer)
    model.train()
    attach_model_state_probe(model, optimizer, out_dir, accelerator.process_index, accelerator.num_processes)

    layout = BatchLayout(cfg.train.global_batch_size, cfg.train.micro_batch_size, accelerator.num_processes, accelerator.process_index)
    train_batches = TrainBatches(train_windows, layout, cfg.train.seed)
    val_batches = ValBatches(val_windows, cfg.data.val_windows, cfg.train.micro_batch_size, layout.world_size, layout.rank)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len

    checkpointer = ckpt.Checkpointer(cfg, accelerator, out_dir)
    state = TrainState()
    resumed_from = checkpointer.maybe_resume(model, state)
    if accelerator.is_main_process:
        save_config(cfg, out_dir / "config.yaml")
    reporter = Reporter(
        cfg, accelerator, out_dir, precision, start_step=state.step,
        flops_per_token=fpt, n_params=counts["total"], extra_meta={
            "n_params": counts["total"], "flops_per_token": fpt, "accum_steps": layout.accum_steps,
            "deepspeed_config": ds_config, "resumed_from": resumed_from, "n_train_windows": len(train_windows),
        },
    )
    logger.info(
        "model %.2fM params | %d processes x micro-batch %d x accumulation %d = %d sequences of %d tokens | precision %s | %s",
        counts["total"] / 1e6, layout.world_size, layout.micro_batch_size, layout.accum_steps,
        cfg.train.global_batch_size, cfg.data.seq_len, precision,
        f"DeepSpeed ZeRO-{zero_stage(ds_config)}" if uses_deepspeed else "no DeepSpeed",
    )

    stop = ckpt.PreemptionSignal()
    while state.step < cfg.train.max_steps:
        lr = lr_at(state.step, cfg.train.max_steps, cfg.optim, cfg.schedule)
        set_lr(optimizer, lr)
        step_start = time.perf_counter()
        data_time_s = 0.0
        loss_sum = torch.zeros((), device=accelerator.device)
        batches = train_batches.micro_batches(state.step)
        for _ in range(layout.accum_steps):
            fetch_start = time.perf_counter()
            inputs, targets = next(batches)
            inputs, targets = inputs.to(accelerator.device, non_blocking=True), targets.to(accelerator.device, non_blocking=True)
            data_time_s += time.perf_counter() - fetch_start
            with accelerator.accumulate(model):
                loss = causal_lm_loss(model, inputs, targets)
                accelerator.backward(loss)
            loss_sum += loss.detach()
        grad_norm, skipped = _optimizer_step(model, optimizer, accelerator, cfg.optim.grad_clip, uses_deepspeed)

        state.step += 1
        state.tokens_seen += tokens_per_step
        state.skipped_steps += int(skipped)
        state.consecutive_skips = state.consecutive_skips + 1 if skipped else 0
        reporter.step_done(state, loss_sum / layout.accum_steps, lr, grad_norm, skipped, time.perf_counter() - step_start, data_time_s)
        if state.consecutive_skips >= cfg.train.max_consecutive_skips:
            reporter.close(plot=True)
            raise fail(
                f"Stopped at step {state.step}: {state.consecutive_skips} consecutive updates were skipped because the "
                "loss or gradient norm was not finite. Try a lower optim.lr, a longer schedule.warmup_steps, "
                "optim.grad_clip=1.0, or train.precision=bf16/fp32 instead of fp16, and resume from the last "
                "checkpoint (checkpoint.resume=auto)."
            )
        if reporter.should_eval(state.step):
            val_loss = evaluate(model, val_batches, accelerator)
            state.record_eval(val_loss)
            reporter.eval_done(state, val_loss)
        preempted = stop.requested(accelerator)
        checkpointer.maybe_save(model, state, preempted=preempted)
        if preempted:
            reporter.close(plot=True)
            logger.info("Stopped by %s after step %d; checkpoint saved. Resume with checkpoint.resume=auto.",
                        stop.name or "a signal to another rank", state.step)
            # The launcher SIGTERMs the other ranks once one exits: leave together, after rank 0's plot.
            accelerator.wait_for_everyone()
            raise SystemExit(ckpt.EXIT_PREEMPTED)

    checkpointer.maybe_export()
    reporter.close(plot=True)
    accelerator.end_training()
    return state

