"""Turn a device budget into a run: compute, the compute-optimal size, Llama shapes near it, memory, wall time.

    python tools/plan.py --gpus 32 --gpu h100 --days 14
    python tools/plan.py --gpus 8 --gpu a100 --params 1.2e9 --cost-per-gpu-hour 2.0 --write-recipe recipes/planned.yaml
    python tools/plan.py --gpus 1 --gpu cpu --recipe recipes/tiny.yaml --model-from-recipe --tokens 614400

Exactly one of --days, --tokens and --params (or --params with --tokens). The MFU is the device's default (a
table with its sources, lmrecipe/observe/device.py), --mfu, or --from-run RUN: the measured MFU of a finished run. The
arithmetic and its sources are in lmrecipe/planning/budget.py; memory comes from lmrecipe/planning/memory.py (tools/estimate_memory.py).
"""

import argparse
import json
import math
import shlex
import sys
from pathlib import Path


from lmrecipe.cli import check_tool_output, cli_main  # noqa: E402
from lmrecipe.errors import fail  # noqa: E402

DEFAULT_RECIPE = "recipes/llama_1b.yaml"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides of the base recipe (--recipe)")
    parser.add_argument("--gpus", type=int, required=True, help="devices in all (GPUs; processes for --gpu cpu)")
    parser.add_argument("--gpu", default="h100", help="device kind: h100, h100-pcie, h200, a100, a100-40gb, l40s, a10g, "
                        "l4 or cpu (default: %(default)s)")
    budget = parser.add_argument_group("budget (one of --days, --tokens, --params; or --params with --tokens)")
    budget.add_argument("--days", type=float, help="wall-clock days of the devices")
    budget.add_argument("--tokens", type=float, help="training tokens, e.g. 2e11")
    budget.add_argument("--params", type=float, help="model parameters, e.g. 1.2e9")
    parser.add_argument("--mfu", type=float, help="model FLOPs utilisation in (0, 1] (default: the device's table value)")
    parser.add_argument("--from-run", metavar="RUN", help="take the MFU measured by a finished run (its out_dir)")
    parser.add_argument("--tokens-per-param", type=float, default=20.0,
                        help="compute-optimal tokens per parameter (default: %(default)s, Hoffmann et al. 2022)")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE,
                        help="base recipe: data, optimizer, schedule, batch in tokens (default: %(default)s)")
    parser.add_argument("--model-from-recipe", action="store_true",
                        help="plan the base recipe's own model instead of shapes near the optimum")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the recipe's data.seq_len)")
    parser.add_argument("--micro-batch", type=int, help="sequences per device per forward (default: the recipe's)")
    parser.add_argument("--gradient-checkpointing", action="store_true", default=None,
                        help="recompute activations (default: the recipe's train.gradient_checkpointing)")
    parser.add_argument("--vocab-size", type=int, help="vocabulary (default: the recipe's, its data's, else 128,256)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"),
                        help="default: the recipe's; its 'auto' is bf16 on GPUs, fp32 on a CPU")
    parser.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (default: the table / a CPU probe)")
    parser.add_argument("--memory-gib", type=float, help="memory per device in GiB (2^30 bytes; default: what the card "
                        "reports, from the table; on a CPU the host's RAM over --gpus)")
    parser.add_argument("--reserve", type=float, default=0.10,
                        help="share of device memory kept free of the estimate (default: %(default)s; "
                        "lmrecipe/planning/budget.py says why)")
    parser.add_argument("--cost-per-gpu-hour", type=float, help="price of one device for one hour")
    parser.add_argument("--write-recipe", metavar="PATH", help="write the chosen configuration as a recipe YAML")
    parser.add_argument("--overwrite", action="store_true", help="replace the --write-recipe file if it exists")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser.parse_intermixed_args(argv)  # options may come before or after the overrides


def check_numbers(args: argparse.Namespace) -> None:
    """Every number the plan divides by or multiplies with is finite and in range; else one message naming the flag."""
    for name, value in vars(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise fail(f"--{name.replace('_', '-')} {value} must be a finite number: the plan computes sizes, steps and "
                       "costs from it.")
    if args.gpus < 1:
        raise fail(f"--gpus {args.gpus}: a plan needs at least one device. Pass --gpus 1 or more.")
    given = [name for name in ("days", "tokens", "params") if getattr(args, name) is not None]
    if not given or ("days" in given and len(given) > 1):
        raise fail("Give the budget as exactly one of --days D, --tokens T or --params N (or --params with --tokens), "
                   f"not {', '.join('--' + g for g in given) or 'none of them'}.")
    for name in given + ["tokens_per_param"]:
        if not getattr(args, name) > 0:
            raise fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive.")
    for name in ("seq_len", "micro_batch", "vocab_size", "peak_tflops", "memory_gib"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be positive.")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise fail(f"--mfu {args.mfu} must be a fraction in (0, 1], e.g. 0.4 for 40%.")
    if args.mfu is not None and args.from_run:
        raise fail("--mfu and --from-run both set the MFU: pass one.")
    if not 0 <= args.reserve < 1:
        raise fail(f"--reserve {args.reserve} must be in [0, 1), e.g. 0.1 keeps 10% of device memory free.")
    if args.cost_per_gpu_hour is not None and args.cost_per_gpu_hour < 0:
        raise fail(f"--cost-per-gpu-hour {args.cost_per_gpu_hour} must be zero or positive.")


def plan_inputs(args: argparse.Namespace):
    from lmrecipe.config import load_config
    from lmrecipe.data.format import load_meta
    from lmrecipe.planning.budget import (
        DEFAULT_VOCAB_SIZE,
        PlanInputs,
        device_spec,
        GiB,
        host_memory_bytes,
        measured_mfu,
        peak_tflops,
    )

    device = device_spec(args.gpu)
    base = load_config(args.recipe, args.overrides)
    cpu = device.name == "cpu"
    precision = args.precision or (base.train.precision if base.train.precision != "auto" else "fp32" if cpu else "bf16")
    folder = Path(base.data.source_list()[0].path)
    vocab = args.vocab_size or base.model.vocab_size or (
        int(load_meta(folder)["vocab_size"]) if (folder / "meta.json").is_file() else DEFAULT_VOCAB_SIZE)
    mfu, mfu_source = (args.mfu, "--mfu") if args.mfu is not None else \
        measured_mfu(args.from_run) if args.from_run else (device.mfu, device.mfu_source)
    return PlanInputs(
        devices=args.gpus, device=device, precision=precision,
        peak_tflops=args.peak_tflops or peak_tflops(device, precision),
        memory_bytes=args.memory_gib * GiB if args.memory_gib else (
            host_memory_bytes() / args.gpus if cpu else device.memory_bytes),  # CPU: shared RAM
        mfu=mfu, mfu_source=mfu_source,
        base=base, vocab_size=vocab, seq_len=args.seq_len or base.data.seq_len,
        micro_batch_size=args.micro_batch or base.train.micro_batch_size,
        gradient_checkpointing=base.train.gradient_checkpointing if args.gradient_checkpointing is None else True,
        days=args.days, tokens=args.tokens, params=args.params, tokens_per_param=args.tokens_per_param,
        cost_per_device_hour=args.cost_per_gpu_hour, reserve=args.reserve, model_from_recipe=args.model_from_recipe,
        micro_batch_fixed=args.micro_batch is not None, checkpointing_fixed=args.gradient_checkpointing is not None)


@cli_main
def main(argv=None) -> int:
    args = parse_args(argv)
    check_numbers(args)
    if args.write_recipe:
        check_tool_output(args.write_recipe, "--write-recipe", folder=False, overwrite=args.overwrite,
                          reads=[args.recipe, *([args.from_run] if args.from_run else [])])

    from lmrecipe.planning.budget import make_plan
    from lmrecipe.planning.write import format_plan, plan_summary, write_recipe

    plan = make_plan(plan_inputs(args))
    print(json.dumps(plan_summary(plan), indent=2) if args.json else format_plan(plan))
    for warning in plan.warnings:
        print(f"\nwarning: {warning}", file=sys.stderr)
    if args.write_recipe:
        command = shlex.join(["python", "tools/plan.py", *(sys.argv[1:] if argv is None else argv)])
        write_recipe(plan, args.recipe, args.write_recipe, args.overrides, command)
        print(f"\nRecipe written to {args.write_recipe}: python train.py {args.write_recipe}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
