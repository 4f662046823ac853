"""Per-rank memory budget of a recipe under each ZeRO stage, before running it.

    python tools/estimate_memory.py recipes/tiny.yaml --world-size 16 --nodes 2
    python tools/estimate_memory.py recipes/tiny.yaml model.num_layers=32 model.hidden_size=4096 \\
        --world-size 64 --nodes 8 --vocab-size 32000 --json

For each config (names in ds_configs/, none = no DeepSpeed) it prints weights, gradients and optimizer states
per rank, what stays in accelerator memory, what offload moves to each node's CPU memory, ZeRO-3's gathered
working set, and the activations of one micro-batch with and without activation checkpointing. The
formulas, and how they relate to the ZeRO paper and DeepSpeed's estimators, are in lmrecipe/planning/memory.py.
"""

import argparse
import json
import sys


from lmrecipe.cli import cli_main  # noqa: E402
from lmrecipe.planning.zero_comparison import (  # noqa: E402
    DEFAULT_CONFIGS,
    check_launch,
    config_for,
    config_label,
    ds_config_path,
    estimate_config,
    recipe_vocab_size,
    refusal_of,
)
from lmrecipe.errors import UserError, fail  # noqa: E402


@cli_main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    parser.add_argument("--world-size", type=int, default=8, help="processes (GPUs) in all (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the processes are spread over (default: %(default)s)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma-separated configs (default: %(default)s)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32", "fp8"), default=None,
                        help="training precision (default: the recipe's; its 'auto' is taken as bf16, i.e. a recent GPU)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="vocabulary size (default: model.vocab_size, else the one of the recipe's data folder)")
    parser.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    args = parser.parse_intermixed_args()  # options may come before or after the overrides

    from lmrecipe.planning.memory import format_estimates, model_shape
    from lmrecipe.model.build import build_hf_config  # noqa: PLC0415

    if args.nodes < 1:
        raise fail(f"--nodes={args.nodes} must be at least 1.")
    if args.world_size < 1 or args.world_size % args.nodes:
        raise fail(f"--world-size={args.world_size} must be a positive multiple of --nodes={args.nodes}.")
    if args.vocab_size is not None and args.vocab_size <= 0:
        raise fail(f"--vocab-size={args.vocab_size} must be positive.")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not names:
        raise fail("--configs is empty; name at least one config, e.g. --configs none,zero2.")
    # Each config is the recipe as training would run it: its DeepSpeed JSON, and a +option suffix's overrides
    # (zero2+muon, zero3+sp2, zero2+tp2); what training refuses of it, before its first step, is refused here.
    configs = [_config(args.recipe, args.overrides, name) for name in names]
    cfg = configs[0]
    precision = args.precision or (cfg.train.precision if cfg.train.precision != "auto" else "bf16")
    layouts = [_launch(name, c, args.world_size, args.nodes, precision) for name, c in zip(names, configs)]
    accum_steps = layouts[0].accum_steps
    shape = model_shape(build_hf_config(cfg.model, recipe_vocab_size(cfg.model, cfg.data, args.vocab_size), cfg.data.seq_len))
    rows = [(config_label(name), estimate_config(c.workload(), shape, ds_config_path(name), args.world_size, args.nodes,
                                                 precision))
            for name, c in zip(names, configs, strict=True)]

    setup = {
        "n_params": shape.n_params, "active_params": shape.active(), "expert_params": shape.expert_params,
        "largest_layer_params": shape.largest_layer_params,
        "world_size": args.world_size, "nodes": args.nodes, "precision": precision,
        "micro_batch_size": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len,
        "accum_steps": accum_steps,
        "gradient_checkpointing": cfg.train.gradient_checkpointing,
    }
    if args.json:
        print(json.dumps({**setup, "configs": {name: est.to_dict() for name, est in rows}}, indent=2))
        return 0
    active = f" ({shape.active() / 1e6:,.2f}M active per token)" if shape.expert_params else ""
    print(
        f"{shape.n_params / 1e6:,.2f}M parameters{active} (largest layer {shape.largest_layer_params / 1e6:,.2f}M) on "
        f"{args.world_size} ranks, {args.nodes} node(s) x {args.world_size // args.nodes}; precision {precision}; "
        f"micro-batch {cfg.train.micro_batch_size} x {cfg.data.seq_len} tokens, accumulation {accum_steps}; "
        f"activation checkpointing {'on' if cfg.train.gradient_checkpointing else 'off'} (device total uses it).\n"
    )
    print(format_estimates(rows))
    print("\nPer rank, except 'offloaded / node' (CPU memory of one node). Formulas: lmrecipe/planning/memory.py.")
    return 0


def _config(recipe: str, overrides: list[str], name: str):
    try:
        return config_for(recipe, overrides, name)
    except UserError as err:
        raise refusal_of(name, "is refused", err) from None


def _launch(name: str, cfg, world_size: int, nodes: int, precision: str):
    try:
        return check_launch(cfg.workload(), ds_config_path(name), world_size, nodes, precision)[1]
    except UserError as err:
        raise refusal_of(name, f"cannot train on --world-size {world_size}", err) from None


if __name__ == "__main__":
    sys.exit(main())
