"""The CPU benchmarks, one runner: ``bench/run.py CASE [options]``; ``bench/run.py`` alone lists the cases.

Each case is a module of ``bench/cases/``: its docstring (first line: its summary), the defaults of the common
options (``PAIRS``, ``DATA``, ``RECIPE``: None where it has no such option; ``DEVICE``: true to offer ``--device
cuda``), ``options(parser)``, ``run(args, report)``, and where it needs fresh processes ``worker(args)`` (run by
``--worker KIND``). The runner owns the rest: common options, threads, the data check, the report. Bad input exits
2 with one message, before anything is measured.
"""

import argparse
import ast
import importlib
import os
import sys
from pathlib import Path

import _common as C

from lmrecipe.errors import UserError

CASES = Path(__file__).resolve().parent / "cases"


def case_names() -> list[str]:
    return sorted(p.stem for p in CASES.glob("*.py") if not p.stem.startswith("_"))


def summary(name: str) -> str:
    """The first line of a case's docstring, read without importing the case."""
    return (ast.get_docstring(ast.parse((CASES / f"{name}.py").read_text())) or "").partition("\n")[0]


def listing() -> str:
    width = max(map(len, case_names()))
    return "\n".join(["usage: bench/run.py CASE [options]  (bench/run.py CASE --help: its options)", "", "cases:"]
                     + [f"  {name:<{width}}  {summary(name)}" for name in case_names()])


def build_parser(name: str, case) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"bench/run.py {name}", description=case.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pairs, data, recipe = (getattr(case, *default) for default in (("PAIRS", 3), ("DATA", "data/stdlib"),
                                                                   ("RECIPE", "recipes/tiny.yaml")))
    if pairs is not None:  # None: a case without rounds
        parser.add_argument("--pairs", type=int, default=pairs, help="interleaved rounds of the sides (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--output", default=None, help="folder for the .txt/.json results (default: bench/results)")
    if data:
        parser.add_argument("--data", default=data, help="prepared data folder (default: %(default)s)")
    if recipe:
        parser.add_argument("--recipe", default=recipe)
    if getattr(case, "DEVICE", False):
        parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                            help="cpu, or cuda on a GPU machine (precision auto = bf16 there)")
    if hasattr(case, "worker"):
        parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    if hasattr(case, "options"):
        case.options(parser)
    return parser


def run_case(name: str, argv: list[str]) -> int:
    case = importlib.import_module(f"cases.{name}")
    args = build_parser(name, case).parse_args(argv)
    args.case, args.argv = name, argv
    device = getattr(args, "device", "cpu")
    if device == "cpu" and getattr(case, "DEVICE", False):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU figures, also on a GPU machine
    if args.threads:
        __import__("torch").set_num_threads(args.threads)
    if getattr(args, "worker", None):
        with C.quiet_stdout():
            result = case.worker(args)
        if result is not None:
            C.print_result(result)
        return 0
    if getattr(args, "data", None):
        from lmrecipe.data.format import load_meta  # its UserError names the fix

        load_meta(args.data)
    if hasattr(case, "check"):
        case.check(args)
    report = C.Report(case.name(args) if hasattr(case, "name") else name, device, args.output)
    case.run(args, report)
    report.save()
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(listing())
        return 0
    if argv[0] not in case_names():
        print(f"bench/run.py: no case named {argv[0]!r}. The cases are {', '.join(case_names())}; "
              "bench/run.py alone lists them with what each measures.", file=sys.stderr)
        return 2
    try:
        return run_case(argv[0], argv[1:])
    except UserError as refusal:
        print(f"bench/run.py {argv[0]}: {refusal}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
