"""The run planner (lmrecipe/planning/, tools/plan.py): its arithmetic against hand-computed values, its shapes against
transformers' own models, bad input (exit 2), and the recipe it writes."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import replace

import pytest
from helpers import ROOT

from lmrecipe.config import load_config
from lmrecipe.parallel.topology import Topology, ZeroSetup
from lmrecipe.errors import UserError
from lmrecipe.planning.memory import estimate, format_bytes, model_shape
from lmrecipe.model.build import build_hf_config
from lmrecipe.observe.device import DEVICES
from lmrecipe.planning.budget import budget_flops, compute_optimal, make_plan, measured_mfu
from lmrecipe.planning.prediction import predict_run
from lmrecipe.planning.shapes import family_shape, shape_from_config, shapes_near
from lmrecipe.planning.write import recipe_overrides


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan_main():
    return _plan_tool().main


def _json_plan(capsys, *argv) -> dict:
    assert _plan_main()([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_budget_and_compute_optimal_split_by_hand():
    # 32 H100s (989 TFLOP/s bf16) at 40% MFU for 14 days: 32 * 989e12 * 0.4 * 14 * 86,400 s.
    assert budget_flops(32, 989.0, 0.4, 14) == pytest.approx(1.531256832e22, rel=1e-12)
    # C = 6 N D with D = 20 N: C = 1.2e21 gives N = sqrt(1e19), D = 20 N.
    params, tokens = compute_optimal(1.2e21, 20.0)
    assert params == pytest.approx(3.16227766e9, rel=1e-8) and tokens == pytest.approx(6.32455532e10, rel=1e-8)
    assert 6 * params * tokens == pytest.approx(1.2e21, rel=1e-12)


def test_the_family_at_width_4096_is_llama_3_8b():
    shape = family_shape(4096, 128_256)
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.intermediate_size, shape.tie_embeddings) == \
        (32, 32, 8, 14_336, False)
    assert shape.n_params == 8_030_261_248  # Llama 3 8B's published count
    # 6 x (parameters - input embedding) + 12 x layers x width x seq_len, at seq_len 8,192.
    assert shape.flops_per_token(8192) == 6 * (8_030_261_248 - 128_256 * 4096) + 12 * 32 * 4096 * 8192


@pytest.mark.parametrize("tied", [True, False])
def test_shape_arithmetic_matches_the_transformers_model(tied):
    cfg = load_config(ROOT / "recipes" / "tiny.yaml", ["model.hidden_size=256", "model.num_kv_heads=2",
                                                       f"model.tie_embeddings={str(tied).lower()}"])
    mine = shape_from_config(cfg.model, 1000).memory_shape()
    real = model_shape(build_hf_config(cfg.model, 1000, cfg.data.seq_len))
    assert sorted(mine.param_sizes) == sorted(real.param_sizes)
    assert mine == replace(real, param_sizes=mine.param_sizes)


def test_shapes_near_bracket_the_target_and_grow_with_it():
    shapes = shapes_near(1.2e9, 128_256)
    sizes = [s.n_params for s in shapes]
    assert len(shapes) == 3 and sizes == sorted(sizes) and sizes[0] < 1.2e9 < sizes[-1]
    nearest = min(shapes, key=lambda s: abs(math.log(s.n_params / 1.2e9)))
    assert nearest.hidden_size == 2048 and nearest.num_layers == 16  # the Llama 3.2 1B width and depth
    assert all(s.hidden_size % s.num_heads == 0 and s.num_heads % s.num_kv_heads == 0 for s in shapes)


def test_plan_from_params_by_hand(capsys):
    plan = _json_plan(capsys, "--gpus", "8", "--gpu", "a100", "--params", "1.2e9", "--vocab-size", "128256",
                      "--micro-batch", "4", "--cost-per-gpu-hour", "2.5")
    chosen = next(s for s in plan["shapes"] if s["n_params"] == plan["chosen"]["n_params"])
    # llama_1b's 512 x 2048 tokens per step, in micro-batches of 4 on 8 devices; 20 tokens per chosen parameter.
    assert plan["global_batch_size"] == 512 and plan["max_steps"] == math.ceil(20 * chosen["n_params"] / (512 * 2048))
    assert plan["compute_flops"] == pytest.approx(6 * 1.2e9 * 24e9, rel=1e-12)
    tokens_per_sec = 8 * 312e12 * 0.5 / chosen["flops_per_token"]  # A100 bf16 peak, 50% MFU
    assert plan["tokens_per_sec"] == pytest.approx(tokens_per_sec, rel=1e-12)
    wall = plan["max_steps"] * 512 * 2048 / tokens_per_sec
    assert plan["wall_seconds"] == pytest.approx(wall, rel=1e-12) and plan["cost"] == pytest.approx(8 * wall / 3600 * 2.5)
    # the most headroom among the stages that fit, for the shape nearest the optimum; the memory is the estimator's
    memory = chosen["device_bytes"]
    assert str(plan["chosen"]["stage"]) == min(memory, key=memory.get) == "3"
    shape = family_shape(chosen["hidden_size"], 128_256).memory_shape()
    stage3 = ZeroSetup.from_ds_config(json.loads((ROOT / "ds_configs" / "zero3.json").read_text()))
    expected = estimate(shape, stage3, 8, 1, "bf16", 16, 4, 2048, False, loss_chunk_tokens=1024).device_total
    assert memory["3"] == pytest.approx(expected, rel=1e-12)
    assert plan["chosen"]["headroom_bytes"] == pytest.approx(81_920 * 2**20 * 0.9 - expected, rel=1e-12)


def test_plan_from_days_fills_the_budget(capsys):
    plan = _json_plan(capsys, "--gpus", "32", "--gpu", "h100", "--days", "14", "--vocab-size", "128256",
                      "--gradient-checkpointing", "--mfu", "0.4")
    assert plan["compute_flops"] == pytest.approx(1.531256832e22, rel=1e-12)
    assert plan["optimal_params"] == pytest.approx(math.sqrt(1.531256832e22 / 120), rel=1e-12)
    assert plan["wall_seconds"] / 86_400 == pytest.approx(14, rel=1e-3)  # to within the last step


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0", "--days", "1"], "--gpus 0: a plan needs at least one device"),
    (["--gpus", "8", "--gpu", "tpu-v5", "--days", "1"], "--gpu 'tpu-v5' is not a device the planner knows"),
    (["--gpus", "8", "--days", "-3"], "--days -3.0 must be positive"),
    (["--gpus", "8"], "Give the budget as exactly one of --days"),
    (["--gpus", "8", "--days", "1", "--tokens", "1e9"], "not --days, --tokens"),
    (["--gpus", "8", "--days", "1", "--mfu", "1.5"], "--mfu 1.5 must be a fraction in (0, 1]"),
    (["--gpus", "8", "--days", "1", "--from-run", "/nonexistent/run"], "not a finished run's folder"),
    (["--gpus", "1", "--gpu", "l4", "--params", "1e12", "--micro-batch", "1"], "Nothing fits"),
])
def test_impossible_inputs_exit_2_with_one_paragraph(argv, message, capsys):
    assert _plan_main()(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("error: ")


def test_written_recipe_loads_and_is_the_chosen_configuration(tmp_path, capsys):
    path = tmp_path / "planned.yaml"
    plan = _json_plan(capsys, "--gpus", "8", "--gpu", "h100", "--params", "3e8", "--vocab-size", "32000",
                      "--cost-per-gpu-hour", "3", "--write-recipe", str(path))
    cfg = load_config(path)  # what train.py does with it
    chosen = next(s for s in plan["shapes"] if s["n_params"] == plan["chosen"]["n_params"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads, cfg.model.num_kv_heads,
            cfg.model.intermediate_size, cfg.model.vocab_size) == (
        chosen["hidden_size"], chosen["num_layers"], chosen["num_heads"], chosen["num_kv_heads"],
        chosen["intermediate_size"], 32000)
    assert cfg.train.max_steps == plan["max_steps"] and cfg.train.global_batch_size == plan["global_batch_size"]
    assert cfg.distributed.deepspeed_config == f"zero{plan['chosen']['stage']}"
    assert cfg.train.precision == "bf16" and cfg.logging.cost_per_device_hour == 3.0 and cfg.out_dir == "runs/planned"
    assert shape_from_config(cfg.model, 32000).n_params == plan["chosen"]["n_params"]
    assert [p.name for p in tmp_path.iterdir()] == ["planned.yaml"]  # no temporary file left
    # a short recipe on the base, saying where it came from; nothing lost against the base with every key set
    text = path.read_text()
    base = os.path.relpath(ROOT / "recipes" / "llama_1b.yaml", tmp_path)
    assert text.startswith("# Planned by python tools/plan.py --gpus 8 --gpu h100") and f"\nbase: {base}\n" in text
    assert len(text.splitlines()) < 25
    tool = _plan_tool()
    full = load_config(ROOT / "recipes" / "llama_1b.yaml", recipe_overrides(make_plan(tool.plan_inputs(tool.parse_args(
        ["--gpus", "8", "--gpu", "h100", "--params", "3e8", "--vocab-size", "32000", "--cost-per-gpu-hour", "3"]))),
        "runs/planned"))
    assert cfg.to_dict() == full.to_dict()


def test_the_plan_speaks_gib_of_the_cards_reported_memory_as_the_dry_run_does(capsys):
    # 8 H100 x 7 days: the card reports 79.2 GiB; 10% of it kept free; the estimate in GiB, as format_bytes writes it.
    plan = _json_plan(capsys, "--gpus", "8", "--gpu", "h100", "--days", "7")
    assert plan["memory_bytes"] == DEVICES["h100"].memory_bytes == 81_090 * 2**20
    assert _plan_main()(["--gpus", "8", "--gpu", "h100", "--days", "7"]) == 0
    text = capsys.readouterr().out
    device_bytes = plan["chosen"]["device_bytes"]
    assert format_bytes(device_bytes) == f"{device_bytes / 2**30:.1f} GiB"
    assert f"{device_bytes / 2**30:,.2f} GiB per device" in text and "79.2 GiB each (10% kept free)" in text
    assert f"fits {81_090 * 2**20 * 0.9 / 2**30:,.1f} GiB:" in text and " GB" not in text


def test_the_h100s_default_mfu_is_the_one_measured_on_an_h100():
    runs = sorted((ROOT / "bench" / "gpu" / "results").glob("*-h100.json"))
    # the best window of the latest levers sweep: the recipe's own set (varlen, Liger) on one H100
    measured = [max(w.get("mfu", 0.0) for w in stage["sides"]["levers"]["windows"].values())
                for run in runs for stage in json.loads(run.read_text())["stages"]
                if stage["stage"] == "levers" and stage["status"] == "measured"]
    assert measured and DEVICES["h100"].mfu == round(measured[-1], 3) == 0.411
    assert "measured" in DEVICES["h100"].mfu_source and "docs/benchmarks/gpu.md" in DEVICES["h100"].mfu_source


@pytest.mark.parametrize("n_params", [3.99e9, 1.2e9, 1e6, 1e12])
def test_shapes_near_are_three_distinct_shapes_around_the_target(n_params):
    shapes = shapes_near(n_params, 128_256)  # 3.99B, the 8 H100 x 7 days optimum, lies between two wide steps
    assert len(shapes) == len(set(shapes)) == 3 and [s.n_params for s in shapes] == sorted(s.n_params for s in shapes)


def test_from_run_takes_the_mfu_over_the_time_in_training_steps_of_the_logged_intervals(tmp_path):
    # (steps, seconds): 1 step in 6 s, 9 in 3 s, 10 in 1 s; MFU 0.06 per step per second
    rows = [{"step": step, "loss": 5.0, "mfu": 0.06 * steps / seconds, "interval_steps": steps, "interval_time_s": seconds}
            for step, steps, seconds in ((1, 1, 6.0), (10, 9, 3.0), (20, 10, 1.0))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match="not a finished run's folder"):
        measured_mfu(tmp_path)
    (tmp_path / "final.json").write_text("{}")
    assert measured_mfu(tmp_path)[0] == pytest.approx(0.06 * 20 / 10.0)  # report.md's MFU, not a mean of the rows


def test_run_prediction_by_hand(tmp_path):
    cfg = load_config(ROOT / "recipes" / "tiny.yaml")
    hf = build_hf_config(cfg.model, 8192, cfg.data.seq_len)
    fpt = 12_196_608.0  # the tiny recipe's flops_per_token at vocabulary 8,192
    (tmp_path / "memory_rank0.json").write_text(json.dumps({"total": 47_200_000}))
    out = predict_run(cfg.workload(), hf, topology=Topology(2), precision="fp32", accum_steps=1, flops_per_token=fpt,
                      peak_tflops=0.08, device_name=None, out_dir=tmp_path)
    assert out["mfu"] == DEVICES["cpu"].mfu == 0.4
    assert out["tokens_per_sec"] == pytest.approx(0.4 * 0.08e12 * 2 / fpt, rel=1e-12)
    assert out["step_time_s"] == pytest.approx(16 * 128 / out["tokens_per_sec"], rel=1e-12)
    expected = estimate(model_shape(hf), ZeroSetup(), 2, 1, "fp32", 1, 8, 128, False)
    assert out["peak_mem_gb"] == pytest.approx(expected.device_total / 1e9, rel=1e-12)
    assert out["model_states_gb"] == pytest.approx(expected.model_states / 1e9) and out["model_states_measured_gb"] == 0.0472
    h100 = predict_run(cfg.workload(), hf, topology=Topology(1), precision="bf16", accum_steps=2, flops_per_token=fpt,
                       peak_tflops=989.0, device_name="NVIDIA H100 80GB HBM3")
    assert h100["mfu"] == 0.411 and h100["model_states_measured_gb"] is None and "measured" in h100["mfu_source"]


# ---------------------------------------------------------------------------------------------- budgets out of range


@pytest.mark.parametrize("flag, value", [("--days", "inf"), ("--tokens", "inf"), ("--params", "inf"),
                                         ("--params", "nan"), ("--cost-per-gpu-hour", "inf"), ("--mfu", "nan")])
def test_a_non_finite_number_exits_2_naming_the_flag(flag, value, capsys):
    budget = [] if flag in ("--days", "--tokens", "--params") else ["--days", "1"]
    assert _plan_main()(["--gpus", "8", *budget, flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {float(value)} must be a finite number" in err and "Traceback" not in err, err


def test_a_budget_below_one_step_is_planned_with_a_warning_of_how_much_more_it_spends(capsys):
    assert _plan_main()(["--gpus", "8", "--days", "1e-12", "--json"]) == 0
    printed = capsys.readouterr()
    plan = json.loads(printed.out)
    asked_seconds = 1e-12 * 86_400
    assert plan["wall_seconds"] > 100 * asked_seconds and plan["max_steps"] == 1
    (warning,) = plan["warnings"]
    assert f"{plan['wall_seconds'] / asked_seconds:,.3g} times the asked --days 1e-12" in warning
    assert f"warning: {warning}" in printed.err
    assert _json_plan(capsys, "--gpus", "32", "--days", "14")["warnings"] == []  # a budget the plan fills


@pytest.mark.parametrize("argv", [["--gpus", "8", "--days", "1e9"], ["--gpus", "1000000000", "--days", "1"],
                                  ["--gpus", "8", "--params", "1e14"]])
def test_a_budget_beyond_the_largest_shape_is_named_as_such_not_as_too_few_devices(argv, capsys):
    assert _plan_main()(argv) == 2
    err = capsys.readouterr().err
    assert "beyond the largest shape the planner knows" in err and "more devices" not in err, err


def test_nothing_fits_suggests_more_devices_only_when_they_would_help(capsys):
    # 131,072-token windows: the activations alone exceed an L4 under ZeRO-3 on any number of devices.
    assert _plan_main()(["--gpus", "1", "--gpu", "l4", "--params", "3e9", "--seq-len", "131072",
                         "--micro-batch", "1"]) == 2
    err = capsys.readouterr().err
    assert "More devices would not help" in err and "use more devices" not in err, err
    assert _plan_main()(["--gpus", "1", "--gpu", "l4", "--params", "7e9"]) == 2
    assert "use more devices" in capsys.readouterr().err


def test_a_plan_without_zero_that_the_measured_peak_would_not_fit_says_so(capsys):
    # One device: ZeRO-3 divides nothing and adds the gathered layer, so no ZeRO leaves the most memory free.
    plan = _json_plan(capsys, "--gpus", "1", "--gpu", "h100", "--params", "5e8", "--vocab-size", "32000",
                      "--micro-batch", "26")
    assert plan["chosen"]["stage"] == 0
    over = plan["chosen"]["device_bytes"] * 1.21 > plan["memory_bytes"]
    assert _plan_main()(["--gpus", "1", "--gpu", "h100", "--params", "5e8", "--vocab-size", "32000",
                         "--micro-batch", "26"]) == 0
    assert ("Without DeepSpeed the measured peak was 1.21x the estimate" in capsys.readouterr().out) == over
    assert over  # the case this test is for
