"""Train one recipe under several DeepSpeed configs and compare throughput, memory per rank and loss.

    python tools/compare_zero.py recipes/tiny.yaml --out runs/compare_zero
    python tools/compare_zero.py recipes/tiny.yaml model.num_layers=8 --configs none,zero2,zero3 --steps 20 --nproc 8

Each config trains for --steps steps on --nproc processes (sequentially) into OUT/<config>/ and the tool
writes OUT/results.csv, OUT/results.md and OUT/memory_throughput.png. Configs are names in ds_configs/
(none = no DeepSpeed) or paths to DeepSpeed JSON files. See lmrecipe/planning/zero_comparison.py.
"""

import argparse
import sys
from pathlib import Path


from lmrecipe.cli import check_tool_output, cli_main, setup_logging  # noqa: E402
from lmrecipe.planning.zero_comparison import COMPARE_LOG, DEFAULT_CONFIGS, run_comparison, write_results  # noqa: E402
from lmrecipe.errors import fail  # noqa: E402


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() or 2


@cli_main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides applied to every run")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help="comma-separated DeepSpeed configs (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes per run (default: the GPUs of this machine, or 2 without GPUs)")
    parser.add_argument("--out", type=Path, default=Path("runs/compare_zero"), help="output folder (default: %(default)s)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the run folders of an earlier comparison (never other folders)")
    args = parser.parse_intermixed_args()  # options may come before or after the overrides
    setup_logging(fmt="%(message)s", stream=sys.stdout)

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs:
        raise fail("--configs is empty; name at least one config, e.g. --configs none,zero2.")
    nproc = args.nproc or default_nproc()
    if nproc < 1:
        raise fail(f"--nproc={nproc} must be at least 1.")
    # OUT holds one run folder per config: run_comparison replaces only those an earlier comparison wrote.
    check_tool_output(args.out, "--out", overwrite=None, reads=[args.recipe])
    results = run_comparison(args.recipe, args.overrides, configs, args.steps, nproc, args.out, args.overwrite)
    write_results(results, args.out, args.steps, nproc)
    print()
    print((args.out / "results.md").read_text())
    print(f"Wrote {args.out / 'results.csv'}, {args.out / 'results.md'} and {args.out / 'memory_throughput.png'}")
    failed = [r.config for r in results if r.status != "ok"]
    if failed:
        logs = ", ".join(str(args.out / name / COMPARE_LOG) for name in failed)
        print(f"Failed: {', '.join(failed)} (see {logs})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
