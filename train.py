"""Train a causal LM: ``accelerate launch [topology flags] train.py RECIPE [key=value ...]``.

``python train.py RECIPE`` runs a single process. See README.md for recipes and overrides.
"""

import argparse
import sys

from lmrecipe.cli import check_output_path, cli_main, setup_logging
from lmrecipe.config import load_config


@cli_main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4 train.max_steps=200")
    args = parser.parse_args()
    setup_logging()
    cfg = load_config(args.recipe, args.overrides)
    check_output_path(cfg.out_dir, "out_dir")
    from lmrecipe.train.trainer import train  # heavy imports only after the config is known to be valid

    train(cfg, recipe=args.recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
