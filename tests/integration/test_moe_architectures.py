"""DeepSeek-V3 and Qwen3.5-MoE runs (docs/moe.md): the tiny recipes train on a CPU; DeepSpeed AutoEP's expert
parallelism at size 2 on 2 processes equals one process on ZeRO-1 and 3 (tests/integration/test_moe.py runs the
default architecture on ZeRO-2 as well), and a checkpoint of size 2 resumes
exactly at size 1 (DeepSeek-V3's with its routing biases); each size-2 run's export loads with
``AutoModelForCausalLM`` and ``eval.py`` gives the run's validation loss; the memory estimate equals the measured
model states. Each run happens once per session (``cached_run``)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import ROOT, assert_same_run, cached_run, metric_rows, run_script, run_train, script_main

from lmrecipe.checkpoint.storage import step_dir_name
from lmrecipe.config import load_config
from lmrecipe.model.build import build_hf_config
from lmrecipe.planning.memory import model_shape, read_measured
from lmrecipe.planning.zero_comparison import ds_config_path, estimate_config

STEPS = 6
DEEPSEEK = ["model.arch=deepseek_v3", "model.num_experts=4", "model.experts_per_token=2", "model.hidden_size=32",
            "model.intermediate_size=64", "model.expert_intermediate_size=32", "model.shared_experts=1",
            "model.router_aux_loss_coef=0", "model.q_lora_rank=16", "model.kv_lora_rank=16",
            "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8", "model.v_head_dim=8", "model.expert_groups=2",
            "model.expert_groups_per_token=1", "model.dense_layers=1", "model.num_layers=3",
            "model.router_bias_update_rate=0.01"]
QWEN = ["model.arch=qwen3_5_moe_text", "model.num_experts=4", "model.experts_per_token=2", "model.hidden_size=32",
        "model.num_kv_heads=2", "model.expert_intermediate_size=32", "model.shared_experts=1",
        "model.full_attention_every=2", "model.linear_key_heads=2", "model.linear_value_heads=4",
        "model.linear_key_head_dim=8", "model.linear_value_head_dim=8", "data.document_masking=false"]
COMMON = [f"train.max_steps={STEPS}", "train.eval_every_steps=3", "train.precision=fp32", "checkpoint.every_steps=0"]
HALF = STEPS // 2
MEASURED = ((1, 1), (1, 2))
"""(stage, expert-parallel size) of the runs that measure their model states, save at step HALF and export at the
end."""
ARCHS = ("deepseek_v3", "qwen3_5_moe_text")


def autoep_run(tmp_path_factory, data, arch: str, stage: int, ep: int):
    """AutoEP at size ``ep`` on ``ep`` processes under ZeRO-``stage``."""
    keys = DEEPSEEK if arch == "deepseek_v3" else QWEN
    extra = (["logging.measure_model_states=true", "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32",
              f"checkpoint.every_steps={HALF}"] if (stage, ep) in MEASURED else [])
    return cached_run(tmp_path_factory, f"{arch}_ep{ep}_zero{stage}", data, [
        *keys, *COMMON, f"distributed.deepspeed_config=zero{stage}", "distributed.expert_layer=autoep",
        f"distributed.expert_parallel_size={ep}", *extra], nproc=ep)


@pytest.mark.parametrize("recipe", ["tiny_deepseek_v3", "tiny_qwen3_5_moe"])
def test_the_tiny_recipe_trains_on_a_cpu(tmp_path, tiny_data, recipe):
    out = tmp_path / "run"
    run_script(["train.py", f"recipes/{recipe}.yaml", f"out_dir={out}", f"data.path={tiny_data}", "data.seq_len=32",
                "data.val_windows=8", "train.global_batch_size=8", "train.micro_batch_size=8", "train.max_steps=8",
                "schedule.warmup_steps=2", "train.eval_every_steps=8", "checkpoint.every_steps=0",
                "checkpoint.export_at_end=false", "logging.log_every_steps=1", "logging.plots=false",
                "logging.progress_bar=false"])
    losses = metric_rows(out, "loss")
    assert sorted(losses) == list(range(1, 9)) and all(math.isfinite(v) for v in losses.values())
    print(f"{recipe}: loss {losses[1]:.4f} -> {losses[8]:.4f}")
    assert losses[8] < losses[1] - 0.05


@pytest.fixture(scope="module")
def deepseek_reference(tmp_path_factory, tiny_data):
    """One process, AutoEP at size 1 (every expert on the rank), ZeRO-1."""
    return autoep_run(tmp_path_factory, tiny_data, "deepseek_v3", 1, 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_deepseek_v3_expert_parallel_2_equals_one_process(tmp_path_factory, tiny_data, deepseek_reference, stage):
    run, stderr = autoep_run(tmp_path_factory, tiny_data, "deepseek_v3", stage, 2)
    for key in ("loss", "grad_norm", "val_loss"):
        got, want = metric_rows(run, key), metric_rows(deepseek_reference, key)
        print(f"deepseek_v3 ZeRO-{stage} ep2: max |{key} difference| = {max(abs(got[s] - want[s]) for s in want):.3g}")
    assert_same_run(run, deepseek_reference, 1e-5)
    assert "AutoEP expert parallel 2: expert groups [0-1]" in stderr


def resumed_at_size_1(tmp_path, tmp_path_factory, data, arch: str):
    """The size-2 ZeRO-1 run of ``arch`` and its step-HALF checkpoint resumed on 1 process at size 1 (run folders)."""
    source, _ = autoep_run(tmp_path_factory, data, arch, 1, 2)
    out = tmp_path / "resumed"
    proc = run_train(out, data, [*(DEEPSEEK if arch == "deepseek_v3" else QWEN), *COMMON,
                                 "distributed.deepspeed_config=zero1", "distributed.expert_layer=autoep",
                                 "distributed.expert_parallel_size=1",
                                 f"checkpoint.resume={source / 'checkpoints' / step_dir_name(HALF)}"])
    assert "expert parallel 2 -> 1" in proc.stderr
    return source, out


def routing_biases_at(run, step: int) -> list:
    return json.loads((run / "checkpoints" / step_dir_name(step) / "train_state.json").read_text())[
        "extras"]["routing_bias"]["biases"]


@pytest.mark.slow
def test_deepseek_v3_resumes_onto_another_expert_parallel_size_with_its_routing_bias(
        tmp_path, tmp_path_factory, tiny_data, deepseek_reference):
    """The size-2 ZeRO-1 run's step-HALF checkpoint, resumed on 1 process at size 1, continues the one-process run:
    its losses, and the routing biases the update moved every step (equal on every rank, so equal across sizes)."""
    source, out = resumed_at_size_1(tmp_path, tmp_path_factory, tiny_data, "deepseek_v3")
    assert_same_run(out, deepseek_reference, 1e-5, first_step=HALF + 1)
    moved, start = routing_biases_at(out, STEPS), routing_biases_at(source, HALF)
    assert moved != start, "the bias did not move after the resume"
    want = routing_biases_at(deepseek_reference, STEPS)
    flat = [v for layer in moved for v in layer]
    print(f"deepseek_v3 ep2 -> ep1 resume: max |routing bias difference| = "
          f"{max(abs(a - b) for a, b in zip(flat, [v for layer in want for v in layer])):.3g}")
    assert [len(layer) for layer in moved] == [len(layer) for layer in want]
    assert flat == pytest.approx([v for layer in want for v in layer], abs=1e-6)


@pytest.fixture(scope="module")
def qwen_reference(tmp_path_factory, tiny_data):
    """One process, AutoEP at size 1, ZeRO-1."""
    return autoep_run(tmp_path_factory, tiny_data, "qwen3_5_moe_text", 1, 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_qwen3_5_moe_expert_parallel_2_equals_one_process(tmp_path_factory, tiny_data, qwen_reference, stage):
    run, stderr = autoep_run(tmp_path_factory, tiny_data, "qwen3_5_moe_text", stage, 2)
    for key in ("loss", "grad_norm", "val_loss", "aux_loss"):
        got, want = metric_rows(run, key), metric_rows(qwen_reference, key)
        print(f"qwen3_5_moe_text ZeRO-{stage} ep2: max |{key} difference| = "
              f"{max(abs(got[s] - want[s]) for s in want):.3g}")
    assert_same_run(run, qwen_reference, 1e-5)
    got, want = metric_rows(run, "aux_loss"), metric_rows(qwen_reference, "aux_loss")
    assert sorted(got) == list(range(1, STEPS + 1)) and max(abs(got[s] - want[s]) for s in want) <= 1e-5
    assert "AutoEP expert parallel 2: expert groups [0-1]" in stderr


@pytest.mark.slow
def test_qwen3_5_moe_resumes_onto_another_expert_parallel_size(tmp_path, tmp_path_factory, tiny_data, qwen_reference):
    """The size-2 ZeRO-1 run's step-HALF checkpoint, resumed on 1 process at size 1, continues the one-process run."""
    _, out = resumed_at_size_1(tmp_path, tmp_path_factory, tiny_data, "qwen3_5_moe_text")
    got, want = metric_rows(out, "loss"), metric_rows(qwen_reference, "loss")
    print(f"qwen3_5_moe_text ep2 -> ep1 resume: max |loss difference| = "
          f"{max(abs(got[s] - want[s]) for s in got):.3g}")
    assert_same_run(out, qwen_reference, 1e-5, first_step=HALF + 1)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_the_export_loads_and_evaluates_to_the_runs_validation_loss(tmp_path_factory, tiny_data, arch):
    """The size-2 run's export (consolidated from the expert-parallel shards)."""
    from transformers import AutoModelForCausalLM

    run, _ = autoep_run(tmp_path_factory, tiny_data, arch, 1, 2)
    export = run / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["model_type"] == arch
    model, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    if arch == "deepseek_v3":
        assert config["n_routed_experts"] == 4 and config["kv_lora_rank"] == 16
        assert model.model.layers[2].mlp.shared_experts.gate_proj.weight.shape == (32, 32)
    else:
        assert config["num_experts"] == 4 and config["layer_types"][:2] == ["linear_attention", "full_attention"]
    proc = run_script(["eval.py", str(export), "--data", str(tiny_data), "--max-batches", "2", "--batch-size", "8"])
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    val_loss = metric_rows(run, "val_loss")[STEPS]
    print(f"{arch} export: eval.py {result['loss']:.7f}, the run's validation loss {val_loss:.7f}")
    assert result["loss"] == pytest.approx(val_loss, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stage, ep", MEASURED)
def test_the_memory_estimate_equals_the_measured_model_states(tmp_path_factory, tiny_data, arch, stage, ep):
    run, _ = autoep_run(tmp_path_factory, tiny_data, arch, stage, ep)
    cfg = load_config(run / "config.yaml")
    shape = model_shape(build_hf_config(cfg.model, json.loads((tiny_data / "meta.json").read_text())["vocab_size"],
                                        cfg.data.seq_len))
    estimate = estimate_config(cfg.workload(), shape, ds_config_path(f"zero{stage}"), ep, 1, "fp32")
    measured = read_measured(run)
    assert len(measured) == ep
    for rank in measured:
        print(f"{arch} ZeRO-{stage} ep{ep}: model states measured {rank['total'] / 1e6:.4f} MB, "
              f"estimated {estimate.model_states / 1e6:.4f} MB")
        assert rank["total"] == pytest.approx(estimate.model_states, rel=1e-3)


def _tool_main(script: str):
    return script_main(script)


@pytest.mark.parametrize("recipe, vocab, total, ranks, nodes", [
    ("deepseek_v3_671b", 129280, "671026.40M", 1024, 128), ("qwen3_5_35b_a3b", 248320, "34660.61M", 16, 2)])
def test_the_recipes_of_the_published_shapes_pass_the_dry_run_the_estimator_and_the_planner(
        tiny_data, monkeypatch, capsys, recipe, vocab, total, ranks, nodes):
    """In the test process: ``train.py --dry-run``'s checks and lines at the recipe's scale (WORLD_SIZE as a launcher
    sets it), ``tools/estimate_memory.py`` and ``tools/plan.py --model-from-recipe``."""
    from lmrecipe.train.dry_run import dry_run

    monkeypatch.setenv("WORLD_SIZE", str(ranks))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks // nodes))
    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml", [
        f"data.path={tiny_data}", f"model.vocab_size={vocab}", "model.vocab_beyond_data=true", "train.precision=bf16",
        "data.val_windows=1", "data.seq_len=64"])
    report = dry_run(cfg)
    assert not report.problems and any(f"model {total} params" in line for line in report.lines), report.lines
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    tool = f"recipes/{recipe}.yaml"
    monkeypatch.setattr("sys.argv", ["tools/estimate_memory.py", tool, f"data.path={tiny_data}", "--vocab-size",
                                     str(vocab), "--world-size", str(ranks), "--nodes", str(nodes), "--configs",
                                     "zero3", "--json"])
    assert _tool_main("tools/estimate_memory.py")() == 0
    memory = json.loads(capsys.readouterr().out)
    assert 0 < memory["configs"]["zero3"]["device_total"] < 80 * 2**30
    assert memory["active_params"] < memory["n_params"]
    assert _tool_main("tools/plan.py")(["--gpus", str(ranks), "--gpu", "h100", "--recipe", tool, "--model-from-recipe",
                                        "--tokens", "1e12", "--vocab-size", str(vocab), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["chosen"]["n_params"] == memory["n_params"] and plan["chosen"]["stage"] == 3
