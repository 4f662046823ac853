"""The training loop: ``train_step``, then log, evaluate and save, with the loop's features' hooks in between.

``train`` takes the run folder's lock, builds the run and runs :func:`train_loop` to ``train.max_steps``.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import numpy as np
import torch

from lmrecipe.checkpoint.policy import Checkpointer
from lmrecipe.checkpoint.storage import PROBE_TOKENS
from lmrecipe.config import Config, due_at, save_config
from lmrecipe.errors import fail
from lmrecipe.fileio import removing_new_empty_dirs
from lmrecipe.loss import chunked_head, validation_loss
from lmrecipe.observe.console import Reporter
from lmrecipe.observe.profiler import StepProfiler
from lmrecipe.observe.run_report import write_run_end
from lmrecipe.plan import predict_run
from lmrecipe.train.features import EarlyStopping, Features, NonFiniteStop, Stop
from lmrecipe.train.faults import maybe_install_faults
from lmrecipe.train.lock import RunLock
from lmrecipe.train.oom import OOMGuard
from lmrecipe.train.preemption import PreemptionSignal, lost_peer_error, peer_processes
from lmrecipe.train.setup import Run, build_run
from lmrecipe.train.spikes import SpikeGuard
from lmrecipe.train.state import TrainState
from lmrecipe.train.step import train_step
from lmrecipe.train.task_eval import TaskEval

logger = logging.getLogger(__name__)

def eval_due(cfg: Config, step: int) -> bool:
    return due_at(step, cfg.train.eval_every_steps, cfg.train.max_steps)


def evaluate(run: Run, state: TrainState, reporter: Reporter, features: Features) -> None:
    """The validation loss (per source of a mixture), with the features' figures (the weight EMA's loss, the
    multiple-choice tasks' accuracy), then the features' ``after_eval``."""

    def losses() -> dict[str, float]:
        return {name: validation_loss(run.model, batches, run.accelerator, run.attention) for name, batches in run.data.val_sets.items()}

    extra = features.eval_metrics(lambda: run.data.val_loss(losses()))
    per_source = losses()
    val_loss = run.data.val_loss(per_source)
    best_before = state.best_val_loss
    state.record_eval(val_loss)
    state.last_val_loss_ema = extra.pop("val_loss_ema", None)
    features.after_eval(state, val_loss, best_before)
    reporter.eval_done(state, val_loss, per_source if run.data.is_mixture else None, val_loss_ema=state.last_val_loss_ema,
                       figures=extra)


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

    from lmrecipe.export import export_checkpoint

    # Training is over: detach transformers from the live ZeRO-3 config, or building the export's model would
    # enter zero.Init and wait for the other ranks, which have left.
    unset_hf_deepspeed_config()
    return export_checkpoint(checkpoint, out_dir / "export", dtype=section.export_dtype,
                             max_shard_size=section.max_shard_size, overwrite=True, weights=section.export_weights)


def build_features(run: Run, out_dir: Path) -> Features:
    """The loop's features, in the order their hooks run (``lmrecipe/train/features.py``)."""
    cfg = run.cfg
    spikes = SpikeGuard(cfg.spike, run.accelerator, out_dir, batches=run.train_batches, prefetcher=run.prefetcher,
                        precision=run.runtime.precision)
    spikes.warn_if_nothing_to_roll_back(cfg.checkpoint.every_steps)
    ema = [run.ema] if run.ema is not None else []
    tasks = [TaskEval(cfg, run.model, run.accelerator, run.data.tokenizer_dir, run.attention)] if cfg.eval.tasks else []
    return Features([spikes, NonFiniteStop(cfg.train.max_consecutive_skips), *ema, *tasks, EarlyStopping(cfg.train)])


def build_checkpointer(run: Run, out_dir: Path, features: Features | None = None) -> Checkpointer:
    features = features or build_features(run, out_dir)
    return Checkpointer(run.cfg, run.accelerator, out_dir, zero=run.runtime.zero, data=run.data,
                        lr_schedule=run.lr_at, extras=features.extras(),
                        next_sample=features.get(SpikeGuard).next_sample, probe_kwargs=probe_kwargs(run))


def probe_kwargs(run: Run):
    """The document keywords of the checkpoints' probe forward (the first tokens of the first validation window)."""
    if run.attention is None:
        return None
    windows = next(iter(run.data.val_sets.values())).windows
    documents = windows.documents_at(np.zeros(1, dtype=np.int64), PROBE_TOKENS).as_tensors()
    return functools.partial(run.attention.forward_kwargs, documents)


def build_reporter(run: Run, out_dir: Path, start_step: int, run_meta: dict) -> Reporter:
    cfg, runtime = run.cfg, run.runtime
    return Reporter(cfg.logging, run.accelerator, out_dir, precision=runtime.precision, max_steps=cfg.train.max_steps,
                    start_step=start_step, tokens_per_step=run.tokens_per_step, flops_per_token=run.flops_per_token,
                    run_config=cfg.to_dict(), source_tokens=run.data.tokens_seen, run_meta={
                        "n_params": run.n_params, "flops_per_token": run.flops_per_token,
                        "accum_steps": runtime.layout.accum_steps, "deepspeed_config": runtime.ds_config,
                        "n_train_windows": run.data.n_train_windows,
                        **({"data_mixture": run.data.mixture_signature()} if run.data.is_mixture else {}), **run_meta})


def train(cfg: Config, recipe: str | None = None) -> TrainState:
    """Train ``cfg`` to ``train.max_steps`` (resuming as ``checkpoint.resume`` says); one run per ``out_dir``.

    ``recipe``: the recipe file ``cfg`` was loaded from, which the run report compares the configuration with.
    """
    out_dir = Path(cfg.out_dir)
    with removing_new_empty_dirs(out_dir, out_dir / "checkpoints"):  # a failed start leaves no empty folders
        run = build_run(cfg, out_dir)
        lock = RunLock(out_dir)
        if run.accelerator.is_main_process:
            lock.acquire()  # before anything in out_dir is cleaned up or written
        run.accelerator.wait_for_everyone()
        peers, stop = peer_processes(run.accelerator), PreemptionSignal()
        try:
            return train_loop(run, out_dir, recipe, stop)
        except RuntimeError as err:
            lost = lost_peer_error(err, peers, out_dir / "checkpoints")
            if lost is None:
                raise
            raise lost from None
        finally:
            stop.close()
            run.prefetcher.close()
            lock.release()


def train_loop(run: Run, out_dir: Path, recipe: str | None = None, stop: PreemptionSignal | None = None) -> TrainState:
    cfg, accelerator = run.cfg, run.accelerator
    features = build_features(run, out_dir)
    checkpointer = build_checkpointer(run, out_dir, features)
    state = TrainState()
    resumed_from = checkpointer.maybe_resume(run.model, run.optimizer, state)  # restores the features' state too
    if accelerator.is_main_process:
        save_config(cfg, out_dir / "config.yaml")
    reporter = build_reporter(run, out_dir, state.step, {"resumed_from": resumed_from, "recipe": recipe})
    log_start(run)
    stop = stop or PreemptionSignal()
    profiler = StepProfiler(cfg.profile, out_dir, rank=accelerator.process_index, is_main=accelerator.is_main_process,
                            barrier=accelerator.wait_for_everyone)
    oom = OOMGuard(cfg, run.runtime, run.model)
    maybe_install_faults(accelerator.unwrap_model(run.model), run.train_batches, oom.current_step)
    features.get(SpikeGuard).connect(checkpointer, reporter)
    while state.step < cfg.train.max_steps:
        step_start = time.perf_counter()
        with profiler.step(state.step + 1), oom.step(state.step + 1):
            result = train_step(run, state.step)
        state.record_step(result.skipped, run.tokens_per_step)
        features.after_step(state, result)
        # Host reads happen only at sync points: a logged, evaluated or saved step.
        sync_point = reporter.should_log(state.step) or eval_due(cfg, state.step) or checkpointer.due(state.step)
        if sync_point and features.at_sync(state, longest_skip_run=state.sync()):
            continue  # a feature moved the run back (a spike's rollback): go on from state.step
        if state.step == 1 and cfg.train.compile:
            logger.info("Step 1 took %.1f s, torch.compile's compilation included", time.perf_counter() - step_start)
        reporter.step_done(state, result.loss, result.lr, result.grad_norm, time.perf_counter() - step_start,
                           result.data_time_s)
        if eval_due(cfg, state.step):
            evaluate(run, state, reporter, features)
        preempted = stop.requested(accelerator, exchange=sync_point)
        if preempted:
            state.sync()  # the checkpoint records the skip counters
        checkpointer.maybe_save(run.model, state, preempted=preempted)
        if preempted:
            exit_preempted(accelerator, reporter, stop.name, state.step, stop.exit_code)
        if (reason := features.stop_reason(state)) is not None:
            stop_early(reason, reporter)
            break
    finish(run, state, checkpointer, reporter, features, out_dir)
    return state


def log_start(run: Run) -> None:
    cfg, layout, sequence = run.cfg, run.runtime.layout, run.runtime.sequence
    tp = run.runtime.tensor_parallel_size
    ranks = f"{layout.world_size} processes"
    if sequence is not None:
        ranks = f"{layout.world_size} data-parallel groups of {sequence.size} ranks sharing each sequence"
    elif tp > 1:
        ranks = f"{layout.world_size} data-parallel groups of {tp} ranks splitting each matrix (AutoTP)"
    logger.info(
        "model %.2fM params | %s x micro-batch %d x accumulation %d = %d sequences of %d tokens | precision %s | %s%s",
        run.n_params / 1e6, ranks, layout.micro_batch_size, layout.accum_steps, layout.global_batch_size,
        cfg.data.seq_len, run.runtime.precision, run.runtime.zero.describe(),
        "" if (head := chunked_head(run.model)) is None else f" | loss in chunks of {head.chunk_tokens} tokens",
    )
    if cfg.schedule.warmup_steps > cfg.train.max_steps:
        # Allowed (a short smoke run of a long recipe), but the schedule never reaches its peak: say so.
        logger.warning("schedule.warmup_steps=%d exceeds train.max_steps=%d: the learning rate stops at %.3g, below "
                       "optim.lr=%.3g.", cfg.schedule.warmup_steps, cfg.train.max_steps,
                       run.lr_at(cfg.train.max_steps - 1), cfg.optim.lr)


def stop_early(reason: Stop, reporter: Reporter) -> None:
    """A feature ended the run: an error exits with code 2 (after the plot), a clean stop goes on to the export."""
    if reason.error:
        reporter.close(plot=True)
        raise fail(reason.message)
    logger.info("%s", reason.message)


def exit_preempted(accelerator, reporter: Reporter, signal_name: str | None, step: int, code: int) -> None:
    reporter.close(plot=True)
    logger.info("Stopped by %s after step %d; checkpoint saved. Resume with checkpoint.resume=auto.",
                signal_name or "a signal to another rank", step)
    # The launcher SIGTERMs the other ranks once one exits: leave together, after rank 0's plot.
    accelerator.wait_for_everyone()
    raise SystemExit(code)


def finish(run: Run, state: TrainState, checkpointer: Checkpointer, reporter: Reporter, features: Features,
           out_dir: Path) -> None:
    """After the last step: wait for a background write, export, close the logs, write the run's end."""
    checkpointer.wait()  # a background write in flight (early stopping)
    source = export_source(run, checkpointer)
    export = maybe_export(run, source, out_dir)
    if export is not None:
        logger.info("Exported %s from %s", export, source)
    reporter.close(plot=True)
    if run.accelerator.is_main_process:
        write_run_end(out_dir, run_outcome(run, state, features, source, export), run.cfg.logging.cost_per_device_hour,
                      run_prediction(run, reporter.peak_tflops, out_dir))
    # Tear the process group down together: a rank that destroys its side while another still holds the group
    # open has been seen to abort at exit (SIGABRT, "terminate called without an active exception").
    run.accelerator.wait_for_everyone()
    run.accelerator.end_training()


def run_prediction(run: Run, peak_tflops: float, out_dir: Path) -> dict:
    """The planner's figures at this run's configuration, for the report (main process, after training)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # Training is over: detach transformers from a live ZeRO-3 config, or building the shape on the meta device
    # would enter zero.Init and wait for the other ranks.
    unset_hf_deepspeed_config()
    accelerator, runtime = run.accelerator, run.runtime
    device = accelerator.device
    return predict_run(run.cfg, accelerator.unwrap_model(run.model).config, world_size=accelerator.num_processes,
                       precision=runtime.precision, zero=runtime.zero, accum_steps=runtime.layout.accum_steps,
                       flops_per_token=run.flops_per_token, peak_tflops=peak_tflops,
                       device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None, out_dir=out_dir)


def run_outcome(run: Run, state: TrainState, features: Features, export_from: Path | None,
                export: Path | None) -> dict:
    """How the run ended, for ``final.json`` and ``run_meta.json``."""
    return {"step": state.step, "tokens_seen": state.tokens_seen, "stopped_early": state.step < run.cfg.train.max_steps,
            "best_val_loss": state.best_val_loss, "last_val_loss": state.last_val_loss,
            "last_val_loss_ema": state.last_val_loss_ema,
            "evals_without_improvement": features.get(EarlyStopping).evals_without_improvement,
            "wall_time_s": state.wall_time_s, "rollbacks": features.get(SpikeGuard).rollbacks,
            "skipped_batches": len(features.get(SpikeGuard).skipped_batches),
            "export": str(export) if export else None, "export_from": str(export_from) if export_from else None,
            "export_weights": run.cfg.checkpoint.export_weights if export else None}
