"""The GPU kit's stages: which runs each one measures (its sides) and the figure it turns them into.

A side is ``key=value`` overrides on top of the kit's base, trained by ``bench/gpu/worker.py``. Sides with the same
overrides are measured once per invocation and shared by the stages that name them.
"""

from dataclasses import dataclass, field
from typing import Callable

ZERO2 = ("distributed.deepspeed_config=zero2",)
NO_DEEPSPEED = ("distributed.deepspeed_config=null",)


@dataclass(frozen=True)
class Side:
    """One measured configuration."""

    label: str
    overrides: tuple[str, ...] = ()
    levers: bool = False  # the levers stage's windows (levers.py) instead of one timed run

    @property
    def key(self) -> str:
        """What identifies the run: its overrides (and the levers sweep apart from a plain run of them)."""
        return " ".join(self.overrides) + (" (levers)" if self.levers else "")


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


def _syncs(results):
    """``host_syncs``, a stage of earlier runs, as the page words it (the project's own: tests/unit/test_step.py)."""
    parts = []
    for label, r in results.items():
        s = r["host_syncs"]
        kinds = ", ".join(f"`{kind}` {n:g}" for kind, n in s["by_kind"].items() if n) or "none"
        parts.append(f"{label}: {s['per_step']:g} per step ({kinds}), torch.cuda sync warnings "
                     f"{_num(s['cuda_per_step'], 'g')} per step")
    return {"figure": "; ".join(parts)}


def _levers(results):
    lv, no_ds = results["levers"], results["no DeepSpeed"]
    windows = {name: w for name, w in lv["windows"].items() if "tokens_per_sec" in w}
    base, (name, best) = windows["baseline"], max(windows.items(), key=lambda kv: kv[1]["tokens_per_sec"])
    recorded = lv.get("baseline_vs_recorded", {})
    against = "" if recorded.get("points") is None else \
        f" ({recorded['points']:+.1f} points from the recorded {_pct(recorded['recorded_mfu'])})"
    figure = (f"baseline {_num(base['tokens_per_sec'])} tokens/s, MFU {_pct(base['mfu'])}{against}, data wait "
              f"{_pct(base.get('data_share'))} of the step; best ({name}) "
              f"{_num(best['tokens_per_sec'])} tokens/s, MFU {_pct(best['mfu'])}, "
              f"{_num(_ratio(best['tokens_per_sec'], base['tokens_per_sec']), '.3f')}x; no DeepSpeed "
              f"{_num(_ratio(no_ds['tokens_per_sec'], base['tokens_per_sec']), '.3f')}x the baseline")
    return {"figure": figure, "value": best["mfu"], "met": None if best["mfu"] is None else best["mfu"] >= 0.45}


STAGES = (
    Stage("levers", "each speed lever on top of the best so far, in place on one 1B build (bench/gpu/levers.py); "
          "no DeepSpeed apart", ">= 45% MFU",
          (Side("no DeepSpeed", NO_DEEPSPEED), Side("levers", ZERO2, levers=True)), _levers),
)
DEFAULT_STAGES = ("levers",)  # the next GPU call: one worker for the sweep, one without DeepSpeed
BY_NAME = {stage.name: stage for stage in STAGES}
EARLIER = {"host_syncs": _syncs}  # the summaries of stages only earlier runs measured, for the page


def select(spec: str) -> list[Stage]:
    """Stages named in a comma-separated ``spec`` (``default``, ``all`` or names); ValueError naming the choices."""
    choices = f"choose from {', '.join(BY_NAME)}, or 'default' or 'all'"
    names = [each for part in spec.split(",") if (name := part.strip())
             for each in (DEFAULT_STAGES if name == "default" else BY_NAME if name == "all" else (name,))]
    if unknown := next((name for name in names if name not in BY_NAME), None):
        raise ValueError(f"unknown stage {unknown!r}: {choices}")
    if not names:
        raise ValueError(f"no stage named: {choices}")
    return [BY_NAME[name] for name in dict.fromkeys(names)]
