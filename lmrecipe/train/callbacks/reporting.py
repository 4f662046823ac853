"""The run's records: ``config.yaml``, the start-up line, the live log, metrics and trackers, the plot, the report.

The components are ``lmrecipe/observe/``'s (the :class:`Reporter`, the run report); this callback calls them at
the loop's points.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from lmrecipe.config import save_config
from lmrecipe.model.attention import attention_record
from lmrecipe.model.kernels import resolve_kernels
from lmrecipe.model.loss import chunked_head
from lmrecipe.model.varlen import STAND_IN
from lmrecipe.observe.console import Reporter
from lmrecipe.observe.device import cpu_threads_line
from lmrecipe.observe.run_meta import launch_record, record_event
from lmrecipe.observe.run_report import write_run_end
from lmrecipe.observe.stragglers import StragglerDetector, rank_hosts
from lmrecipe.parallel.accelerator import unwrap_model
from lmrecipe.parallel.topology import startup_line
from lmrecipe.planning.prediction import predict_run
from lmrecipe.train.callback import Callback, EvalResult, Stop
from lmrecipe.train.setup import Run

logger = logging.getLogger(__name__)


class Reporting(Callback):
    """Opens the records once the run has resumed, logs every step that stands, writes every evaluation's row,
    rewinds the history on a rollback, and at the end closes the logs and writes ``final.json`` and ``report.md``
    (main process). ``command``: the script's command line, recorded in ``run_meta.json``'s ``launches``."""

    follows = ("Checkpointing", "ExportAtEnd", "RemoteUpload")  # the records open after the resume; the report says
    # what was exported and what was not uploaded

    def __init__(self, recipe: str | None = None, command: list[str] | None = None):
        self.recipe = recipe
        self.command = command
        self.reporter: Reporter | None = None
        self.closed = False

    def attach(self, trainer) -> None:
        self.run = trainer.run
        self.out_dir = trainer.out_dir

    def on_start(self, trainer) -> None:
        run = self.run
        if run.accelerator.is_main_process:
            save_config(run.cfg, self.out_dir / "config.yaml")
        launch = launch_record(self.command, run.accelerator.num_processes, trainer.state.step, trainer.resumed_from)
        attention = run_attention(run)
        kernels = resolve_kernels(run.cfg.model.kernels, unwrap_model(run.accelerator, run.model).config.model_type,
                                  run.cfg.model.is_moe())
        self.reporter = build_reporter(run, self.out_dir, trainer.state.step,
                                       {"resumed_from": trainer.resumed_from, "recipe": self.recipe,
                                        "branched_from": trainer.checkpointer.branched_from, "attention": attention,
                                        "kernels": kernels}, launch)
        log_start(run, attention, kernels)

    def needs_sync(self, trainer, step: int) -> bool:
        return self.reporter.should_log(step)

    def on_step_end(self, trainer, result) -> None:
        if trainer.state.step == 1 and self.run.cfg.train.compile:
            logger.info("Step 1 took %.1f s, torch.compile's compilation included", trainer.step_time_s)
        self.reporter.step_done(trainer.state, result.loss, result.lr, result.grad_norm, trainer.step_time_s,
                                result.data_time_s, result.z_loss, result.figures, result.aux_loss,
                                result.expert_tokens, result.rank_compute_s)

    def after_eval(self, trainer, result: EvalResult) -> None:
        figures = dict(result.figures)
        samples = figures.pop("samples", None)  # eval.samples' texts (train/validation.py): a row of their own
        self.reporter.eval_done(trainer.state, result.val_loss, result.per_source, figures=figures)
        if samples:
            self.reporter.tracker.log({"step": trainer.state.step, "samples": samples})

    def after_rollback(self, trainer) -> None:
        self.reporter.rewind(trainer.state.step)
        if self.run.accelerator.is_main_process:
            record_event(self.out_dir, {"kind": "rollback", "step": trainer.state.step})

    def on_stop(self, trainer, stop: Stop) -> None:
        if stop.error or stop.exit_code is not None:  # the run ends here: the record, the plot of what it trained
            if self.run.accelerator.is_main_process:
                record_event(self.out_dir, {"kind": "stop", "step": trainer.state.step, "preempted": stop.exit_code is not None,
                                            "exit_code": 2 if stop.error else stop.exit_code, "message": stop.message})
            self._close(plot=self.run.cfg.logging.plots)

    def on_end(self, trainer) -> None:
        self._close(plot=self.run.cfg.logging.plots)
        if self.run.accelerator.is_main_process:
            write_run_end(self.out_dir, trainer.outcome(), self.run.cfg.logging.cost_per_device_hour,
                          run_prediction(self.run, self.reporter.peak_tflops, self.out_dir))


    def on_close(self, trainer) -> None:
        self._close(plot=False)

    def _close(self, plot: bool) -> None:
        if self.reporter is not None and not self.closed:
            self.reporter.close(plot=plot)
            self.closed = True


def build_reporter(run: Run, out_dir: Path, start_step: int, run_meta: dict, launch: dict | None = None) -> Reporter:
    cfg, runtime = run.cfg, run.runtime
    return Reporter(cfg.logging, run.accelerator, out_dir, precision=runtime.precision, max_steps=cfg.train.max_steps,
                    start_step=start_step, tokens_per_step=run.step_tokens, flops_per_token=run.flops_per_token,
                    run_config=cfg.to_dict(), source_tokens=run.data.tokens_seen, launch=launch, run_meta={
                        "n_params": run.n_params, "flops_per_token": run.flops_per_token,
                        "accum_steps": runtime.batch.accum_steps, "deepspeed_config": runtime.ds_config,
                        "n_train_windows": run.data.n_train_windows,
                        **({"data_mixture": run.data.mixture_signature()} if run.data.is_mixture else {}), **run_meta},
                    stragglers=build_straggler_detector(run))


def build_straggler_detector(run: Run) -> StragglerDetector | None:
    """The detector of ``distributed.stragglers``, with every rank's host (a collective: every rank calls it)."""
    section = run.cfg.distributed
    if not section.stragglers:
        return None
    return StragglerDetector(section.straggler_margin, section.straggler_logged_steps,
                             rank_hosts(run.accelerator.num_processes))


def run_attention(run: Run) -> dict:
    """The run's attention kernel and SDPA backend (``attention_record``), for ``run_meta.json`` and the log."""
    cfg = run.cfg
    return attention_record(cfg.model.attn_implementation, cfg.data.document_masking,
                            unwrap_model(run.accelerator, run.model).config,
                            cfg.data.seq_len, run.runtime.precision, run.accelerator.device)


def log_start(run: Run, attention: dict, kernels: str) -> None:
    cfg, runtime = run.cfg, run.runtime
    head = chunked_head(run.model)
    logger.info("%s", startup_line(run.n_params, run.n_active_params, runtime.topology, runtime.batch, cfg.data.seq_len,
                                   runtime.precision, 0 if head is None else head.chunk_tokens))
    logger.info("attention: %s, kernel: %s, SDPA backend: %s; model.kernels=%s: %s", attention["implementation"],
                attention["kernel"], attention["sdpa_backend"] or "none", run.cfg.model.kernels, kernels)
    if attention["kernel"] == STAND_IN and run.accelerator.device.type == "cuda":  # correct, one SDPA per document
        logger.warning("model.attn_implementation=varlen runs its per-document stand-in on this GPU: torch's flash "
                       "variable-length kernel takes bf16/fp16 (train.precision=%s) from a torch built with flash "
                       "attention. Set train.precision=bf16, or model.attn_implementation=sdpa.", runtime.precision)
    if run.accelerator.is_main_process and run.accelerator.device.type == "cpu":  # the run's line, said once
        logger.info("%s", cpu_threads_line(runtime.topology.world_size))



def run_prediction(run: Run, peak_tflops: float, out_dir: Path) -> dict:
    """The planner's figures at this run's configuration, for the report (main process, after training)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # Training is over: detach transformers from a live ZeRO-3 config, or building the shape on the meta device
    # would enter zero.Init and wait for the other ranks.
    unset_hf_deepspeed_config()
    accelerator, runtime = run.accelerator, run.runtime
    device = accelerator.device
    return predict_run(run.cfg.workload(), unwrap_model(accelerator, run.model).config, topology=runtime.topology,
                       precision=runtime.precision, accum_steps=runtime.batch.accum_steps,
                       flops_per_token=run.flops_per_token, peak_tflops=peak_tflops,
                       device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else None, out_dir=out_dir)
