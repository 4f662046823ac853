"""A compute budget turned into a run.

Budget: ``C = devices x peak FLOP/s x MFU x seconds`` (or ``6 N D`` from a parameter count N and tokens D). The
compute-optimal split takes ``D = k N`` tokens for N parameters (``k`` = ``tokens_per_param``, 20 by default:
Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models", whose fits give about 20 tokens per
parameter), so ``N = sqrt(C / (6 k))``. Near N, :func:`shapes_near` takes Llama shapes from one family (depth =
width / 128, as Llama 3.2 1B 2048/16, Llama 3 8B 4096/32 and 405B 16384/126; MLP 3.5 x width, as Llama 3 8B and
70B; 64-wide heads up to width 2048, else 128; at most 8 key/value heads), and for each the training FLOPs per
token (:func:`lmrecipe.model.build.flops_per_token`) and the per-device memory under every ZeRO stage
(:func:`lmrecipe.planning.memory.estimate`). The chosen configuration is the shape nearest N that fits, under the stage that
leaves the most memory free. Its wall time is ``tokens x FLOPs per token / (devices x peak x MFU)``.

The same arithmetic at a finished run's own configuration (:func:`predict_run`) is what ``report.md`` puts next
to the measured tokens/s, MFU, step time and peak memory.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from lmrecipe.config import Config, Workload, resolve_deepspeed_config
from lmrecipe.errors import fail
from lmrecipe.planning.memory import ModelShape, estimate
from lmrecipe.observe.device import DEVICES, Device, cpu_matmul_tflops, gpu_peak_tflops
from lmrecipe.observe.metrics_log import METRICS_FILE, read_metrics
from lmrecipe.observe.run_report import FINAL_FILE, summarize_metrics
from lmrecipe.parallel.topology import ZeroSetup
from lmrecipe.planning.shapes import LlamaShape, family_widths, family_shape, shape_from_config, shapes_near

DEFAULT_TOKENS_PER_PARAM = 20.0
"""Hoffmann et al. 2022 (Chinchilla): about 20 training tokens per parameter at the compute-optimal point."""
DEFAULT_VOCAB_SIZE = 128_256
"""Llama 3's vocabulary: the planner's assumption when neither the flags nor the base recipe's data say."""
GiB = 2**30
"""The planner's unit of memory, as the dry run's and ``tools/estimate_memory.py``'s."""
DEFAULT_RESERVE = 0.10
"""Share of a device's reported memory kept free of the estimate. Measured on one H100 (docs/benchmarks/gpu.md), the
allocator's peak was 0.96-1.04 of the estimate under ZeRO-1, -2 and -3 (1B recipe, bf16): up to 4% for the
estimator's error; the rest for what the allocator's peak does not count: the CUDA context and communication buffers
(about 0.5-1 GiB) and the allocator's cached, fragmented blocks."""
NO_ZERO_MEASURED = 1.21
"""The allocator's peak over the estimate without DeepSpeed, measured on the same H100: a no-ZeRO plan needs more
than :data:`DEFAULT_RESERVE` free (:func:`memory_notes`)."""
STAGES = (0, 1, 2, 3)

def device_spec(key: str) -> Device:
    """The :data:`DEVICES` entry for ``--gpu`` (case-insensitive); UserError naming the choices."""
    device = DEVICES.get(key.strip().lower())
    if device is None:
        raise fail(f"--gpu {key!r} is not a device the planner knows. Choose one of {', '.join(DEVICES)}, or pass "
                   "the nearest one with --peak-tflops and --memory-gib for yours.")
    return device


def peak_tflops(device: Device, precision: str) -> float:
    """Dense peak TFLOP/s of one device: the MFU table's figure, or this CPU's measured matmul peak."""
    if device.name == "cpu":
        return cpu_matmul_tflops(precision)
    peak = gpu_peak_tflops(device.name, precision)
    if peak is None:
        raise fail(f"No {precision} peak is known for the {device.name}. Pass --precision with another value, or "
                   "--peak-tflops.")
    return peak


def host_memory_bytes() -> float:
    import psutil

    return float(psutil.virtual_memory().total)


def measured_mfu(run: str | Path) -> tuple[float, str]:
    """The MFU a finished run's ``report.md`` states (over the time in training steps of its logged intervals), and
    where it ran."""
    out = Path(run)
    if not (out / FINAL_FILE).is_file() or not (out / METRICS_FILE).is_file():
        raise fail(f"--from-run {run}: no {FINAL_FILE} and {METRICS_FILE} there, so it is not a finished run's folder "
                   "(out_dir). Pass the out_dir of a run that reached its end, or --mfu.")
    mfu = summarize_metrics(read_metrics(out / METRICS_FILE))["mfu"]
    if not mfu or mfu <= 0:
        raise fail(f"--from-run {run}: its metrics hold no MFU (no logged training step). Pass --mfu instead.")
    meta_path = out / "run_meta.json"
    hardware = json.loads(meta_path.read_text()).get("hardware", {}) if meta_path.is_file() else {}
    return mfu, f"measured by {run} on {hardware.get('gpu') or 'a CPU'}"


# --------------------------------------------------------------------------------------------------
# Budget


def compute_optimal(compute_flops: float, tokens_per_param: float) -> tuple[float, float]:
    """(parameters, tokens) that spend ``compute_flops`` at ``6 N D`` with ``D = tokens_per_param x N``."""
    params = math.sqrt(compute_flops / (6.0 * tokens_per_param))
    return params, tokens_per_param * params


def budget_flops(devices: int, peak: float, mfu: float, days: float) -> float:
    """Training FLOPs ``devices`` devices of ``peak`` TFLOP/s deliver at ``mfu`` in ``days`` days."""
    return devices * peak * 1e12 * mfu * days * 86_400.0


@dataclass
class PlanInputs:
    """What the planner is asked (``tools/plan.py``'s flags, resolved)."""

    devices: int
    device: Device
    precision: str
    peak_tflops: float
    memory_bytes: float
    """Memory per device as it reports it (:attr:`Device.memory_bytes`)."""
    mfu: float
    mfu_source: str
    base: Config
    """The recipe the written recipe starts from (data, optimizer, schedule...)."""
    vocab_size: int
    seq_len: int
    micro_batch_size: int
    gradient_checkpointing: bool
    days: float | None = None
    micro_batch_fixed: bool = True
    """False: the micro-batch is the largest of micro_batch_size, its halves, ... 1 at which something fits."""
    checkpointing_fixed: bool = True
    """False: activation checkpointing is turned on when nothing fits without it at any micro-batch."""
    tokens: float | None = None
    params: float | None = None
    tokens_per_param: float = DEFAULT_TOKENS_PER_PARAM
    cost_per_device_hour: float | None = None
    reserve: float = DEFAULT_RESERVE
    model_from_recipe: bool = False
    """Plan the base recipe's own model instead of the family's shapes near the optimum."""


@dataclass
class Candidate:
    """One shape under one ZeRO stage."""

    shape: LlamaShape
    stage: int
    device_bytes: float
    """Estimated per-device memory (lmrecipe.planning.memory.estimate's ``device_total``)."""
    capacity_bytes: float

    @property
    def headroom_bytes(self) -> float:
        return self.capacity_bytes - self.device_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0


@dataclass
class Plan:
    inputs: PlanInputs
    compute_flops: float
    optimal_params: float
    optimal_tokens: float
    shapes: list[LlamaShape]
    candidates: list[Candidate]
    chosen: Candidate
    tokens: float
    """Tokens the chosen shape trains on: --tokens; with --days the whole budget at its FLOPs per token; with
    --params tokens_per_param of its parameters."""
    global_batch_size: int
    max_steps: int
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    """Where the plan departs from what was asked (:func:`budget_warnings`); ``tools/plan.py`` prints them on stderr."""

    @property
    def flops_per_token(self) -> float:
        return self.chosen.shape.flops_per_token(self.inputs.seq_len)

    @property
    def tokens_per_sec(self) -> float:
        i = self.inputs
        return i.devices * i.peak_tflops * 1e12 * i.mfu / self.flops_per_token

    @property
    def wall_seconds(self) -> float:
        return self.max_steps * self.global_batch_size * self.inputs.seq_len / self.tokens_per_sec

    @property
    def device_hours(self) -> float:
        return self.inputs.devices * self.wall_seconds / 3600.0


def stage_setup(stage: int) -> ZeroSetup:
    """The ZeroSetup of ``ds_configs/zero{stage}.json`` (stage 0: no DeepSpeed)."""
    if stage == 0:
        return ZeroSetup()
    path = resolve_deepspeed_config(f"zero{stage}")
    return ZeroSetup.from_ds_config(json.loads(Path(path).read_text()))


def estimate_device_bytes(shape: ModelShape, stage: int, devices: int, precision: str, micro_batch_size: int,
                          seq_len: int, gradient_checkpointing: bool, work: Workload, accum_steps: int) -> float:
    """Per-device memory of one configuration (lmrecipe.planning.memory.estimate's ``device_total``); ``work`` gives the base
    recipe's attention, weight EMA, chunked loss and optimizer."""
    est = estimate(shape, stage_setup(stage), devices, 1, precision, accum_steps=accum_steps, micro_batch_size=micro_batch_size,
                   seq_len=seq_len, gradient_checkpointing=gradient_checkpointing,
                   attn_implementation=work.model.attn_implementation, ema=work.train.ema_decay > 0,
                   loss_chunk_tokens=work.train.chunk_tokens(shape.vocab_size), optimizer=work.optim.name,
                   expert_parallel_size=work.distributed.expert_parallel_size if shape.expert_params else 1)
    return est.device_total


def make_plan(inputs: PlanInputs) -> Plan:
    """The budget, the compute-optimal size, the shapes near it under each stage, and the chosen configuration."""
    i = inputs
    k = i.tokens_per_param
    if i.days is not None:
        compute = budget_flops(i.devices, i.peak_tflops, i.mfu, i.days)
        n_opt, d_opt = compute_optimal(compute, k)
    else:
        n_opt = i.params if i.params is not None else i.tokens / k
        d_opt = i.tokens if i.tokens is not None else k * n_opt
        compute = 6.0 * n_opt * d_opt
    if i.model_from_recipe:
        shapes = [shape_from_config(i.base.model, i.vocab_size)]
    else:
        check_within_family(i, n_opt)
        shapes = shapes_near(n_opt, i.vocab_size)
    capacity = i.memory_bytes * (1.0 - i.reserve)
    tried = []
    for micro_batch, checkpointing in memory_settings(i):
        accum = batch_and_steps(replace(i, micro_batch_size=micro_batch), 1.0)[0] // (micro_batch * i.devices)
        candidates = [Candidate(s, stage, estimate_device_bytes(s.memory_shape(), stage, i.devices, i.precision,
                                                                micro_batch, i.seq_len, checkpointing, i.base.workload(),
                                                                accum),
                                capacity)
                      for s in shapes for stage in STAGES]
        fitting = [c for c in candidates if c.fits]
        if fitting:
            break
        tried.append(f"micro-batch {micro_batch}{' with activation checkpointing' if checkpointing else ''}")
    else:
        raise nothing_fits(i, candidates, tried[-1], micro_batch, checkpointing, capacity)
    notes = [f"Did not fit at {', '.join(tried)}; planned at micro-batch {micro_batch}"
             f"{' with activation checkpointing' if checkpointing else ''}."] if tried else []
    if checkpointing:
        notes.append("Activation checkpointing recomputes the forward pass: the devices do about 8 instead of 6 FLOPs "
                     "per parameter per token, so at the same hardware utilisation expect about 3/4 of the predicted "
                     "tokens/s.")
    i = replace(i, micro_batch_size=micro_batch, gradient_checkpointing=checkpointing)
    nearest = min({c.shape for c in fitting}, key=lambda s: abs(math.log(s.n_params / n_opt)))
    chosen = max((c for c in fitting if c.shape == nearest), key=lambda c: c.headroom_bytes)
    if i.tokens is not None:
        tokens = i.tokens
    elif i.days is not None:  # the whole budget, at the chosen shape's FLOPs per token
        tokens = compute / chosen.shape.flops_per_token(i.seq_len)
    else:
        tokens = k * chosen.shape.n_params
    gbs, steps = batch_and_steps(i, tokens)
    notes += memory_notes(chosen, i.memory_bytes)
    plan = Plan(i, compute, n_opt, d_opt, shapes, candidates, chosen, tokens, gbs, steps, notes)
    plan.warnings = budget_warnings(plan)
    return plan


def memory_notes(chosen: Candidate, memory_bytes: float) -> list[str]:
    """A note when the chosen configuration runs without DeepSpeed and would not fit at the peak measured against
    the estimate there (:data:`NO_ZERO_MEASURED`)."""
    if chosen.stage != 0 or chosen.device_bytes * NO_ZERO_MEASURED <= memory_bytes:
        return []
    return [f"Without DeepSpeed the measured peak was {NO_ZERO_MEASURED}x the estimate (docs/benchmarks/gpu.md): "
            f"{chosen.device_bytes * NO_ZERO_MEASURED / GiB:,.1f} GiB here, over the device's "
            f"{memory_bytes / GiB:,.1f} GiB. Prefer ZeRO-1 (distributed.deepspeed_config=zero1)."]


_BRACKET = 1.5
"""shapes_near's spread: the shapes it offers lie within this factor of the target when the family reaches it."""
OVER_BUDGET = 1.1
"""A plan that spends more than this multiple of the asked days or tokens is flagged (rounding up to whole steps
costs a little; a budget below one step or below the smallest shape costs far more)."""


def _asked(i: PlanInputs) -> str:
    """The budget as the flags gave it: ``--days 1 on 8 H100``, ``--tokens 2e+11``, ``--params 1e+09``."""
    if i.days is not None:
        return f"--days {i.days:g} on {i.devices:,} {i.device.name}"
    return " with ".join(f"--{name} {value:g}" for name, value in (("params", i.params), ("tokens", i.tokens))
                         if value is not None)


def check_within_family(i: PlanInputs, n_opt: float) -> None:
    """UserError when the compute-optimal size lies beyond the family's largest shape: the planner would plan that
    shape for a budget it cannot spend, and then blame the device count when it does not fit."""
    largest = family_shape(family_widths()[-1], i.vocab_size)
    if n_opt <= _BRACKET * largest.n_params:
        return
    smaller = "--days or --gpus" if i.days is not None else "--params" if i.params is not None else "--tokens"
    raise fail(f"{_asked(i)} calls for a compute-optimal model of {format_count(n_opt)} parameters, beyond the largest "
               f"shape the planner knows ({largest.describe()}, {format_count(largest.n_params)} parameters). Plan a "
               f"smaller budget (lower {smaller}), or fix the model with --params (at most "
               f"{format_count(largest.n_params)}) and the data with --tokens.")


def nothing_fits(i: PlanInputs, candidates: list[Candidate], tried: str, micro_batch: int, checkpointing: bool,
                 capacity: float):
    """The UserError for a plan in which no shape fits under any stage, naming only the changes that would help: more
    devices shrink ZeRO-3's partitioned states, not the activations or the gathered layer, which no device count
    divides."""
    smallest = min(candidates, key=lambda c: c.device_bytes)
    floor = estimate_device_bytes(smallest.shape.memory_shape(), 3, 2**40, i.precision, micro_batch, i.seq_len,
                                  checkpointing, i.base.workload(), 1)
    fixes = [*(["lower --micro-batch"] if micro_batch > 1 else []), "lower --seq-len",
             *([] if checkpointing else ["add --gradient-checkpointing"]),
             *(["use more devices"] if floor <= capacity else []),
             *([] if i.model_from_recipe else ["plan a smaller model (--params)"])]
    more = "" if floor <= capacity else (
        f" More devices would not help: even on any number of them ZeRO-3 needs {floor / GiB:,.1f} GiB per device for "
        "the activations and the gathered layer, which no device count divides.")
    advice = ", ".join(fixes[:-1]) + " or " + fixes[-1]
    return fail(f"Nothing fits: the smallest configuration (ZeRO-{smallest.stage}, {smallest.shape.describe()}, "
                f"{tried}) needs {smallest.device_bytes / GiB:,.1f} GiB per device, over the {capacity / GiB:,.1f} GiB "
                f"usable of {i.memory_bytes / GiB:,.1f} GiB ({100 * i.reserve:.0f}% kept free).{more} "
                f"{advice[0].upper()}{advice[1:]}.")


def budget_warnings(plan: Plan) -> list[str]:
    """Where the plan spends more than was asked: a run shorter than one optimizer step (or than a whole number of
    them), or a model size below the family's smallest shape."""
    i, warnings = plan.inputs, []
    run_tokens = plan.max_steps * plan.global_batch_size * i.seq_len
    step = (f"one optimizer step is {plan.global_batch_size:,} sequences x {i.seq_len:,} tokens = "
            f"{plan.global_batch_size * i.seq_len:,} tokens")
    if i.days is not None and plan.wall_seconds > OVER_BUDGET * i.days * 86_400.0:
        warnings.append(f"The plan runs {format_duration(plan.wall_seconds)}, {plan.wall_seconds / (i.days * 86_400.0):,.3g} "
                        f"times the asked {_asked(i)}: {step} of a {format_count(plan.chosen.shape.n_params)}-parameter "
                        "model, and a run takes whole steps. Ask for a larger budget, or a smaller batch "
                        "(train.global_batch_size=N) in the recipe.")
    elif i.tokens is not None and run_tokens > OVER_BUDGET * i.tokens:
        warnings.append(f"The plan trains {format_count(run_tokens)} tokens, {run_tokens / i.tokens:,.3g} times the asked "
                        f"--tokens {i.tokens:g}: {step}, and a run takes whole steps. Ask for more tokens, or a "
                        "smaller batch (train.global_batch_size=N) in the recipe.")
    if i.params is not None and not i.model_from_recipe and plan.chosen.shape.n_params > _BRACKET * i.params:
        warnings.append(f"The chosen shape has {format_count(plan.chosen.shape.n_params)} parameters, "
                        f"{plan.chosen.shape.n_params / i.params:,.3g} times the asked --params {i.params:g}: the "
                        "planner's smallest shape that fits is that large. Plan your own model with --recipe and "
                        "--model-from-recipe.")
    return warnings


def memory_settings(inputs: PlanInputs) -> list[tuple[int, bool]]:
    """(micro-batch, activation checkpointing) to try in order: the asked ones, then (what is not fixed) halves of
    the micro-batch down to 1, then the same with checkpointing."""
    i = inputs
    batches = [i.micro_batch_size]
    while not i.micro_batch_fixed and batches[-1] > 1:
        batches.append(batches[-1] // 2)
    checkpointing = [True] if i.gradient_checkpointing else [False] if i.checkpointing_fixed else [False, True]
    return [(b, c) for c in checkpointing for b in batches]


def batch_and_steps(inputs: PlanInputs, tokens: float) -> tuple[int, int]:
    """Global batch (sequences) and optimizer steps: the base recipe's tokens per step, in whole micro-batches on
    every device, and enough steps to see ``tokens``."""
    i = inputs
    unit = i.micro_batch_size * i.devices
    per_step = i.base.train.global_batch_size * i.base.data.seq_len
    gbs = max(unit, round(per_step / i.seq_len / unit) * unit)
    return gbs, max(1, math.ceil(tokens / (gbs * i.seq_len)))


def format_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f}{unit}"
    return f"{n:,.0f}"


def format_duration(seconds: float) -> str:
    if seconds >= 86_400:
        return f"{seconds / 86_400:,.2f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:,.2f} hours"
    if seconds >= 60:
        return f"{seconds / 60:,.1f} minutes"
    return f"{seconds:.3g} seconds"
