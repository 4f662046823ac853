"""Train a causal LM: ``accelerate launch [topology flags] train.py RECIPE [key=value ...]``.

``python train.py RECIPE`` runs a single process. See README.md for recipes and overrides.
"""

import argparse
import sys
import textwrap

from lmrecipe.cli import cli_main, exit_launched, setup_logging
from lmrecipe.config import load_config
from lmrecipe.errors import fail

FLAGS = ("--print-config", "--list-keys", "--dry-run", "--help", "-h")


def build_parser() -> argparse.ArgumentParser:
    from lmrecipe.config.reference import section_names

    sections = textwrap.fill(", ".join(section_names()) + ", and the top-level key out_dir", width=96,
                             initial_indent="  ", subsequent_indent="  ")
    epilog = (f"configuration sections:\n{sections}\n\n"
              "Set any key as section.key=value after the recipe, e.g. train.max_steps=200 optim.lr=3e-4: overrides\n"
              "win over the recipe, the recipe over the defaults.\n"
              "  train.py --list-keys [SECTION]  every key with its default and what it does, in a line\n"
              "  docs/reference/keys.md          every key's type, default and full description")
    parser = argparse.ArgumentParser(description=__doc__, epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4 train.max_steps=200")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration (what out_dir/config.yaml would hold) and exit")
    parser.add_argument("--list-keys", nargs="?", const="", metavar="SECTION",
                        help="list every key (or those of the SECTIONs named after it) with its default and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the config, data, DeepSpeed config, world size, memory and out_dir without "
                             "training or writing anything; exit 0, or 2 listing every problem")
    return parser


@cli_main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from lmrecipe.config.reference import check_no_flags, format_key_list

    check_no_flags(argv, FLAGS)
    args = build_parser().parse_intermixed_args(argv)
    if args.list_keys is not None:  # every word after it is a section to list (argparse takes the first alone)
        print(format_key_list([args.list_keys, args.recipe or "", *args.overrides]))
        return 0
    if args.recipe is None:
        raise fail("train.py needs a recipe: python train.py RECIPE [key=value ...], e.g. recipes/tiny.yaml "
                   "(train.py --help for the options).")
    if args.print_config:
        from lmrecipe.config import config_yaml

        print(config_yaml(load_config(args.recipe, args.overrides)), end="")
        if not args.dry_run:  # with --dry-run, the dry run's report follows the configuration it checks
            return 0
    setup_logging()
    cfg = load_config(args.recipe, args.overrides)
    if args.dry_run:
        from lmrecipe.train.dry_run import dry_run  # heavy imports only after the config is known to be valid

        report = dry_run(cfg)
        print(report.text())
        report.raise_problems()
        return 0
    from lmrecipe.train.trainer import train  # heavy imports only after the config is known to be valid

    train(cfg, recipe=args.recipe, command=[sys.argv[0], *argv])
    return 0


if __name__ == "__main__":
    exit_launched(main())
