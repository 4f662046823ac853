"""Print the `accelerate launch` flags that a recipe needs, after checking the recipe and overrides.

    python tools/launch_flags.py RECIPE [key=value ...]

slurm/launch.sh calls this on every node before launching, so a bad recipe fails at once with a message
instead of after the rendezvous. See lmrecipe/launch.py for the choice of launcher.
"""

import argparse
import sys


from lmrecipe.cli import cli_main  # noqa: E402
from lmrecipe.config import load_config  # noqa: E402
from lmrecipe.launch import launcher_flags  # noqa: E402


@cli_main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args()
    print(" ".join(launcher_flags(load_config(args.recipe, args.overrides).distributed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
