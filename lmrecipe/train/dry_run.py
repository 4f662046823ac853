"""``train.py --dry-run``: the start-up checks of a run (``lmrecipe/train/preflight.py``: the same list a run
makes before it builds anything), then what the run would log and need, without training.

:func:`dry_run` takes a loaded configuration (its types, ranges and rules are checked by then), goes through every
check past each problem so all are reported at once, and returns the start-up line the run would log (its parameter
counts from the model's shape on the meta device) and a memory estimate per rank. It builds no Accelerator and no
weights, stages no data, and writes nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from lmrecipe.config import Config, Workload
from lmrecipe.config.sections import fail_all
from lmrecipe.model.kernels import liger_missing, resolve_kernels
from lmrecipe.planning.memory import MemoryEstimate, estimate_run, format_bytes, model_shape
from lmrecipe.parallel.topology import startup_line
from lmrecipe.train.preflight import Preflight, preflight


@dataclass
class DryRunReport:
    """What a dry run found: ``lines`` to show (the data, the start-up line, the estimate, notes) and every
    ``problems``."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

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
    """Every start-up check of ``cfg`` (:func:`~lmrecipe.train.preflight.preflight`), then the start-up line and the
    memory estimate of the run it would start; nothing is written."""
    pf = preflight(cfg, dry=True)
    report = DryRunReport(list(pf.lines), pf.problems)
    if pf.hf_config is not None and pf.topology is not None and pf.precision is not None:
        report.lines += run_lines(cfg.workload(), pf)
    report.lines += [f"note: {note}" for note in pf.notes]
    if pf.resume_from is not None:
        report.lines.append(f"note: the run resumes from {pf.resume_from} (checkpoint.resume={cfg.checkpoint.resume}).")
    return report


def run_lines(work: Workload, pf: Preflight) -> list[str]:
    """The start-up line the run would log, its memory estimate per rank and the notes on this machine."""
    shape = model_shape(pf.hf_config)
    lines = ["start-up line: " + startup_line(
        shape.n_params, shape.active() if shape.expert_params else None, pf.topology, pf.batch, work.data.seq_len,
        pf.precision, work.train.chunk_tokens(pf.hf_config.vocab_size))]
    if pf.cfg.model.kernels == "auto":
        why = " (Liger-Kernel needs a CUDA GPU, Triton and the liger-kernel package)" if liger_missing() else ""
        lines.append(f"model.kernels=auto: {resolve_kernels('auto', pf.hf_config.model_type, pf.cfg.model.is_moe())} here{why}")
    memory = pf.check(lambda: estimate_run(shape, work, pf.topology, pf.precision, pf.batch.accum_steps,
                                           _nodes(pf.world_size)))
    if memory is not None:
        lines.append(memory_line(memory, work.train.gradient_checkpointing))
        lines += device_notes(memory, work.train.precision, pf.precision)
    return lines


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
