"""Out-of-memory diagnosis: an OOM during a step ends the run with one message that says what to change.

A ``torch.OutOfMemoryError`` (device memory) or a ``MemoryError`` (host memory, e.g. under offload) in a step becomes a :class:`UserError` (exit 2) naming the step, the
micro-batch, the estimate of :mod:`lmrecipe.planning.memory` for this configuration next to the capacity (the GPU's total
memory, or the host's RAM), and the ways out in order, each with its own estimate. Nothing is saved: the error
leaves the loop before the step's checkpoint, so no partial checkpoint is written.

Fault injection for tests: ``LMRECIPE_FAULT_OOM_AT_STEP=N`` (read once, when the run starts) makes the
model's forward raise ``torch.OutOfMemoryError`` during optimizer step N (1-based), as a real OOM would
(``lmrecipe/train/callbacks/faults.py``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from lmrecipe.config import AUTO_LOSS_CHUNK_TOKENS
from lmrecipe.parallel.accelerator import unwrap_model
from lmrecipe.parallel.topology import ZeroSetup
from lmrecipe.errors import UserError, fail
from lmrecipe.planning.memory import estimate_run, format_bytes, model_shape
from lmrecipe.train.callback import Callback

logger = logging.getLogger(__name__)


class OOMDiagnosis(Callback):
    """An out-of-memory error inside a step (``trainer.running_step`` set) becomes the diagnosis of the module
    docstring; every other error passes through."""

    def attach(self, trainer) -> None:
        """What the diagnosis reads of the run: its configuration's batch sizes, checkpointing, sequence length and
        attention kernel; its topology; its model's shape."""
        run = trainer.run
        self.cfg = run.cfg
        self.runtime = run.runtime
        self.model = unwrap_model(run.accelerator, run.model)

    def on_error(self, trainer, err: BaseException) -> BaseException | None:
        step = trainer.running_step
        if step is None or not isinstance(err, (torch.OutOfMemoryError, MemoryError)):
            return None
        diagnosis = self.diagnose(step, err)
        if self.runtime.accelerator.process_index != 0:  # the script prints rank 0's message only
            logger.error("%s", diagnosis)
        return diagnosis

    def diagnose(self, step: int, err: BaseException) -> UserError:
        cfg, runtime = self.cfg, self.runtime
        layout, zero, device = runtime.batch, runtime.topology.zero, runtime.accelerator.device
        host = isinstance(err, MemoryError) or device.type != "cuda"
        what = "host memory (RAM)" if host else f"GPU memory ({device})"
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        capacity, capacity_name = _capacity(device, host)
        lines = [
            f"Out of {what} in optimizer step {step} on rank {runtime.accelerator.process_index}: {first_line}",
            f"Configuration: train.micro_batch_size={layout.micro_batch_size} sequences of data.seq_len="
            f"{cfg.data.seq_len} tokens, accumulation {layout.accum_steps}, {layout.world_size} processes, "
            f"{zero.describe()}, precision {runtime.precision}, train.gradient_checkpointing="
            f"{str(cfg.train.gradient_checkpointing).lower()}.",
        ]
        try:
            estimates = self._estimates(host)
        except Exception as exc:  # the diagnosis must never hide the OOM itself
            logger.warning("No memory estimate for the OOM message: %r", exc)
            estimates = None
        if estimates is not None:
            now = estimates.pop(0)[1]
            lines.append(f"Estimated need per {'node' if host and zero.offload_optimizer else 'rank'} "
                         f"(lmrecipe/planning/memory.py): {now}; {capacity_name}: {format_bytes(capacity) if capacity else 'unknown'}.")
        else:
            lines.append(f"{capacity_name}: {format_bytes(capacity) if capacity else 'unknown'}.")
        lines.append("Ways out, in this order (the optimization stays the same with each):")
        for i, (change, est) in enumerate(estimates or self._ways_out(), 1):
            lines.append(f"  {i}. {change}" + (f" (estimate: {est})" if est else ""))
        lines.append("Then run the same command again; it resumes from the last checkpoint (no partial checkpoint "
                     "was written).")
        return fail("\n".join(lines))

    def _ways_out(self) -> list[tuple[str, str | None]]:
        return [(change, None) for change, _ in self._alternatives()]

    def _alternatives(self) -> list[tuple[str, dict]]:
        """(the change, the estimate's arguments after it), cumulatively, skipping what is already in effect."""
        cfg, layout, zero = self.cfg, self.runtime.batch, self.runtime.topology.zero
        chunk_tokens = cfg.train.chunk_tokens(self.model.config.vocab_size)
        args = {"setup": zero, "micro_batch_size": layout.micro_batch_size,
                "gradient_checkpointing": cfg.train.gradient_checkpointing, "loss_chunk_tokens": chunk_tokens}
        out = []
        if chunk_tokens == 0 and self.model.config.vocab_size >= 32_768:  # where the logits take GiBs
            args = {**args, "loss_chunk_tokens": AUTO_LOSS_CHUNK_TOKENS}
            out.append((f"train.loss_chunk_tokens={AUTO_LOSS_CHUNK_TOKENS} (the loss in chunks: no full logits)", args))
        smaller = _largest_proper_divisor(layout.micro_batch_size)
        if smaller:
            accum = layout.global_batch_size // (smaller * layout.world_size)
            args = {**args, "micro_batch_size": smaller}
            out.append((f"train.micro_batch_size={smaller}: train.global_batch_size stays {layout.global_batch_size}, "
                        f"accumulation becomes {accum}", args))
        if not cfg.train.gradient_checkpointing:
            args = {**args, "gradient_checkpointing": True}
            out.append(("train.gradient_checkpointing=true (recompute activations in the backward pass)", args))
        if zero.stage < 3:
            args = {**args, "setup": ZeroSetup(stage=3, persistence_threshold=zero.persistence_threshold, deepspeed=True)}
            out.append(("distributed.deepspeed_config=zero3 (shard weights, gradients and optimizer states)", args))
        if not (zero.offload_optimizer and zero.offload_param):
            args = {**args, "setup": replace(args["setup"], stage=3, offload_optimizer=True, offload_param=True,
                                             deepspeed=True)}
            out.append(("distributed.deepspeed_config=zero3_offload (optimizer states and weights in CPU memory)", args))
        return out

    def _estimates(self, host: bool) -> list[tuple[str, str]]:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        cfg, runtime = self.cfg, self.runtime
        layout, topology = runtime.batch, runtime.topology
        # The run is over: detach transformers from a live ZeRO-3 config, or building the shape on the meta
        # device would enter zero.Init and wait for the other ranks.
        unset_hf_deepspeed_config()
        shape = model_shape(self.model.config)
        world_size = topology.world_size
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        nodes = max(1, world_size // max(local, 1))

        def describe(setup, micro_batch_size, gradient_checkpointing, loss_chunk_tokens) -> str:
            est = estimate_run(shape, cfg.workload(), topology, runtime.precision, layout.accum_steps, nodes,
                               setup=setup, micro_batch_size=micro_batch_size,
                               gradient_checkpointing=gradient_checkpointing, loss_chunk_tokens=loss_chunk_tokens)
            activations = est.activations_checkpointed if gradient_checkpointing else est.activations
            if host and setup.offload_optimizer:
                return f"{format_bytes(est.cpu_per_node)} offloaded per node, {format_bytes(est.device_total)} per device"
            text = (f"{format_bytes(est.device_total)} (model states {format_bytes(est.model_states_device)}, "
                    f"activations {format_bytes(activations)}")
            text += f", gathered layer {format_bytes(est.gathered)}" if est.gathered else ""
            text += f", weight EMA {format_bytes(est.ema)})" if est.ema else ")"
            if est.model_states_cpu:
                text += f" + {format_bytes(est.cpu_per_node)} of CPU memory per node"
            return text

        current = ("now", describe(runtime.topology.zero, layout.micro_batch_size, cfg.train.gradient_checkpointing,
                                   cfg.train.chunk_tokens(self.model.config.vocab_size)))
        return [current] + [(change, describe(**args)) for change, args in self._alternatives()]


def _largest_proper_divisor(n: int) -> int | None:
    for d in range(2, n + 1):
        if n % d == 0:
            return n // d
    return None


def _capacity(device: torch.device, host: bool) -> tuple[float | None, str]:
    if not host:
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"capacity of the {props.name}"
    try:
        import psutil

        return float(psutil.virtual_memory().total), "host RAM"
    except ImportError:
        return None, "host RAM"
