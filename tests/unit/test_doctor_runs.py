"""The run doctor on the figures of real runs (``tests/fixtures/doctor/``): healthy runs have no finding, and each
faulty variant has its finding, with a lower rate advised only where the rate is not at the schedule's floor.

Each fixture is a tiny run on the embedded corpus (``tools/prepare_data.py --output data/stdlib --vocab-size 8192``)
cut to the keys the loss, gradient and validation checks read: ``metrics.jsonl`` without the timings (they measure
the machine, a loaded one here) and ``run_meta.json`` with the configuration those checks use and the command that
trained it (``launches``; ``SMALL`` = ``model.hidden_size=64 model.num_layers=2 model.intermediate_size=128
data.seq_len=64``):

- ``demo``: ``make demo``'s run, ``recipes/tiny.yaml`` (300 steps, cosine down to ``optim.min_lr``);
- ``wsd``: ``recipes/tiny.yaml train.max_steps=200 schedule.decay_fraction=0.2 train.seed=3 optim.lr=3e-3``;
- ``moe``: ``recipes/tiny_moe.yaml train.max_steps=200 train.seed=5``;
- ``linear``: ``recipes/tiny.yaml`` SMALL, 200 steps, a linear decay, ``optim.lr=3e-3``, ``train.seed=7``;
- ``ramp``: a real divergence, ``recipes/tiny.yaml`` SMALL with the rate climbing to 2.0 over the whole run
  (``schedule.warmup_steps=train.max_steps=120``): the loss falls while the rate is small, then climbs above the
  untrained model's;
- ``jump``: a real divergence after a healthy start, ``linear`` resumed at its step 200 for 100 more steps at a
  constant ``optim.lr=0.1``, 330 times the rate it had reached (``checkpoint.allow_lr_change=true``): the loss
  climbs from 5.1 back to the plateau the model had left;
- ``cold``: a rate of nearly zero, ``recipes/tiny.yaml`` SMALL, 100 steps at ``optim.lr=1e-6``: the loss does not
  fall.

The other faulty variants are healthy fixtures edited here, each by a function below that says how.
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest
from helpers import ROOT

from lmrecipe.observe.doctor import RunFigures, at_floor, diagnose, diagnose_run, read_rows, report_lines

FIXTURES = ROOT / "tests" / "fixtures" / "doctor"
HEALTHY = ["demo", "wsd", "moe", "linear"]


def names(findings) -> list[str]:
    return [f.name for f in findings]


def variant(tmp_path: Path, name: str, edit, upto: int | None = None) -> Path:
    """Fixture ``name`` copied to ``tmp_path``, its training rows up to step ``upto`` (the run read while it is
    still being written) passed through ``edit``."""
    out = tmp_path / name
    shutil.copytree(FIXTURES / name, out)
    rows = [r for r in read_rows(out / "metrics.jsonl") if upto is None or r["step"] <= upto]
    train = edit([r for r in rows if "loss" in r])
    rows = sorted(train + [r for r in rows if "loss" not in r], key=lambda r: (r["step"], "loss" not in r))
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def rising(from_step: int, nats: float):
    """The loss climbs: ``nats`` more at the last row, added in a straight line from ``from_step`` on."""
    def edit(rows: list[dict]) -> list[dict]:
        last = rows[-1]["step"]
        return [{**r, "loss": r["loss"] + nats * max(0, r["step"] - from_step) / (last - from_step)} for r in rows]
    return edit


def flat_after(step: int):
    """The loss stops falling at ``step``: each later row holds the loss there plus the row's own scatter (its
    difference from the mean of it and its two neighbours), so the noise stays and the trend goes."""
    def edit(rows: list[dict]) -> list[dict]:
        losses = [r["loss"] for r in rows]
        level = next(r["loss"] for r in rows if r["step"] >= step)
        out = []
        for i, r in enumerate(rows):
            near = losses[max(0, i - 1):i + 2]
            out.append(r if r["step"] < step else {**r, "loss": level + r["loss"] - statistics.fmean(near)})
        return out
    return edit


def grad_norm_growing(factor: float):
    """The gradient norm grows exponentially over the run, to ``factor`` times its logged value at the last row."""
    def edit(rows: list[dict]) -> list[dict]:
        last = rows[-1]["step"]
        return [{**r, "grad_norm": r["grad_norm"] * factor ** (r["step"] / last)} for r in rows]
    return edit


@pytest.mark.parametrize("name", HEALTHY)
def test_the_healthy_runs_have_no_findings(name):
    assert diagnose_run(FIXTURES / name) == []


@pytest.mark.parametrize("name", HEALTHY)
def test_the_healthy_runs_show_no_loss_finding_at_any_step_while_they_are_written(name):
    """``tools/doctor.py`` on a live run: every logged step's view of the healthy runs (the wsd run clips most steps
    for a while after its warmup: that finding is a fact of those steps, not of the loss)."""
    rows = read_rows(FIXTURES / name / "metrics.jsonl")
    meta = json.loads((FIXTURES / name / "run_meta.json").read_text())
    seen = {f.name for step in sorted({r["step"] for r in rows})
            for f in diagnose([r for r in rows if r["step"] <= step], meta)}
    assert not seen & {"loss_diverging", "loss_not_falling", "grad_norm_rising"}, seen


def test_the_demos_report_says_no_findings_where_single_steps_looked_like_a_divergence():
    rows = [r for r in read_rows(FIXTURES / "demo" / "metrics.jsonl") if "loss" in r]
    best = min(rows[:-3], key=lambda r: r["loss"])
    # One step's loss against the median of the last three: what the report said of every demo, 0.68 nats apart.
    assert (best["step"], round(best["loss"], 4)) == (260, 3.6672)
    assert round(statistics.median(r["loss"] for r in rows[-3:]), 4) == 4.3459
    assert "No findings" in "\n".join(report_lines(diagnose_run(FIXTURES / "demo")))


def test_the_healthy_fixtures_end_at_the_schedules_floor_and_the_divergences_do_not():
    def end_at_floor(name: str) -> bool:
        meta = json.loads((FIXTURES / name / "run_meta.json").read_text())
        rows = [r for r in read_rows(FIXTURES / name / "metrics.jsonl") if "loss" in r]
        return at_floor(RunFigures(rows, [], meta["config"], meta), rows[-3:])

    assert [end_at_floor(name) for name in [*HEALTHY, "ramp", "jump"]] == [True, True, True, True, False, False]


def test_real_divergences_advise_a_lower_rate_and_a_rate_of_nearly_zero_a_higher_one(tmp_path):
    (finding,) = diagnose_run(FIXTURES / "ramp")
    assert finding.name == "loss_diverging" and "optim.lr=0.667 (a third)" in finding.fix
    assert "11.5073 at step 88 (learning rate 1.47" in finding.evidence
    diverging, jump = diagnose_run(FIXTURES / "jump")
    assert diverging.name == "loss_diverging" and "optim.lr=0.0333 (a third)" in diverging.fix
    assert jump.name == "resume_jump" and "after the resume at step 200" in jump.evidence
    # Without its rows above the untrained model's loss, the smoothed loss still ends far above its best.
    settled = variant(tmp_path, "jump", lambda rows: [r for r in rows if r["step"] <= 200 or r["loss"] < 8])
    diverging, _ = diagnose_run(settled)
    assert "mean loss 5.3275 over steps 140-160, then 6.7347 over steps 280-300" in diverging.evidence
    (cold,) = diagnose_run(FIXTURES / "cold")
    assert cold.name == "loss_not_falling" and "optim.lr=0.0003 (the default peak)" in cold.fix


def test_a_loss_rising_at_the_floor_is_found_and_no_rate_is_advised(tmp_path):
    """The demo with its loss made to climb 1.5 nats over its last 60 steps, where the rate is at its floor."""
    (finding,) = diagnose_run(variant(tmp_path, "demo", rising(240, 1.5)))
    assert finding.name == "loss_diverging" and "over steps 260-300" in finding.evidence
    assert "schedule's floor" in finding.cause and "optim.lr" not in finding.fix


@pytest.mark.parametrize("name,upto,fix", [("demo", 150, "optim.lr=0.000667"), ("wsd", 150, "optim.lr=0.001"),
                                           ("linear", 120, "optim.lr=0.001")])
def test_a_loss_rising_at_a_high_rate_advises_a_lower_one(tmp_path, name, upto, fix):
    """The run read while it is written, before its decay is done, with the loss climbing 3 nats over its last 50
    steps."""
    (finding,) = diagnose_run(variant(tmp_path, name, rising(upto - 50, 3.0), upto=upto))
    assert finding.name == "loss_diverging" and f"{fix} (a third)" in finding.fix


@pytest.mark.parametrize("name", HEALTHY)
def test_a_loss_that_stops_falling_after_warmup_is_found(tmp_path, name):
    meta = json.loads((FIXTURES / name / "run_meta.json").read_text())
    (finding,) = diagnose_run(variant(tmp_path, name, flat_after(meta["config"]["schedule"]["warmup_steps"])))
    assert finding.name == "loss_not_falling"


def test_a_gradient_norm_rising_with_the_rate_is_found_and_at_the_floor_is_not(tmp_path):
    """Norms above the clip are clipping too: that finding comes with them, and is not what is tested here."""
    findings = diagnose_run(variant(tmp_path, "linear", grad_norm_growing(20.0), upto=120))
    finding = next(f for f in findings if f.name == "grad_norm_rising")
    assert "optim.lr=0.001 (a third)" in finding.fix
    assert "grad_norm_rising" not in names(diagnose_run(variant(tmp_path / "whole", "demo", grad_norm_growing(20.0))))
