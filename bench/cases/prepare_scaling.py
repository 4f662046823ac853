"""Preparation: tokens/s of tools/prepare_data.py's tokenization on 1 and 2 processes, and a datasets.map baseline.

Each trial a fresh process, sides rotated per round: *p1*, *p2* (``prepare(num_proc=1 or 2)``) and *map*
(``datasets.Dataset.map``, same tokenizer and documents); docs/benchmarks/04-preparation.md.
"""

import logging
import os
import resource
import tempfile
import time
from pathlib import Path

import _common as C

RECIPE, DATA = None, None
SIDES = ("p1", "p2", "map")
RATIOS = {"p2/p1": "2 processes / 1 process", "p1/map": "1 process / datasets.map",
          "p2/map": "2 processes / datasets.map"}


def options(parser) -> None:
    parser.add_argument("--tokenizer", default="data/stdlib", help="tokenizer folder (default: %(default)s)")
    parser.add_argument("--max-documents", type=int, default=300, help="first N documents of the embedded corpus; 0 = all")
    parser.add_argument("--prepare-tokenizer", choices=["given", "trained"], default="given",
                        help="p1/p2: given = --tokenizer; trained = prepare trains its BPE (not timed), prepare_data's default")


def check(args) -> None:
    C.check_tokenizer(args.tokenizer)


def name(args) -> str:
    return "prepare_scaling" + ("_trained" if args.prepare_tokenizer == "trained" else "")


def worker(args) -> dict:
    from lmrecipe.data.prepare.pipeline import prepare
    from lmrecipe.data.prepare.read import DocumentSource

    logging.basicConfig(level=logging.WARNING)
    side, tokenizer, max_documents = args.worker, args.tokenizer, args.max_documents or None
    if side in ("p1", "p2"):
        who = (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)  # this process and prepare's (ended) tokenizer workers
        with tempfile.TemporaryDirectory(prefix="bench_prep_") as tmp:
            start, cpu_start = time.perf_counter(), C.cpu_seconds(*who)
            meta = prepare(output=Path(tmp) / "out", tokenizer=None if args.prepare_tokenizer == "trained" else tokenizer,
                           vocab_size=8192, num_proc=int(side[1]), max_documents=max_documents)
            wall, cpu = time.perf_counter() - start, C.cpu_seconds(*who) - cpu_start
        n_tokens = sum(s["n_tokens"] for s in meta["splits"].values())
        return {"tokens_per_sec": meta["timing"]["tokens_per_sec"], "tokens": n_tokens,
                "tokenize_seconds": meta["timing"]["tokenize_seconds"], "prepare_wall_seconds": wall,
                "prepare_cpu_seconds": cpu, "cores_used": cpu / wall}
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    # The documents prepare() reads by default, in its reading order, held in memory.
    ds = datasets.Dataset.from_dict({"text": [doc.text for doc in DocumentSource(max_documents=max_documents).documents()]})
    start = time.perf_counter()
    out = ds.map(lambda batch: tok(batch["text"], add_special_tokens=False, verbose=False), batched=True, remove_columns=["text"])
    seconds = time.perf_counter() - start
    n_tokens = sum(len(ids) for ids in out["input_ids"])
    return {"tokens_per_sec": n_tokens / seconds, "tokens": n_tokens, "tokenize_seconds": seconds}


def run(args, report) -> None:
    report.line(f"corpus: embedded stdlib, {args.max_documents or 'all'} documents; prepare's tokenizer: "
                f"{args.prepare_tokenizer} ({args.tokenizer}); TOKENIZERS_PARALLELISM={os.environ.get('TOKENIZERS_PARALLELISM')}")
    ratios = {key: (lambda a, b: lambda g: g[a]["tokens_per_sec"] / g[b]["tokens_per_sec"])(*key.split("/"))
              for key in RATIOS}
    runs, stats = C.interleave(report, args.pairs, SIDES, lambda side: C.run_worker(C.worker_command(args, side), side),
                               ratios, lambda g: "  ".join(f"{side} {r['tokens_per_sec']:,.0f}" for side, r in g.items())
                               + f" tokens/s ({g['p1']['tokens']:,} tokens)")
    for key, label in RATIOS.items():
        report.line(f"{label}: {C.fmt_ratio(stats[key])}")
    walls, cpus, cores = ({side: C.median_of(runs[side], key) for side in ("p1", "p2")}
                          for key in ("prepare_wall_seconds", "prepare_cpu_seconds", "cores_used"))
    report.line("whole prepare() (corpus read, split, tokenizer, tokenization, writes), median: " + "; ".join(
        f"{side} {walls[side]:.1f}s wall, {cpus[side]:.1f} CPU-s ({cores[side]:.2f} cores busy)" for side in walls))
    report.line(f"CPU cost of the 2-process path: {cpus['p2'] / cpus['p1']:.2f}x the CPU seconds of 1 process; "
                f"so on 2 idle cores the whole prepare() on 2 processes could be at most "
                f"{2 * walls['p1'] / cpus['p2']:.2f}x as fast as on 1")
    report.figures = {"ratios": stats, "runs": runs, "prepare_cpu_seconds": cpus, "cores_used": cores}
