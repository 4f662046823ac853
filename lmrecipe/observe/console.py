"""What a person sees during a run: progress bar, log lines, metrics rows, the final plot.

The reporting callback (``lmrecipe/train/callbacks/reporting.py``) calls ``step_done`` every optimizer step and
``eval_done`` after an evaluation; the log interval, the main-process check and the averaging over the interval
live here, not in the loop.

A row's time is the interval's *time in training steps*: the sum of the trainer's step times (data wait, forward,
backward, optimizer, the sync point; compilation inside step 1), from the first step after the previous row to the
logged step. Evaluation, checkpoint writes and logging, which run between steps, are not in it. So
``tokens_per_sec = the interval's tokens (the steps' actual sizes, a batch-size ramp's included) / interval_time_s``
and ``step_time_s = interval_time_s / interval_steps`` for every row, the first included, and the run's throughput
is the sum of the rows' tokens over the sum of their ``interval_time_s`` (:func:`lmrecipe.observe.metrics_log.throughput`).
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from lmrecipe.config import LoggingConfig, due_at
from lmrecipe.observe import device as device_stats
from lmrecipe.observe.metrics_log import MetricsLog, read_metrics, throughput
from lmrecipe.observe.run_meta import read_run_meta, run_events, run_metadata, write_run_meta
from lmrecipe.observe.stragglers import StragglerDetector

logger = logging.getLogger(__name__)

def log_due(section: LoggingConfig, step: int, max_steps: int) -> bool:
    """Whether optimizer step ``step`` (1-based) writes a metrics row: the first, every ``log_every_steps``, the last."""
    return step == 1 or due_at(step, section.log_every_steps, max_steps)


def read_figures(figures: dict) -> dict[str, float]:
    """Device figures by name as floats, in one host read."""
    if not figures:
        return {}
    values = torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in figures.values()]).tolist()
    return dict(zip(figures, values))


def load_balance(expert_tokens: torch.Tensor) -> dict[str, float]:
    """Each MoE layer's load balance from the tokens each of its experts received (``[layers, experts]``): the busiest
    expert's count over the mean count, ``load_balance/layer{i}`` (1 = even; ``num_experts`` = one expert takes all)."""
    ratio = expert_tokens.amax(dim=1) / expert_tokens.mean(dim=1).clamp_min(1e-12)
    return {f"load_balance/layer{i}": value for i, value in enumerate(ratio.tolist())}


class Reporter:
    def __init__(self, section: LoggingConfig, accelerator, out_dir: Path, *, precision: str, max_steps: int,
                 start_step: int, tokens_per_step: int | Callable[[int], int], flops_per_token: float, run_config: dict,
                 run_meta: dict,
                 launch: dict | None = None, source_tokens: Callable[[int], dict[str, int]] | None = None,
                 stragglers: StragglerDetector | None = None):
        """
        Args:
            section: the recipe's ``logging`` section (interval, trackers, progress bar, peak TFLOP/s).
            max_steps: the last step (always logged; the progress bar's total).
            tokens_per_step: tokens of one optimizer step over all ranks, or step (1-based) -> its tokens (a
                batch-size ramp).
            run_config: the resolved configuration (``run_meta.json`` and the tracker's config).
            run_meta: further facts for ``run_meta.json`` (parameters, topology, resume).
            launch: this session's entry of ``run_meta.json``'s ``launches`` (``run_meta.launch_record``).
            source_tokens: step -> ``{"tokens_seen/<name>": tokens}`` of a data mixture, added to every row.
            stragglers: names a rank that stays slower than the others (``lmrecipe/observe/stragglers.py``); None: the
                ranks' compute times are not compared.
        """
        self.stragglers = stragglers
        self.section = section
        self.accelerator = accelerator
        self.out_dir = out_dir
        self.max_steps = max_steps
        self.is_main = accelerator.is_main_process
        self.flops_per_token = flops_per_token
        self.tokens_of_step = tokens_per_step if callable(tokens_per_step) else (lambda step: tokens_per_step)
        self.source_tokens = source_tokens or (lambda step: {})
        self.peak_tflops, peak_source = device_stats.device_peak_tflops(accelerator.device, precision, section.peak_tflops)
        if self.is_main:
            meta = run_metadata(run_config, accelerator.num_processes, precision,
                                {**run_meta, "peak_tflops_per_device": self.peak_tflops, "peak_tflops_source": peak_source})
            # What is resident before the first step (interpreter, libraries, model, data index): on a CPU, the part
            # of the measured peak memory that the planner's estimate does not model.
            launch = {**(launch or {}), "host_rss_gb_before_training": device_stats.host_rss_gb()}
            write_run_meta(out_dir, meta, launch)
        self.tracker = MetricsLog(out_dir, section.trackers, section.project, section.run_name or out_dir.name,
                                  run_config, enabled=self.is_main, start_step=start_step)
        self.bar = tqdm(total=max_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not (self.is_main and section.progress_bar and sys.stderr.isatty()))
        self._reset_interval()

    def _reset_interval(self) -> None:
        """Start a log interval: its step count and times, and (GPU) the allocator's peak, so each row holds its own."""
        device_stats.reset_peak_memory(self.accelerator.device)
        self._interval_steps = 0
        self._interval_tokens = 0
        self._interval_step_time_s = 0.0
        self._interval_data_time_s = 0.0
        self._skipped_at_interval_start: int | None = None

    def should_log(self, step: int) -> bool:
        return log_due(self.section, step, self.max_steps)

    def step_done(self, state, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor | float,
                  step_time_s: float, data_time_s: float, z_loss: torch.Tensor | None = None,
                  figures: dict | None = None, aux_loss: torch.Tensor | None = None,
                  expert_tokens: torch.Tensor | None = None, rank_compute_s: torch.Tensor | None = None) -> None:
        """Count the step; at a log step read the loss and grad norm (their only host reads) and write a row.

        ``z_loss``, ``aux_loss``: this rank's z-loss and router load-balancing terms (averaged over ranks like the
        loss, logged apart from it; None: off). ``figures``: further figures by name, on the device and already
        combined over ranks (read together, in one host read). ``expert_tokens``: the tokens this rank routed to each
        expert of each MoE layer in the step, ``[layers, experts]``, summed over ranks into each layer's load balance
        ``load_balance/layer{i}`` (the busiest expert's tokens over the mean; 1 = even). ``rank_compute_s``: this
        rank's forward seconds over the interval at its place of a ``[world_size]`` vector (the straggler instrument),
        carried in the loss's reduction and read by the reporter's ``stragglers`` detector.

        The loop syncs ``state`` (skip counters) at every log step before calling this.
        """
        self.bar.update(1)
        self._interval_steps += 1
        self._interval_tokens += self.tokens_of_step(state.step)
        self._interval_step_time_s += step_time_s
        self._interval_data_time_s += data_time_s
        if self._skipped_at_interval_start is None:
            self._skipped_at_interval_start = state.skipped_steps
        if not self.should_log(state.step):
            return
        interval_skips = state.skipped_steps - self._skipped_at_interval_start
        grad_norm = float(grad_norm)
        loss_value, extra = self._reduce(state.step, loss, z_loss, aux_loss, rank_compute_s)
        extra.update(read_figures(figures or {}))
        if expert_tokens is not None:
            extra.update(load_balance(self.accelerator.reduce(expert_tokens.float(), reduction="sum")))
        interval_time_s = self._interval_step_time_s
        tokens_per_sec = self._interval_tokens / max(interval_time_s, 1e-12)
        row = {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            **self.source_tokens(state.step),
            "loss": loss_value,
            **extra,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_sec": tokens_per_sec,
            "mfu": device_stats.mfu(tokens_per_sec, self.flops_per_token, self.accelerator.num_processes, self.peak_tflops),
            "step_time_s": self._interval_step_time_s / self._interval_steps,
            "data_time_s": self._interval_data_time_s / self._interval_steps,
            "interval_steps": self._interval_steps,
            "interval_time_s": interval_time_s,
            "peak_mem_gb": device_stats.peak_memory_gb(self.accelerator.device),
            "host_rss_gb": device_stats.host_rss_gb(),
            "skipped_steps": state.skipped_steps,
            **device_stats.device_utilisation(self.accelerator.device),
        }
        self.tracker.log(row)
        self.bar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{tokens_per_sec:,.0f}")
        if self.is_main:
            self.bar.write(
                f"step {state.step:>6}/{self.max_steps} | loss {loss_value:.4f} | lr {lr:.2e} | "
                f"grad_norm {grad_norm:.3f} | {tokens_per_sec:,.0f} tok/s | mfu {100 * row['mfu']:.1f}% | "
                f"step {row['step_time_s']:.3f}s (data {100 * row['data_time_s'] / max(row['step_time_s'], 1e-12):.1f}%) | "
                f"mem {row['peak_mem_gb']:.2f} GB" + (f" | skipped {interval_skips}" if interval_skips else "")
            )
        self._reset_interval()

    def _reduce(self, step: int, loss: torch.Tensor, z_loss: torch.Tensor | None, aux_loss: torch.Tensor | None,
                rank_compute_s: torch.Tensor | None) -> tuple[float, dict]:
        """One collective per log interval (also a device sync point): the loss and its terms averaged over ranks, and
        every rank's compute time (each rank fills its own place of the vector) with the straggler figures."""
        terms = {name: term for name, term in (("z_loss", z_loss), ("aux_loss", aux_loss)) if term is not None}
        parts = [t.detach().float().reshape(1) for t in (loss, *terms.values())]
        if rank_compute_s is not None:  # a mean over ranks of one-hot vectors: times the world size, each rank's own
            parts.append(rank_compute_s.to(loss.device, torch.float32) * self.accelerator.num_processes)
        values = self.accelerator.reduce(torch.cat(parts), reduction="mean").tolist()
        extra = dict(zip(terms, values[1:1 + len(terms)]))
        if rank_compute_s is not None and self.stragglers is not None:
            per_step = [seconds / self._interval_steps for seconds in values[1 + len(terms):]]
            extra.update(self.stragglers.observe(step, per_step))
        return values[0], extra

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (a rollback): drop later metrics rows and restart the interval averages."""
        self.tracker.rewind(step)
        if self.stragglers is not None:
            self.stragglers.reset()
        self.bar.n = step
        self.bar.refresh()
        self._reset_interval()

    def eval_done(self, state, val_loss: float, per_source: dict[str, float] | None = None,
                  figures: dict[str, float] | None = None) -> None:
        """Write an evaluation row; ``per_source`` (a mixture) adds ``val_loss/<name>`` for each source, and
        ``figures`` further figures of the evaluation as they are named (the weight EMA's ``val_loss_ema``, the tasks'
        ``acc/<task>``, ...)."""
        val_ppl = math.exp(val_loss) if val_loss < 50 else float("inf")
        extra = {f"val_loss/{name}": loss for name, loss in (per_source or {}).items()}
        extra.update(figures or {})
        self.tracker.log({"step": state.step, "tokens_seen": state.tokens_seen, "val_loss": val_loss, "val_ppl": val_ppl,
                          **extra})
        if self.is_main:
            self.bar.write(f"step {state.step:>6}/{self.max_steps} | val_loss {val_loss:.4f} | val_ppl {val_ppl:.2f}"
                           + "".join(f" | {key} {value:.4f}" for key, value in extra.items()
                                     if not key.startswith("chance/")))

    def close(self, plot: bool) -> None:
        """Close the logs; with ``plot``, draw ``training.png``: its title, the run's events, its throughput."""
        self.bar.close()
        self.tracker.close()
        if plot and self.is_main:
            rows = read_metrics(self.out_dir / "metrics.jsonl")
            if rows:
                meta = read_run_meta(self.out_dir)
                tokens = max((r["tokens_seen"] for r in rows if "tokens_seen" in r), default=0)
                params = f"{meta['n_params'] / 1e6:,.2f}M parameters, " if meta.get("n_params") else ""
                title = f"{self.section.run_name or self.out_dir.name}: {params}{tokens:,} tokens trained"
                try:  # matplotlib loads when a plot is drawn: a node without it (a GPU kit's) still trains
                    from lmrecipe.observe.plots import plot_training
                except ImportError as err:
                    logger.warning("training.png not drawn: %s (pip install matplotlib)", err)
                    return
                plot_training(rows, self.out_dir / "training.png", title=title, events=run_events(meta),
                              run_tokens_per_sec=throughput([r for r in rows if "loss" in r])["tokens_per_sec"])
