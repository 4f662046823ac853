"""Expert parallelism 2 against 1 (DeepSpeed AutoEP) on 2 processes: step time and model states per rank, interleaved.

The recipe widened so that the experts hold about 3/4 of the weights; each side one ``tools/compare_zero.py`` run
(``run_comparison``), in alternating order (docs/benchmarks/17-expert-parallel.md).
"""

import logging
import statistics
import tempfile
from pathlib import Path

import _common as C

PAIRS = 4
RECIPE = "recipes/tiny_moe.yaml"
WIDE = ["model.hidden_size=128", "model.num_layers=4", "model.intermediate_size=256", "model.num_experts=8",
        "model.expert_intermediate_size=512", "train.global_batch_size=16", "train.micro_batch_size=8",
        "distributed.expert_layer=autoep", "logging.plots=false"]


def options(parser) -> None:
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each run (default: %(default)s)")
    parser.add_argument("--zero", default="zero1", choices=["zero1", "zero2", "zero3"],
                        help="the DeepSpeed config of both sides (default: %(default)s)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for both")


def name(args) -> str:
    return f"moe_ep_{args.zero}"


def run(args, report) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from lmrecipe.config import load_config
    from lmrecipe.model.build import build_hf_config
    from lmrecipe.planning.zero_comparison import recipe_vocab_size, run_comparison

    logging.disable(logging.INFO)
    overrides = [*WIDE, f"data.path={args.data}", *args.set]
    sides = {"EP1": args.zero, "EP2": f"{args.zero}+ep2"}
    cfg = load_config(args.recipe, [*overrides, f"distributed.deepspeed_config={args.zero}"])
    with torch.device("meta"):  # all parameters, and those in experts
        hf_config = build_hf_config(cfg.model, recipe_vocab_size(cfg.model, cfg.data), cfg.data.seq_len)
        params = dict(AutoModelForCausalLM.from_config(hf_config).named_parameters())
    total = sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    report.line(f"model: {total / 1e6:.2f}M parameters, {experts / 1e6:.2f}M ({experts / total:.0%}) in experts; "
                f"{tokens_per_step} tokens per step; {args.steps} steps per run on 2 processes, {args.zero}")
    with tempfile.TemporaryDirectory(prefix="bench_moe_ep_") as tmp:
        def measure(side: str):
            (result,) = run_comparison(args.recipe, overrides, [sides[side]], args.steps, 2, Path(tmp) / side,
                                       overwrite=True)
            if result.status != "ok":
                raise SystemExit(f"{side} ({sides[side]}) {result.status}: see the log under {tmp}")
            return result

        results, stats = C.interleave(report, args.pairs, tuple(sides), measure,
                                      {"EP2/EP1": lambda g: g["EP2"].tokens_per_sec / g["EP1"].tokens_per_sec},
                                      lambda g: "tokens/s " + ", ".join(f"{s} {r.tokens_per_sec:,.0f}" for s, r in g.items()))
    tokens = {side: [r.tokens_per_sec for r in rs] for side, rs in results.items()}
    states = {side: (rs[0].model_states_measured_mb, rs[0].model_states_estimated_mb, rs[0].final_loss)
              for side, rs in results.items()}
    rows = []
    for side in sides:
        median, (measured, estimated, loss) = statistics.median(tokens[side]), states[side]
        rows.append([f"{side} ({sides[side]})", f"{median:,.0f}", f"{1e3 * tokens_per_step / median:.1f}",
                     f"{measured:.2f}", f"{estimated:.2f}", f"{loss:.4f}"])
    report.table(["side", "tokens/s (median)", "step time (ms)", "model states per rank, measured (MB)",
                  "estimated (MB)", "final loss"], rows)
    report.line(f"EP2 / EP1 tokens/s: {C.fmt_ratio(stats['EP2/EP1'])}; model states per rank EP2 / EP1: "
                f"{states['EP2'][0] / states['EP1'][0]:.3f} (estimated {states['EP2'][1] / states['EP1'][1]:.3f})")
    report.figures = {"zero": args.zero, "steps": args.steps, "tokens_per_step": tokens_per_step, "params": total,
                      "expert_params": experts, "tokens_per_sec": tokens, "ep2_over_ep1": stats["EP2/EP1"],
                      "model_states_mb": {k: {"measured": v[0], "estimated": v[1]} for k, v in states.items()},
                      "final_loss": {k: v[2] for k, v in states.items()}}
