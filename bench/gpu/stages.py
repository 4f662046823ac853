"""The GPU kit's stages: which runs each one measures (its sides) and the figure it turns them into.

A side is ``key=value`` overrides on top of the kit's base, trained by ``bench/gpu/worker.py``. Sides with the same
overrides are measured once per invocation and shared by the stages that name them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

ZERO1, ZERO2, ZERO3 = ("distributed.deepspeed_config=zero1",), ("distributed.deepspeed_config=zero2",), \
    ("distributed.deepspeed_config=zero3",)
NO_DEEPSPEED = ("distributed.deepspeed_config=null",)
FLASH = ("model.attn_implementation=flash_attention_2",)
# Micro-batch 4 for both sides of the loss stage: full logits of 8 x 2,048 tokens over 128,256 ids would add
# 8.4 GB in fp32 (and their gradient) to a 1B ZeRO-2 step, too close to 80 GB to compare peaks.
LOSS_MICRO = ("train.micro_batch_size=4",)


@dataclass(frozen=True)
class Side:
    """One measured configuration."""

    label: str
    overrides: tuple[str, ...] = ()
    count_syncs: bool = False  # count host syncs over a few steps after the timed ones
    checkpoint_stall: bool = False  # time the loop blocked by one synchronous and one background checkpoint
    profile: bool = False  # profile one step after the timed ones
    needs: str | None = None  # a module the side needs (flash_attn); without it the side is skipped, and says so


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    target: str
    sides: tuple[Side, ...]
    summarize: Callable[[dict[str, dict]], dict] = field(repr=False)  # results by label -> figure, value, met


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _mfu(results):
    r = results["bf16 ZeRO-2"]
    return {"figure": f"{_num(r['tokens_per_sec'])} tokens/s, MFU {_pct(r['mfu'])}, step {r['step_time_s']:.3f} s",
            "value": r["mfu"], "met": None if r["mfu"] is None else r["mfu"] >= 0.45}


def _throughputs(results):
    parts = [f"{label}: {_num(r['tokens_per_sec'])} tokens/s, MFU {_pct(r['mfu'])}" for label, r in results.items()]
    return {"figure": "; ".join(parts), "value": None, "met": None}


def _ratios(base: str, target: float | None = None):
    """Each other side's tokens/s over ``base``'s; with one other side, its ratio is the value, met if >= ``target``."""
    def summarize(results):
        a = results[base]
        ratios = {label: _ratio(r["tokens_per_sec"], a["tokens_per_sec"]) for label, r in results.items() if label != base}
        parts = [f"{label} / {base}: {_num(v, '.3f')}x ({_num(results[label]['tokens_per_sec'])} tokens/s)"
                 for label, v in ratios.items()]
        value = next(iter(ratios.values())) if len(ratios) == 1 else None
        return {"figure": f"{base} {_num(a['tokens_per_sec'])} tokens/s; " + "; ".join(parts), "value": value,
                "met": None if value is None or target is None else value >= target}
    return summarize


def _syncs(results):
    parts, met = [], None
    for label, r in results.items():
        s = r["host_syncs"]
        kinds = ", ".join(f"`{kind}` {n:g}" for kind, n in s["by_kind"].items() if n) or "none"
        parts.append(f"{label}: {s['per_step']:g} per step ({kinds}), torch.cuda sync warnings "
                     f"{_num(s['cuda_per_step'], 'g')} per step")
    sync_free = results["no DeepSpeed"]["host_syncs"]
    met = sync_free["per_step"] == 0 and sync_free["cuda_per_step"] in (0, None)
    return {"figure": "; ".join(parts), "value": sync_free["per_step"], "met": met}


def _loss(results):
    full, chunked = results["full logits"], results["chunked loss"]
    ratio = _ratio(full["step_peak_gib"], chunked["step_peak_gib"])
    figure = (f"step peak {_num(full['step_peak_gib'], '.2f')} GiB full logits, {_num(chunked['step_peak_gib'], '.2f')} "
              f"GiB chunked: {_num(ratio, '.2f')}x lower")
    return {"figure": figure, "value": ratio, "met": None if ratio is None else ratio >= 4}


def _stall(results):
    r = results["bf16 ZeRO-2 checkpoints"]["checkpoint_stall"]
    ratio = _ratio(r["sync"]["blocked_s"], r["background"]["blocked_s"])
    figure = (f"loop blocked {1e3 * r['sync']['blocked_s']:,.0f} ms synchronous, {1e3 * r['background']['blocked_s']:,.0f} "
              f"ms background per checkpoint ({_num(ratio, '.2f')}x; {r['checkpoint_gb']:.1f} GB)")
    return {"figure": figure, "value": ratio, "met": None}


def _profiles(results):
    parts = []
    for label, r in results.items():
        p = r["profile"]
        if "error" in p:
            parts.append(f"{label}: profiler failed ({p['error'][:120]})")
            continue
        busy = "" if p["device_busy_share"] is None else f"GPU busy {_pct(p['device_busy_share'])} of "
        top = ", ".join(f"{k['name'][:60]} {_pct(k['share'])}" for k in p["top"][:3])
        parts.append(f"{label}: {busy}a {1e3 * p['wall_s']:,.0f} ms step; most time in {top}")
    return {"figure": "; ".join(parts), "value": None, "met": None}


def _data_wait(results):
    r = results["bf16 ZeRO-2"]
    figure = f"{1e3 * r['data_wait_s_per_step']:.2f} ms per step, {_pct(r['data_share'])} of the step"
    return {"figure": figure, "value": r["data_share"], "met": r["data_share"] < 0.01}


BF16_ZERO2 = Side("bf16 ZeRO-2", ZERO2)
STAGES = (
    Stage("mfu_zero2", "MFU and tokens/s, 1B recipe, bf16, ZeRO-2, SDPA", ">= 45% MFU", (BF16_ZERO2,), _mfu),
    Stage("host_syncs", "host syncs per unlogged step (HostSyncCounter, torch.cuda's sync debug mode)", "0 (no DeepSpeed)",
          (Side("no DeepSpeed", NO_DEEPSPEED, count_syncs=True), Side("ZeRO-2", ZERO2, count_syncs=True)), _syncs),
    Stage("chunked_loss", "one step's peak memory at vocabulary 128,256, full logits against chunked", ">= 4x lower",
          (Side("full logits", ZERO2 + LOSS_MICRO + ("train.loss_chunk_tokens=0",)),
           Side("chunked loss", ZERO2 + LOSS_MICRO + ("train.loss_chunk_tokens=1024",))), _loss),
    Stage("fp8", "fp8 (torchao float8 linears) against bf16, ZeRO-2", ">= 1.2x tokens/s",
          (BF16_ZERO2, Side("fp8 ZeRO-2", ZERO2 + ("train.precision=fp8",))), _ratios("bf16 ZeRO-2", 1.2)),
    Stage("data_wait", "data wait per step (prefetched batches and their copy), bf16 ZeRO-2", "< 1% of the step",
          (BF16_ZERO2,), _data_wait),
    Stage("profile", "one step's GPU busy share and top kernels, with and without ZeRO-2", "(diagnosis)",
          (Side("bf16 ZeRO-2", ZERO2, profile=True), Side("no DeepSpeed", NO_DEEPSPEED, profile=True)), _profiles),
    Stage("zero_stages", "tokens/s and MFU per ZeRO stage, bf16, SDPA", "(table)",
          (Side("ZeRO-1", ZERO1), Side("ZeRO-2", ZERO2), Side("ZeRO-3", ZERO3)), _throughputs),
    Stage("flash", "flash-attn 2 against SDPA, bf16 ZeRO-2, document masking on (variable-length path)",
          "(comparison)", (BF16_ZERO2, Side("flash ZeRO-2", ZERO2 + FLASH, needs="flash_attn")), _ratios("bf16 ZeRO-2")),
    Stage("flash3", "flash-attn 3 (Hopper) against SDPA, bf16 ZeRO-2, document masking on (variable-length path)",
          "(comparison)", (BF16_ZERO2, Side("flash-3 ZeRO-2", ZERO2 + ("model.attn_implementation=flash_attention_3",),
                                            needs="flash_attn_interface")), _ratios("bf16 ZeRO-2")),
    Stage("document_masking", "document masking on against off, bf16 ZeRO-2, SDPA", "(cost of masking)",
          (BF16_ZERO2, Side("masking off", ZERO2 + ("data.document_masking=false",))), _ratios("bf16 ZeRO-2")),
    Stage("compile", "torch.compile against eager, bf16 and fp8, ZeRO-2", "(comparison)",
          (BF16_ZERO2, Side("compiled ZeRO-2", ZERO2 + ("train.compile=true",)),
           Side("fp8 compiled ZeRO-2", ZERO2 + ("train.precision=fp8", "train.compile=true"))), _ratios("bf16 ZeRO-2")),
    Stage("checkpoint_stall", "loop time blocked per checkpoint, synchronous against background write, ZeRO-2",
          "(comparison)", (Side("bf16 ZeRO-2 checkpoints", ZERO2, checkpoint_stall=True),), _stall),
)
# Four runs (bf16 ZeRO-2, no DeepSpeed, compiled bf16 and fp8); the other stages add a run or more each.
DEFAULT_STAGES = ("mfu_zero2", "host_syncs", "data_wait", "profile", "compile", "checkpoint_stall")
BY_NAME = {stage.name: stage for stage in STAGES}


def select(spec: str) -> list[Stage]:
    """Stages named in a comma-separated ``spec`` (``default``, ``all`` or names); ValueError naming the choices."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    chosen: list[str] = []
    for name in names:
        expanded = DEFAULT_STAGES if name == "default" else tuple(BY_NAME) if name == "all" else (name,)
        for each in expanded:
            if each not in BY_NAME:
                raise ValueError(f"unknown stage {each!r}: choose from {', '.join(BY_NAME)}, or 'default' or 'all'")
            if each not in chosen:
                chosen.append(each)
    if not chosen:
        raise ValueError(f"no stage named: choose from {', '.join(BY_NAME)}, or 'default' or 'all'")
    return [BY_NAME[name] for name in chosen]
