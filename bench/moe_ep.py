"""Expert parallelism 2 against 1 (DeepSpeed AutoEP) on 2 processes: step time and model states per rank, interleaved.

    .venv/bin/python bench/moe_ep.py                       # 4 rounds of both sides, 30 steps each, ZeRO-1
    .venv/bin/python bench/moe_ep.py --pairs 6 --zero zero2 --steps 40

Both sides train ``recipes/tiny_moe.yaml`` widened so that the experts hold most of the parameters (4 layers of
8 experts of width 512 on a 128-wide model: the experts are about 3/4 of the weights) on 2 processes with
``distributed.expert_layer=autoep``: at ``expert_parallel_size=1`` each rank holds every expert (data parallel),
at 2 each holds 4 of every layer's 8 and the tokens travel to their experts by all-to-all. The global batch, the
data and the losses are the same (``tests/integration/test_moe.py`` proves the equality); what changes is where the
experts live and what moves.

Each side is one ``tools/compare_zero.py`` run (``lmrecipe.planning.zero_comparison.run_comparison``), launched in alternating order
(A B, B A, ...). Per round: tokens/s of each side (the median over logged steps after the first, both processes
together), and the ratio EP2 / EP1. Per rank: the model states measured from the tensors during the second step
(weights, gradients, optimizer states of the largest rank) beside ``lmrecipe.planning.memory``'s estimate. The figures are
the median ratio over the rounds with its min and max.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

import _common as C  # noqa: E402

RECIPE = "recipes/tiny_moe.yaml"
WIDE = ["model.hidden_size=128", "model.num_layers=4", "model.intermediate_size=256", "model.num_experts=8",
        "model.expert_intermediate_size=512", "train.global_batch_size=16", "train.micro_batch_size=8",
        "distributed.expert_layer=autoep", "logging.plots=false"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4, help="interleaved rounds of both sides (default: %(default)s)")
    parser.add_argument("--output", default=None, help="folder for the .txt/.json results (default: bench/results)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of each run (default: %(default)s)")
    parser.add_argument("--zero", default="zero1", choices=["zero1", "zero2", "zero3"],
                        help="the DeepSpeed config of both sides (default: %(default)s)")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for both")
    args = parser.parse_args()
    C.check_data(args.data)
    logging.disable(logging.INFO)
    from lmrecipe.planning.zero_comparison import run_comparison
    from lmrecipe.config import load_config
    from transformers import AutoModelForCausalLM

    from lmrecipe.data.format import load_meta
    from lmrecipe.model.build import build_hf_config

    overrides = [*WIDE, f"data.path={args.data}", *args.set]
    sides = {"EP1": args.zero, "EP2": f"{args.zero}+ep2"}
    report = C.Report(f"moe_ep_{args.zero}", "cpu", args.output)
    cfg = load_config(RECIPE, [*overrides, f"distributed.deepspeed_config={args.zero}"])
    import torch

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_hf_config(cfg.model, load_meta(args.data)["vocab_size"],
                                                                 cfg.data.seq_len))
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
    report.line(f"model: {total / 1e6:.2f}M parameters, {experts / 1e6:.2f}M ({experts / total:.0%}) in experts; "
                f"{tokens_per_step} tokens per step; {args.steps} steps per run on 2 processes, {args.zero}")
    tokens: dict[str, list[float]] = {name: [] for name in sides}
    ratios, states = [], {}
    with tempfile.TemporaryDirectory(prefix="bench_moe_ep_") as tmp:
        for i, order in enumerate(C.pair_orders(args.pairs, tuple(sides)), start=1):
            got = {}
            for name in order:
                (result,) = run_comparison(RECIPE, overrides, [sides[name]], args.steps, 2, Path(tmp) / f"r{i}",
                                           overwrite=True)
                if result.status != "ok":
                    raise SystemExit(f"{name} ({sides[name]}) {result.status}: see the log under {tmp}")
                got[name] = result.tokens_per_sec
                tokens[name].append(result.tokens_per_sec)
                states.setdefault(name, (result.model_states_measured_mb, result.model_states_estimated_mb,
                                         result.final_loss))
            ratios.append(got["EP2"] / got["EP1"])
            report.line(f"round {i} ({' '.join(order)}): tokens/s EP1 {got['EP1']:,.0f}, EP2 {got['EP2']:,.0f}, "
                        f"EP2/EP1 {ratios[-1]:.3f}")
    stats = C.ratio_stats(ratios)
    report.line()
    report.line("| side | tokens/s (median of rounds) | step time (ms) | model states per rank, measured (MB) | "
                "estimated (MB) | final loss |")
    report.line("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in sides:
        median = statistics.median(tokens[name])
        measured, estimated, loss = states[name]
        report.line(f"| {name} ({sides[name]}) | {median:,.0f} | {1e3 * tokens_per_step / median:.1f} | "
                    f"{measured:.2f} | {estimated:.2f} | {loss:.4f} |")
    report.line()
    report.line(f"EP2 / EP1 tokens/s: {C.fmt_ratio(stats)}; model states per rank EP2 / EP1: "
                f"{states['EP2'][0] / states['EP1'][0]:.3f} (estimated {states['EP2'][1] / states['EP1'][1]:.3f})")
    report.figures = {"zero": args.zero, "steps": args.steps, "tokens_per_step": tokens_per_step,
                      "params": total, "expert_params": experts, "tokens_per_sec": tokens,
                      "ep2_over_ep1": stats, "model_states_mb": {k: {"measured": v[0], "estimated": v[1]}
                                                                   for k, v in states.items()},
                      "final_loss": {k: v[2] for k, v in states.items()}}
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
