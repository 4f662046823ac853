"""train.compile=layers: each decoder layer compiled in place trains as eager does, the layers sharing one graph with
no graph break, and no recompile as the document layout changes from batch to batch."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from helpers import ROOT, TINY_OVERRIDES

from lmrecipe.config import load_config
from lmrecipe.config.loader import config_from_dict, config_yaml
from lmrecipe.errors import UserError
from lmrecipe.model.build import compile_layers
from lmrecipe.parallel.launch import check_launch

TINY = ROOT / "recipes" / "tiny.yaml"
STEPS = 20


@pytest.mark.parametrize("written, mode", [("true", "model"), ("false", "none"), ("none", "none"), ("model", "model"),
                                           ("layers", "layers")])
def test_compile_is_a_choice_that_still_reads_the_old_switch(tmp_path, written, mode):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"base: {TINY}\ntrain:\n  compile: {written}\n")  # YAML reads true/false as booleans
    for cfg in (load_config(recipe), load_config(TINY, [f"train.compile={written}"])):
        assert cfg.train.compile == mode and bool(cfg.train.compile) is (mode != "none")
        saved = yaml.safe_load(config_yaml(cfg))  # a run folder's config.yaml, read back by a resume
        assert saved["train"]["compile"] == mode and type(saved["train"]["compile"]) is str
        assert config_from_dict(saved).train.compile == mode


def test_an_unknown_compile_choice_names_the_choices():
    with pytest.raises(UserError, match="train.compile='block' is not allowed. Choose one of: none, model, layers"):
        load_config(TINY, ["train.compile=block"])


def test_compiled_layers_are_refused_under_zero3_only():
    def launch(*overrides):
        cfg = load_config(TINY, [*TINY_OVERRIDES, *overrides])
        return check_launch(cfg.workload(), cfg.distributed.deepspeed_config_path(), 1, "fp32")

    refusal = "(?s)train.compile=layers cannot run under ZeRO-3 .*Choose train.compile=model"
    with pytest.raises(UserError, match=refusal):
        launch("train.compile=layers", "distributed.deepspeed_config=zero3")
    launch("train.compile=model", "distributed.deepspeed_config=zero3")
    for config in ("null", "zero1", "zero2"):
        launch("train.compile=layers", f"distributed.deepspeed_config={config}")


def test_each_decoder_layer_is_compiled_in_place():
    """The model keeps its modules, names and state dict (no ``_orig_mod.``): checkpoints and exports are the same."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                                         num_attention_heads=2, vocab_size=64))
    names, layers = list(model.state_dict()), list(model.model.layers)
    assert compile_layers(model) == 3
    assert list(model.state_dict()) == names and list(model.model.layers) == layers
    assert all(layer._compiled_call_impl is not None for layer in layers)
    assert all(getattr(m, "_compiled_call_impl", None) is None for m in (model, model.model, model.lm_head))
    with pytest.raises(UserError, match="has no decoder layers .* Choose train.compile=model"):
        compile_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def train_fp32(out_dir, data, compile_mode: str, deepspeed_config: str = "null") -> tuple[list[float], dict, set]:
    """``STEPS`` fp32 steps of the tiny model on short documents, in this process (of a run one step longer, so no
    validation runs: it would compile graphs of its own, without gradients). Returns the logged losses, the dynamo
    counters after step 1 and after the last step, and the distinct document layouts the training forwards saw."""
    from accelerate.state import AcceleratorState
    from torch._dynamo.utils import counters

    from lmrecipe.train import setup
    from lmrecipe.train.trainer import build_trainer

    AcceleratorState._reset_state(reset_partial_state=True)  # a DeepSpeed run needs an Accelerate state of its own
    torch._dynamo.reset()  # compiled from scratch: another run's graphs would serve these layers without a count
    counters.clear()
    cfg = load_config("recipes/tiny.yaml", [
        f"out_dir={out_dir}", f"data.path={data}", *TINY_OVERRIDES, f"train.max_steps={STEPS + 1}",
        "train.precision=fp32", "data.document_masking=true", "train.eval_every_steps=0", "checkpoint.every_steps=0",
        "checkpoint.resume=none", f"train.compile={compile_mode}", f"distributed.deepspeed_config={deepspeed_config}"])
    run = setup.build_run(cfg, out_dir)
    layouts = {tuple(batch.documents.cu_seqlens.tolist())
               for step in range(STEPS) for batch in run.train_batches.micro_batches(step)}
    trainer = build_trainer(run, out_dir)
    trainer.start()
    counts = {}
    try:
        for step in range(1, STEPS + 1):
            trainer.step()
            counts[step] = {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
                            "graph_breaks": sum(counters["graph_break"].values())}
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if "loss" in row], {1: counts[1], STEPS: counts[STEPS]}, layouts


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory, short_docs) -> list[float]:
    losses, counts, _ = train_fp32(tmp_path_factory.mktemp("eager"), short_docs, "none")
    assert counts[STEPS]["frames"] == 0  # eager compiles nothing
    return losses


def assert_layers_train_as_eager(out_dir, data, eager: list[float], deepspeed_config: str) -> None:
    compiled, counts, layouts = train_fp32(out_dir, data, "layers", deepspeed_config)
    assert len(layouts) > STEPS  # nearly every micro-batch has document boundaries of its own
    # The two layers share one graph (a second would be a recompile per layer), compiled at step 1 and never again.
    assert counts[1] == counts[STEPS] == {"frames": 1, "graphs": 1, "graph_breaks": 0}
    assert len(eager) == len(compiled) == STEPS
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 1e-5, (eager, compiled)


@pytest.mark.slow
def test_compiled_layers_train_as_eager(tmp_path, short_docs, eager_losses):
    assert_layers_train_as_eager(tmp_path, short_docs, eager_losses, "null")


@pytest.mark.slow
def test_compiled_layers_train_as_eager_under_zero2(tmp_path, short_docs, eager_losses, deepspeed_in_process):
    """ZeRO-2 against the eager run without DeepSpeed: in fp32 on one process its updates are the same."""
    assert_layers_train_as_eager(tmp_path, short_docs, eager_losses, "zero2")
