"""Compile the DeepSpeed ops that training uses ahead of time, instead of in the first run that needs them.

    python tools/build_ops.py

DeepSpeed compiles CPU Adam (ZeRO-Offload's optimizer) and, on a machine without a GPU, its shared-memory
collectives on first use: a minute or more of CPU each, once per environment (cached under $TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions). Run this once where the ranks of a job would otherwise all wait on the first
compilation; `make test` runs it while pip installs the test tools.
"""

import argparse
import logging
import sys
import time


from lmrecipe.cli import cli_main, setup_logging  # noqa: E402
from lmrecipe.parallel.deepspeed_config import build_deepspeed_ops  # noqa: E402

logger = logging.getLogger("build_ops")


@cli_main
def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    setup_logging()
    start = time.perf_counter()
    built = build_deepspeed_ops()
    logger.info("DeepSpeed ops ready: %s (%.0f s)", ", ".join(built) or "none needed here", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
