"""Train a causal LM: ``accelerate launch [topology flags] train.py RECIPE [key=value ...]``.

``python train.py RECIPE`` runs a single process. See README.md for recipes and overrides.
"""

import argparse
import logging
import os
import sys

from lmrecipe.config import load_config
from lmrecipe.errors import cli_main


@cli_main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. optim.lr=3e-4 train.max_steps=200")
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    cfg = load_config(args.recipe, args.overrides)
    from lmrecipe.trainer import train  # heavy imports only after the config is known to be valid

    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
