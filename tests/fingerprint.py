"""The losses of a fixed set of short runs, written as JSON to compare bit for bit before and after a restructuring.

    python tests/fingerprint.py OUT.json [--only NAME ...]
    python tests/fingerprint.py --compare A.json B.json

The runs: one process without DeepSpeed (with the per-layer instruments), 2-process ZeRO-1, ZeRO-2 (instruments) and
ZeRO-3 (the model-state probe), a mixture of experts with AutoEP at expert-parallel size 2, and sequence parallelism
2 under ZeRO-2. Each run's record is every numeric figure of its ``metrics.jsonl`` rows that does not measure time or
memory, as ``repr`` of the float, so that equal records mean equal bits.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import run_train  # noqa: E402

STEPS = 6
COMMON = [f"train.max_steps={STEPS}", "train.eval_every_steps=3", "checkpoint.every_steps=3"]
MOE = ["model.arch=qwen3_moe", "model.num_experts=4", "model.experts_per_token=2", "model.hidden_size=32",
       "model.intermediate_size=64", "model.expert_intermediate_size=32", "train.precision=fp32"]
RUNS: dict[str, tuple[list[str], int]] = {
    "plain": (["logging.layer_stats=true"], 1),
    "zero1": (["distributed.deepspeed_config=zero1"], 2),
    "zero2": (["distributed.deepspeed_config=zero2", "logging.layer_stats=true"], 2),
    "zero3": (["distributed.deepspeed_config=zero3", "logging.measure_model_states=true"], 2),
    "moe_autoep2": ([*MOE, "distributed.deepspeed_config=zero1", "distributed.expert_layer=autoep",
                     "distributed.expert_parallel_size=2"], 2),
    "sp2": (["distributed.deepspeed_config=zero2", "distributed.sequence_parallel_size=2"], 2),
}
NOT_COMPARED = ("time", "_s", "tokens_per_s", "mfu", "mem", "peak", "rss", "_gb", "throughput", "eta", "wall")


def figures(out_dir: Path) -> list[dict]:
    rows = []
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        kept = {k: repr(v) for k, v in row.items()
                if isinstance(v, (int, float)) and not any(word in k for word in NOT_COMPARED)}
        rows.append(kept)
    return rows


def record(out: Path, only: list[str]) -> None:
    from lmrecipe.data.prepare.pipeline import prepare
    from lmrecipe.data.prepare.read import embedded_corpus_files

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data"
        corpus = root / "corpus"
        corpus.mkdir()
        for i, f in enumerate([f for f in embedded_corpus_files() if 4_000 < f.stat().st_size < 30_000][:40]):
            shutil.copy(f, corpus / f"{i:03d}_{f.name}")
        prepare(output=data, inputs=[corpus], vocab_size=384, val_fraction=0.1, num_proc=1)
        for name, (overrides, nproc) in RUNS.items():
            if only and name not in only:
                continue
            run_train(root / name, data, [*COMMON, *overrides], nproc=nproc)
            result[name] = figures(root / name)
            print(f"{name}: {len(result[name])} rows", flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True))


def compared(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not any(word in k for word in NOT_COMPARED)} for row in rows]


def compare(a: Path, b: Path) -> int:
    left, right = json.loads(a.read_text()), json.loads(b.read_text())
    left, right = ({name: compared(rows) for name, rows in side.items()} for side in (left, right))
    differ = 0
    for name in sorted(set(left) & set(right)):
        same = left[name] == right[name]
        differ += not same
        print(f"{name}: {'identical' if same else 'DIFFERENT'} ({len(left[name])} rows)")
    return 1 if differ or not set(left) & set(right) else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--compare", nargs=2, type=Path)
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    record(args.out, args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
