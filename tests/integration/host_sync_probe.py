"""Count the host syncs of a whole training run on every rank (tests/integration/test_sequence_parallel.py).

Usage, under any launcher: ``host_sync_probe.py OUT.json RECIPE [key=value ...]``. Each rank trains in-process
under :class:`~lmrecipe.observe.host_syncs.HostSyncCounter` and writes ``OUT.rank<N>.json`` with its counts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from lmrecipe.cli import setup_logging
from lmrecipe.config import load_config
from lmrecipe.observe.host_syncs import HostSyncCounter
from lmrecipe.train.trainer import train


def main() -> None:
    out, recipe, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    setup_logging()
    cfg = load_config(recipe, overrides)
    with HostSyncCounter() as counter:
        state = train(cfg)
    rank = int(os.environ.get("RANK", "0"))
    out.with_suffix(f".rank{rank}.json").write_text(json.dumps({"total": counter.total, "calls": counter.calls,
                                                                 "sources": counter.sources, "steps": state.step}))


if __name__ == "__main__":
    main()
