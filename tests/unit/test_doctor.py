"""The run doctor (``lmrecipe/observe/doctor.py``): each playbook symptom found in metrics rows made to show it,
nothing found in a healthy run's, and three real tiny runs: a rate far too high, a rate of (nearly) zero, a sane one."""

from __future__ import annotations

import json
import math

import pytest
from helpers import TINY_OVERRIDES

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.observe.doctor import diagnose, diagnose_run, read_rows, report_lines

CONFIG = {"optim": {"lr": 1e-3, "grad_clip": 1.0, "weight_decay": 0.1}, "schedule": {"warmup_steps": 10},
          "train": {"max_steps": 200, "global_batch_size": 32}, "data": {}}


def rows(steps=range(10, 201, 10), loss=lambda s: 8.0 * math.exp(-s / 100) + 2.0, grad_norm=lambda s: 0.5,
         tokens_per_sec=lambda s: 1000.0, data_time_s=lambda s: 0.001, **extra) -> list[dict]:
    """Training rows of a healthy run, one per 10 steps of 1 s (every figure a function of the step)."""
    out = []
    for step in steps:
        row = {"step": step, "loss": loss(step), "lr": 1e-3, "grad_norm": grad_norm(step),
               "tokens_per_sec": tokens_per_sec(step), "step_time_s": 0.1, "data_time_s": data_time_s(step),
               "interval_steps": 10, "interval_time_s": 1.0, "skipped_steps": 0}
        row.update({key: fn(step) for key, fn in extra.items()})
        out.append(row)
    return out


def meta(n_train_windows=100_000, launches=(), **config) -> dict:
    merged = {section: {**values, **config.get(section, {})} for section, values in CONFIG.items()}
    return {"config": merged, "n_train_windows": n_train_windows, "launches": list(launches)}


def names(findings) -> list[str]:
    return [f.name for f in findings]


def test_a_healthy_run_has_no_findings_and_the_report_says_so():
    assert diagnose(rows(), meta()) == []
    assert "No findings" in "\n".join(report_lines([]))
    assert diagnose([], {}) == []  # a run that has not logged yet


def test_skipped_non_finite_steps_at_the_start_blame_the_rate_and_warmup():
    data = rows()
    for r in data:
        r["skipped_steps"] = 2
    (finding,) = diagnose(data, meta())
    assert finding.name == "non_finite" and "2 step(s) skipped" in finding.evidence and "step 10" in finding.evidence
    assert "optim.lr=0.0001" in finding.fix and "schedule.warmup_steps=20" in finding.fix


def skipped_flat(**extra) -> list[dict]:
    """A run whose every update was skipped for a non-finite gradient norm: the loss stays where it started."""
    data = rows(loss=lambda s: 5.96 + 0.001 * (s % 3), grad_norm=lambda s: math.inf, **extra)
    for r in data:
        r["skipped_steps"] = r["step"]
    return data


def test_updates_skipped_throughout_get_one_rate_advice_not_a_lower_and_a_higher_rate():
    findings = diagnose(skipped_flat(), meta())
    assert names(findings) == ["non_finite"]  # the flat loss is the skipped updates, not a rate too low
    advised = {word for f in findings for word in f.fix.split() if word.startswith("optim.lr=")}
    assert advised == {"optim.lr=0.0001"}


def test_a_loss_that_climbs_and_never_falls_is_divergence_alone_not_also_a_rate_too_low():
    for loss in (lambda s: 5 + s / 50, lambda s: 5.0 if s < 100 else 9.0):
        findings = diagnose(rows(loss=loss), meta())
        assert names(findings) == ["loss_diverging"] and "optim.lr=0.000333" in findings[0].fix


def test_a_large_z_loss_is_named_as_the_cause_of_non_finite_steps_not_the_rate():
    (finding,) = diagnose(skipped_flat(z_loss=lambda s: 3.55e31), meta(train={"z_loss": 1e30}))
    assert finding.name == "non_finite" and "z_loss 3.55e+31 at step 10 (the loss 5.9610)" in finding.evidence
    assert finding.cause.startswith("train.z_loss=1e+30 is too large")
    assert finding.fix == "train.z_loss=1e-4 (PaLM's), or train.z_loss=0 to turn it off"
    (logged_only,) = diagnose(skipped_flat(z_loss=lambda s: math.inf), {})  # no run_meta.json: the rows say it
    assert logged_only.cause.startswith("the z-loss (train.z_loss) is too large")
    (small,) = diagnose(skipped_flat(z_loss=lambda s: 1e-3), meta(train={"z_loss": 1e-4}))
    assert "optim.lr=0.0001" in small.fix and "z_loss" not in small.fix


def test_without_run_meta_a_flat_loss_quotes_no_configuration_it_does_not_have():
    flat = rows(loss=lambda s: 5.0 + 0.001 * (s % 3))
    (finding,) = diagnose(flat, {})
    assert finding.name == "loss_not_falling" and "nan" not in finding.evidence + finding.fix
    assert finding.evidence.endswith("; learning rate 0.001") and "optim.lr=0.0003 (the default peak)" in finding.fix
    (diverging,) = diagnose(rows(loss=lambda s: 5 + s / 50), {})
    assert diverging.fix == "a lower optim.lr (a third), or a longer warmup (schedule.warmup_steps raised)"


def test_a_loss_above_the_untrained_models_is_divergence():
    data = rows(loss=lambda s: 5.0 if s != 40 else 9.0)
    finding = next(f for f in diagnose(data, meta()) if f.name == "loss_diverging")
    assert "9.0000 at step 40" in finding.evidence and "optim.lr=0.000333" in finding.fix


def test_a_loss_that_ends_above_its_best_is_divergence_and_one_spike_is_not():
    climbing = rows(loss=lambda s: 4.0 - s / 100 if s <= 100 else 3.0 + (s - 100) / 40)
    assert "loss_diverging" in names(diagnose(climbing, meta()))
    one_spike = rows(loss=lambda s: 8.0 * math.exp(-s / 100) + 2.0 + (1.0 if s == 190 else 0.0))
    assert diagnose(one_spike, meta()) == []


def test_a_flat_loss_blames_the_rate_and_names_repeated_data_when_epochs_pass():
    flat = rows(loss=lambda s: 6.0 + 0.01 * math.sin(s), grad_norm=lambda s: 1.2)  # clipped too: not reported
    (finding,) = diagnose(flat, meta())
    assert finding.name == "loss_not_falling" and "optim.lr=0.01" in finding.fix and "epochs" not in finding.evidence
    (repeated,) = diagnose(flat, meta(n_train_windows=640))  # 200 steps x 32 sequences over 640 windows
    assert "10.0 epochs" in repeated.evidence and "same batches seen again" in repeated.cause
    for r in flat:  # the tokens seen say it when the batch size changed during the run (a ramp)
        r["tokens_seen"] = r["step"] * 16 * 128
    (ramped,) = diagnose(flat, meta(n_train_windows=640, data={"seq_len": 128}))
    assert "5.0 epochs" in ramped.evidence
    (zero,) = diagnose(flat, meta(optim={"lr": 1e-9}))
    assert "optim.lr=0.0003" in zero.fix


def test_a_gradient_norm_rising_with_the_rate():
    (finding,) = diagnose(rows(grad_norm=lambda s: 0.1 * math.exp(s / 50)), meta(optim={"grad_clip": 0.0}))
    assert finding.name == "grad_norm_rising" and "optim.lr=0.000333" in finding.fix
    assert diagnose(rows(grad_norm=lambda s: 0.2 * (1 + s / 100)), meta(optim={"grad_clip": 0.0})) == []


def test_clipping_in_most_steps_is_found_and_now_and_then_is_not():
    (finding,) = diagnose(rows(grad_norm=lambda s: 1.5 if s % 30 else 0.9), meta())
    assert finding.name == "frequent_clipping" and "at 14 of 20 logged steps" in finding.evidence
    assert diagnose(rows(grad_norm=lambda s: 1.5 if s % 20 == 0 else 0.9), meta()) == []  # 10 of 20
    assert diagnose(rows(grad_norm=lambda s: 1.5), meta(optim={"grad_clip": 0.0})) == []  # no clipping


def per_layer(scale: dict[str, float]) -> dict:
    """Per-layer gradient norms of a 4-block model, a healthy tiny model's proportions, times ``scale``."""
    base = {"embed": 0.04, "block_00": 0.07, "block_01": 0.15, "block_02": 0.1, "block_03": 0.12, "final_norm": 0.04,
            "head": 0.66}
    return {f"grad_norm/{part}": (lambda s, v=value * scale.get(part, 1.0): v) for part, value in base.items()}


def test_one_layer_scaled_an_order_above_the_others_is_found_and_the_head_alone_is_not():
    assert diagnose(rows(**per_layer({})), meta()) == []  # the head at 10x a block: a healthy proportion
    (finding,) = diagnose(rows(**per_layer({"block_02": 15.0})), meta())
    assert finding.name == "layer_outlier" and "grad_norm/block_02 1.5" in finding.evidence
    (edge,) = diagnose(rows(**per_layer({"embed": 100.0})), meta())
    assert "grad_norm/embed" in edge.evidence


def test_a_growing_largest_logit_names_z_loss_when_the_run_has_the_key():
    growing = rows(max_abs_logit=lambda s: 10 + s / 2, z_loss=lambda s: s / 1000)
    (finding,) = diagnose(growing, meta())
    assert finding.name == "max_logit_growing" and "z_loss" in finding.evidence
    assert "model.arch=qwen3" in finding.fix and "train.z_loss" not in finding.fix
    (with_key,) = diagnose(growing, meta(train={"z_loss": 0.0}))
    assert "train.z_loss=1e-4" in with_key.fix
    (stronger,) = diagnose(growing, meta(train={"z_loss": 1e-4}))
    assert "a stronger train.z_loss=0.001" in stronger.fix
    assert diagnose(rows(max_abs_logit=lambda s: 2 + s / 20), meta()) == []  # grows, but stays small
    assert all("logit" not in line for f in diagnose(rows(), meta()) for line in f.lines())


def test_data_wait_above_five_percent_of_the_step_time_over_half_a_minute_of_steps():
    steps = range(10, 501, 10)  # 50 intervals of 1 s
    (finding,) = diagnose(rows(steps, data_time_s=lambda s: 0.02), meta())
    assert finding.name == "data_wait" and "data wait 20.0 % of 49.0 s" in finding.evidence
    assert diagnose(rows(steps, data_time_s=lambda s: 0.004), meta()) == []
    assert diagnose(rows(data_time_s=lambda s: 0.02), meta()) == []  # 19 s of steps: too short to judge


def test_validation_rising_while_training_falls_is_overfitting_on_repeated_data():
    data = rows() + [{"step": s, "val_loss": v} for s, v in ((50, 4.0), (100, 3.5), (150, 3.7), (200, 3.9))]
    (finding,) = diagnose(data, meta(n_train_windows=1000))
    assert finding.name == "val_rising" and "3.5000 at step 100 (best)" in finding.evidence
    assert "6.4 epochs" in finding.evidence and "train.max_steps=100" in finding.fix
    both_rise = rows(loss=lambda s: 3.0 + s / 1000) + [{"step": s, "val_loss": 3.0 + s / 500} for s in (50, 100, 150)]
    assert "val_rising" not in names(diagnose(both_rise, meta()))


def test_a_sustained_throughput_drop_is_found_and_a_short_dip_is_not():
    steps = range(10, 1001, 10)  # 100 intervals of 1 s
    (finding,) = diagnose(rows(steps, loss=lambda s: 3 - s / 1000, tokens_per_sec=lambda s: 1000 if s <= 500 else 400),
                          meta(train={"max_steps": 1000}))
    assert finding.name == "throughput_drop" and "over steps 510-1000" in finding.evidence
    dip = rows(steps, loss=lambda s: 3 - s / 1000, tokens_per_sec=lambda s: 300 if 500 <= s < 550 else 1000)
    assert diagnose(dip, meta(train={"max_steps": 1000})) == []  # 5 slow intervals: 5 s


def test_a_loss_jump_after_a_resume_and_frequent_rollbacks():
    launches = [{"start_step": 0, "resumed_from": None},
                {"start_step": 100, "resumed_from": "out/checkpoints/step_00000100"}]
    data = rows(loss=lambda s: 8.0 * math.exp(-s / 100) + 2.0 + (2.0 if s == 110 else 0.0))
    (finding,) = diagnose(data, meta(launches=launches))
    assert finding.name == "resume_jump" and "6.6630 at step 110" in finding.evidence
    assert diagnose(rows(), meta(launches=launches)) == []
    spiky = [{"start_step": 0, "resumed_from": None, "events": [{"kind": "rollback", "step": s} for s in (30, 80, 120)]}]
    assert names(diagnose(rows(), meta(launches=spiky))) == ["frequent_spikes"]


def test_a_metrics_file_being_written_is_read_without_its_partial_last_line(tmp_path):
    lines = [json.dumps(r) for r in rows()]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:25])
    assert len(read_rows(tmp_path / "metrics.jsonl")) == 20
    (tmp_path / "run_meta.json").write_text(json.dumps(meta()))
    assert diagnose_run(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text(lines[0][:25] + "\n" + "\n".join(lines) + "\n")
    with pytest.raises(UserError, match="line 1, is not a JSON object"):
        read_rows(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n")
    (tmp_path / "run_meta.json").write_text("{")
    with pytest.raises(UserError, match="run_meta.json is not valid JSON"):
        diagnose_run(tmp_path)


# ---------------------------------------------------------------------------------------------- real runs


def tiny_run(tmp_path, tiny_data, name: str, max_steps: int, *overrides: str):
    from lmrecipe.train.trainer import train

    out = tmp_path / name
    train(load_config("recipes/tiny.yaml", [
        f"out_dir={out}", f"data.path={tiny_data}", *TINY_OVERRIDES, f"train.max_steps={max_steps}",
        "logging.log_every_steps=2", f"train.eval_every_steps={max_steps // 2}", "checkpoint.every_steps=0",
        "checkpoint.resume=none", *overrides]))
    return out


def test_real_runs_a_rate_far_too_high_and_a_rate_of_zero_are_diagnosed_and_a_sane_one_is_not(tmp_path, tiny_data):
    hot = diagnose_run(tiny_run(tmp_path, tiny_data, "hot", 12, "optim.lr=0.5"))
    assert names(hot)[0] == "loss_diverging" and "optim.lr=0.167" in hot[0].fix
    cold = diagnose_run(tiny_run(tmp_path, tiny_data, "cold", 32, "optim.lr=1e-9", "optim.min_lr=0"))
    assert names(cold) == ["loss_not_falling"]  # its gradients sit above the clip, but the rate is not too high
    healthy = tiny_run(tmp_path, tiny_data, "healthy", 24)
    assert diagnose_run(healthy) == []
    report = (healthy / "report.md").read_text()
    assert "## Doctor" in report and "No findings" in report
    assert "loss_diverging" in (tmp_path / "hot" / "report.md").read_text()


@pytest.mark.parametrize("metrics, meta_text, message", [
    ("GOOD", "[1, 2]", "run_meta.json holds a JSON list, not the object train.py writes"),
    ("GOOD", '{"config": [1]}', 'run_meta.json holds a "config" that is no object'),
    ("42\nGOOD", None, "line 1, is not a JSON object: '42'"),
    ('{"loss": 2.5}\nGOOD', None, 'line 1, is a metrics row without an integer "step"'),
    ('{"step": "7", "val_loss": 2.5}\nGOOD', None, 'line 1, is a metrics row without an integer "step"'),
    (b"\xff\xfe\n", None, "line 1, is not a JSON object"),
    (b"GOOD\n\xffbad", b"\xff{}", "run_meta.json is not valid JSON"),  # a last line being written is left out
])
def test_damaged_run_files_are_refused_naming_the_file_and_the_fix(tmp_path, metrics, meta_text, message):
    good = json.dumps(rows()[0])
    metrics = metrics.replace(b"GOOD", good.encode()) if isinstance(metrics, bytes) else metrics.replace("GOOD", good)
    (tmp_path / "metrics.jsonl").write_bytes((metrics if isinstance(metrics, bytes) else metrics.encode()) + b"\n")
    meta_text = json.dumps(meta()) if meta_text is None else meta_text
    (tmp_path / "run_meta.json").write_bytes(meta_text if isinstance(meta_text, bytes) else meta_text.encode())
    with pytest.raises(UserError, match="restore it|Restore it") as err:
        diagnose_run(tmp_path)
    assert message in str(err.value)


def test_the_doctor_tool_exits_2_on_a_damaged_metrics_file(tmp_path, monkeypatch, capsys):
    import runpy
    import sys

    from helpers import ROOT
    (tmp_path / "metrics.jsonl").write_text('{"loss": 2.5}\n{"step": 1, "loss": 2.4}\n')
    monkeypatch.setattr(sys, "argv", ["doctor.py", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "tools" / "doctor.py"), run_name="__main__")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert 'without an integer "step"' in err and "Traceback" not in err
