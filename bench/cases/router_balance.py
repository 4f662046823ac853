"""Auxiliary-loss-free balancing: a tiny DeepSeek-V3 trained with the routing-bias update and without it, expert load
and losses over the run:

    .venv/bin/python bench/run.py router_balance --steps 60 --rate 0.01

Each side trains ``recipes/tiny.yaml`` in this process as a 4-layer MoE (8 routed experts, 2 per token, one shared,
no auxiliary loss): DeepSeek-V3 in 4 groups of which 2 allowed, ``bias`` at ``model.router_bias_update_rate=RATE``
and ``no bias`` at 0, beside a Qwen3.5-MoE balanced by its auxiliary loss. A step's imbalance is its busiest expert's
tokens over the mean (1 = even) averaged over the layers: reported over the run, its last tenth and its worst step.
"""

import logging
import statistics
import tempfile
from pathlib import Path

import _common as C

PAIRS = None
SHAPE = ["model.hidden_size=128", "model.num_layers=4", "model.num_heads=4", "model.intermediate_size=256",
         "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=8", "schedule.warmup_steps=10",
         "data.document_masking=false", "train.precision=fp32", "logging.log_every_steps=1", "logging.plots=false"]
MOE = ["model.num_experts=8", "model.experts_per_token=2", "model.expert_intermediate_size=64",
       "model.shared_experts=1"]
DEEPSEEK = ["model.arch=deepseek_v3", *MOE, "model.router_aux_loss_coef=0", "model.expert_groups=4",
            "model.expert_groups_per_token=2", "model.dense_layers=0", "model.q_lora_rank=0", "model.kv_lora_rank=32",
            "model.qk_nope_head_dim=16", "model.qk_rope_head_dim=16", "model.v_head_dim=32",
            "model.routed_scaling_factor=1.0"]


def options(parser) -> None:
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps of each run (default: %(default)s)")
    parser.add_argument("--rate", type=float, default=0.01, help="model.router_bias_update_rate of the bias side "
                        "(default: %(default)s; DeepSeek-V3's 0.001 is for runs of many thousand steps)")
    parser.add_argument("--aux", type=float, default=0.001, help="Qwen3.5-MoE's model.router_aux_loss_coef")


def train_side(args, overrides: list[str], out: Path) -> dict:
    from lmrecipe.observe.metrics_log import read_metrics
    from lmrecipe.train.trainer import train

    train(C.bench_config(args.recipe, [f"train.max_steps={args.steps}", f"train.eval_every_steps={args.steps}", *SHAPE,
                                       *overrides], str(out), args.data))
    rows = read_metrics(out / "metrics.jsonl")
    steps = [r for r in rows if "loss" in r]
    imbalance = [statistics.fmean(v for k, v in r.items() if k.startswith("load_balance/")) for r in steps]
    tail = imbalance[-max(1, len(imbalance) // 10):]
    return {"imbalance_mean": statistics.fmean(imbalance), "imbalance_last_tenth": statistics.fmean(tail),
            "imbalance_worst": max(imbalance), "first_loss": steps[0]["loss"], "last_loss": steps[-1]["loss"],
            "val_loss": [r["val_loss"] for r in rows if "val_loss" in r][-1],
            "aux_loss_last": steps[-1].get("aux_loss"), "imbalance_per_step": imbalance}


def run(args, report) -> None:
    logging.disable(logging.INFO)
    report.line(f"{args.steps} steps per side, 8 x 64 tokens per step, one process on this CPU; max/mean expert "
                "load (1 = even) averaged over the 4 MoE layers")
    sides = {"no bias": DEEPSEEK, "bias": [*DEEPSEEK, f"model.router_bias_update_rate={args.rate}"],
             "Qwen3.5 aux loss": ["model.arch=qwen3_5_moe_text", *MOE, f"model.router_aux_loss_coef={args.aux}"]}
    with tempfile.TemporaryDirectory(prefix="bench_router_balance_") as tmp:
        results = {side: train_side(args, overrides, Path(tmp) / side.replace(" ", "_").replace(".", ""))
                   for side, overrides in sides.items()}
    report.line()
    report.table(["side", "max/mean load, run mean", "last tenth", "worst step", "loss step 1", "last loss", "val loss"],
                 [[side, *(f"{r[k]:.3f}" for k in ("imbalance_mean", "imbalance_last_tenth", "imbalance_worst")),
                   *(f"{r[k]:.4f}" for k in ("first_loss", "last_loss", "val_loss"))] for side, r in results.items()])
    report.figures = {"steps": args.steps, "rate": args.rate, "aux": args.aux, "sides": results}
