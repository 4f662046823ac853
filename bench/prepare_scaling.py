"""Preparation: tokens/s of tools/prepare_data.py's tokenization on 1 and 2 processes, and a datasets.map baseline.

    .venv/bin/python bench/prepare_scaling.py                       # first 300 documents of the embedded corpus, 3 rounds
    .venv/bin/python bench/prepare_scaling.py --max-documents 0 --pairs 3   # the whole corpus
    .venv/bin/python bench/prepare_scaling.py --tokenizers-parallelism false  # no Rust threads inside a process

Each trial is a fresh process; the three sides run in rotated order per round (p1 p2 map, p2 map p1, map p1 p2):

- p1, p2: lmrecipe.data.prepare.pipeline.prepare(tokenizer=<an existing tokenizer folder>, num_proc=1 or 2), what
  tools/prepare_data.py --tokenizer DIR --num-proc N runs; the figure is meta.json's timing.tokens_per_sec (the
  tokenization stage: worker start-up, encoding, EOS, the uint16 conversion and the .bin/.idx writes, and since
  preparation streams, the corpus read too; not the tokenizer load). The tokenizer is given, so no BPE training is
  timed; it is a fast tokenizer that encodes alike through both libraries, so prepare's workers encode with the
  tokenizers library alone, without importing transformers. With --prepare-tokenizer trained, prepare trains its
  BPE instead (prepare_data's default; the training is not in the figure).
- map: datasets.Dataset.from_dict({"text": docs}).map(tokenize, batched=True) in one process with the same
  tokenizer (AutoTokenizer on the same folder) and the same documents; tokens counted from its output.

Last, in this process: prepare's encoder through transformers' __call__ (what it keeps for a tokenizer without a
tokenizer.json, or whose class encodes differently) against the tokenizers library on the same tokenizer.json,
interleaved, checking that the bytes are identical.

With TOKENIZERS_PARALLELISM unset (the default) the Rust tokenizer may use every core inside one process, in p1
and in map alike; prepare's workers (p2) set it to false. --tokenizers-parallelism false makes every side single-threaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402

SIDES = ("p1", "p2", "map")


def cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (prepare's tokenizer workers)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def worker(side: str, tokenizer: str, max_documents: int | None, train_tokenizer: bool) -> dict:
    import logging

    logging.basicConfig(level=logging.WARNING)
    from lmrecipe.data.prepare.pipeline import prepare

    if side in ("p1", "p2"):
        with tempfile.TemporaryDirectory(prefix="bench_prep_") as tmp:
            start, cpu_start = time.perf_counter(), cpu_seconds()
            meta = prepare(output=Path(tmp) / "out", tokenizer=None if train_tokenizer else tokenizer, vocab_size=8192,
                           num_proc=int(side[1]), max_documents=max_documents)
            wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu_start
        n_tokens = sum(s["n_tokens"] for s in meta["splits"].values())
        return {"tokens_per_sec": meta["timing"]["tokens_per_sec"], "tokens": n_tokens,
                "tokenize_seconds": meta["timing"]["tokenize_seconds"], "prepare_wall_seconds": wall,
                "prepare_cpu_seconds": cpu, "cores_used": cpu / wall}
    import datasets
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    ds = datasets.Dataset.from_dict({"text": corpus_texts(max_documents)})
    start = time.perf_counter()
    out = ds.map(lambda batch: tok(batch["text"], add_special_tokens=False, verbose=False), batched=True, remove_columns=["text"])
    seconds = time.perf_counter() - start
    n_tokens = sum(len(ids) for ids in out["input_ids"])
    return {"tokens_per_sec": n_tokens / seconds, "tokens": n_tokens, "tokenize_seconds": seconds}


def corpus_texts(max_documents: int | None) -> list[str]:
    """The documents prepare() reads by default (the embedded corpus), in its reading order, held in memory."""
    from lmrecipe.data.prepare.read import DocumentSource

    return [doc.text for doc in DocumentSource(max_documents=max_documents).documents()]


def chunk_texts(texts: list[str], max_chars: int, max_docs: int) -> list[list[str]]:
    """Consecutive documents in chunks as prepare() cuts them: about ``max_chars`` characters, ``max_docs`` at most."""
    chunks, current, chars = [], [], 0
    for text in texts:
        current.append(text)
        chars += len(text)
        if chars >= max_chars or len(current) >= max_docs:
            chunks.append(current)
            current, chars = [], 0
    return chunks + ([current] if current else [])


def encoder_paths(args, report) -> dict:
    """prepare's two encoders, transformers' __call__ and the tokenizers library, on the same tokenizer.json, in this
    process, interleaved; the bytes must be identical."""
    from lmrecipe.data.prepare import pipeline as P
    from lmrecipe.data.prepare.tokenize import ChunkEncoder, EncoderSpec

    texts = corpus_texts(args.encoder_documents)
    chunks = chunk_texts(texts, P._CHUNK_CHARS, P._CHUNK_DOCS)
    meta = json.loads((Path(args.tokenizer) / "meta.json").read_text())
    encoders = {
        name: ChunkEncoder(EncoderSpec(args.tokenizer, name == "tokenizers", meta["eos_id"], meta["vocab_size"],
                                       meta["dtype"]))
        for name in ("transformers", "tokenizers")
    }
    seconds = {name: [] for name in encoders}
    outputs = {}
    for order in C.pair_orders(args.pairs, tuple(encoders)):
        for name in order:
            start = time.perf_counter()
            outputs[name] = b"".join(encoders[name](chunk)[0] for chunk in chunks)
            seconds[name].append(time.perf_counter() - start)
    identical = outputs["transformers"] == outputs["tokenizers"]
    stats = C.ratio_stats([t / k for t, k in zip(seconds["transformers"], seconds["tokenizers"])])
    n_tokens = len(outputs["tokenizers"]) // (2 if meta["dtype"] == "uint16" else 4)
    report.line(f"encoders, {len(texts)} documents ({n_tokens:,} tokens) in this process: the tokenizers library "
                f"(prepare's path for a fast tokenizer) against transformers' __call__ (its fallback): "
                f"{C.fmt_ratio(stats)} faster, identical bytes: {identical}")
    return {"speedup": stats, "identical": identical, "seconds": seconds}


def launch(side: str, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", side, "--tokenizer", args.tokenizer, "--max-documents", str(args.max_documents),
           "--prepare-tokenizer", args.prepare_tokenizer]
    env = dict(os.environ)
    if args.tokenizers_parallelism != "default":
        env["TOKENIZERS_PARALLELISM"] = args.tokenizers_parallelism
    return C.run_worker(cmd, side, env)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="data/stdlib",
                        help="tokenizer folder (default: %(default)s, the BPE prepare_data trained for it)")
    parser.add_argument("--max-documents", type=int, default=300, help="first N documents of the embedded corpus; 0 = all")
    parser.add_argument("--tokenizers-parallelism", choices=["default", "true", "false"], default="default",
                        help="TOKENIZERS_PARALLELISM for every side (default: leave the environment as it is)")
    parser.add_argument("--prepare-tokenizer", choices=["given", "trained"], default="given",
                        help="p1/p2: given = --tokenizer (prepare_data --tokenizer DIR, encoded through transformers); trained = "
                             "prepare trains its BPE (not timed) and encodes with the tokenizers library, prepare_data's default")
    parser.add_argument("--encoder-documents", type=int, default=150,
                        help="documents of the in-process encoder comparison at the end; 0 skips it (default: %(default)s)")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    C.add_common_args(parser, pairs=3, device=False)
    args = parser.parse_args()
    max_documents = args.max_documents or None
    if args.worker:
        with C.quiet_stdout():
            result = worker(args.worker, args.tokenizer, max_documents, args.prepare_tokenizer == "trained")
        C.print_result(result)
        return 0
    if not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise SystemExit(f"no tokenizer at {args.tokenizer}: run "
                         ".venv/bin/python tools/prepare_data.py --output data/stdlib --vocab-size 8192")
    variant = "".join([f"_{args.prepare_tokenizer}" if args.prepare_tokenizer != "given" else "",
                       f"_parallelism_{args.tokenizers_parallelism}" if args.tokenizers_parallelism != "default" else ""])
    report = C.Report("prepare_scaling" + variant, "cpu", args.output)
    parallelism = (os.environ.get("TOKENIZERS_PARALLELISM", "unset") if args.tokenizers_parallelism == "default"
                   else args.tokenizers_parallelism)
    prepare_tokenizer = "trained" if args.prepare_tokenizer == "trained" else args.tokenizer
    report.line(f"corpus: embedded stdlib, {'all' if not max_documents else f'first {max_documents}'} documents; "
                f"prepare's tokenizer: {prepare_tokenizer}; map's: {args.tokenizer}; TOKENIZERS_PARALLELISM={parallelism}")
    runs = {side: [] for side in SIDES}
    ratios = {"p2/p1": [], "p1/map": [], "p2/map": []}
    for i, order in enumerate(C.pair_orders(args.pairs, SIDES)):
        got = {side: launch(side, args) for side in order}
        for side in order:
            runs[side].append(got[side])
        tps = {side: got[side]["tokens_per_sec"] for side in SIDES}
        for key in ratios:
            a, b = key.split("/")
            ratios[key].append(tps[a] / tps[b])
        report.line(f"round {i + 1} ({' '.join(order)}): p1 {tps['p1']:,.0f}  p2 {tps['p2']:,.0f}  "
                    f"map {tps['map']:,.0f} tokens/s  ({got['p1']['tokens']:,} tokens)")
    report.line()
    stats = {key: C.ratio_stats(values) for key, values in ratios.items()}
    report.line(f"2 processes / 1 process (scaling):       {C.fmt_ratio(stats['p2/p1'])}")
    report.line(f"prepare 1 process / datasets.map:        {C.fmt_ratio(stats['p1/map'])}")
    report.line(f"prepare 2 processes / datasets.map:      {C.fmt_ratio(stats['p2/map'])}")
    import statistics

    walls = {side: statistics.median(r["prepare_wall_seconds"] for r in runs[side]) for side in ("p1", "p2")}
    cpus = {side: statistics.median(r["prepare_cpu_seconds"] for r in runs[side]) for side in ("p1", "p2")}
    cores = {side: statistics.median(r["cores_used"] for r in runs[side]) for side in ("p1", "p2")}
    report.line(f"whole prepare() (corpus read, split, tokenizer, tokenization, writes), median: p1 {walls['p1']:.1f}s wall, "
                f"{cpus['p1']:.1f} CPU-s ({cores['p1']:.2f} cores busy); p2 {walls['p2']:.1f}s wall, {cpus['p2']:.1f} CPU-s "
                f"({cores['p2']:.2f} cores busy)")
    report.line(f"CPU cost of the 2-process path: {cpus['p2'] / cpus['p1']:.2f}x the CPU seconds of 1 process; "
                f"so on 2 idle cores the whole prepare() on 2 processes could be at most "
                f"{2 * walls['p1'] / cpus['p2']:.2f}x as fast as on 1")
    report.figures = {"ratios": stats, "runs": runs, "prepare_cpu_seconds": cpus, "cores_used": cores}
    if args.encoder_documents:
        report.figures["encoder_paths"] = encoder_paths(args, report)
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
