"""Preparation memory: peak resident memory of tools/prepare_data.py on 1x, 4x and 16x copies of one corpus.

    bench/run.py prepare_memory --base-files 250                      # 1x = the first 250 files (4 MB): quicker
    bench/run.py prepare_memory --copies 1 --modes given --pairs 3 --compare-repo /tmp/before   # before/after
    bench/run.py prepare_memory --repo /tmp/before --tag _before      # the scaling, run by another checkout

Each run is a fresh ``tools/prepare_data.py --input <corpus>`` (the embedded corpus copied N times, or N jsonl files);
the RSS of it and its tokenizer workers is sampled every 20 ms. Modes: *given* (``--tokenizer DIR``) and *trained*
(the default BPE). Target: peak RSS at 16x <= 1.15x the peak at 1x. Method: docs/benchmarks/07-data-at-scale.md.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

PAIRS = 1
DATA = None
RECIPE = None
SAMPLE_SECONDS = 0.02


def options(parser) -> None:
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 4, 16], help="corpus sizes, in copies (default: 1 4 16)")
    parser.add_argument("--modes", nargs="+", choices=["given", "trained"], default=["given", "trained"])
    parser.add_argument("--base-files", type=int, default=0,
                        help="1x = the first N files of the embedded corpus, sorted by path; 0 = all (default)")
    parser.add_argument("--format", choices=["files", "jsonl"], default="files", help="corpus as text files or jsonl")
    parser.add_argument("--tokenizer", default="data/stdlib", help="tokenizer folder of the given mode (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="trained mode's BPE size (default: %(default)s)")
    parser.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: prepare_data's, all cores)")
    parser.add_argument("--compare-repo", default=None, metavar="DIR",
                        help="another checkout to compare with on the 1x corpus, interleaved (before/after a change)")
    parser.add_argument("--repo", default=None, metavar="DIR",
                        help="run DIR's tools/prepare_data.py instead of this checkout's (e.g. the code before a change)")
    parser.add_argument("--tag", default="", help="suffix of the result files' name, e.g. _before")
    parser.add_argument("--workdir", default=None, help="where to build the corpora (default: a temporary folder)")


def check(args) -> None:
    if "given" in args.modes and not (Path(args.tokenizer) / "tokenizer.json").is_file():
        raise C.Refusal(f"no tokenizer at {args.tokenizer} (no tokenizer.json) for the given mode: prepare data/stdlib "
                        "with .venv/bin/python tools/prepare_data.py --output data/stdlib --vocab-size 8192, or pass "
                        "--tokenizer a tokenizer folder, or --modes trained.")


def name(args) -> str:
    return ("prepare_memory" + ("" if args.format == "files" else f"_{args.format}")
            + ("_compare" if args.compare_repo else "") + args.tag)


def run(args, report) -> None:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_corpora_"))
    try:
        (compare if args.compare_repo else scaling)(args, report, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


def build_corpus(root: Path, copies: int, fmt: str, base_files: int) -> Path:
    from lmrecipe.data.prepare.read import embedded_corpus_files, stdlib_root

    stdlib = stdlib_root()
    folder = root / f"corpus_{copies}x_{fmt}"
    if folder.exists():
        return folder
    files = embedded_corpus_files()[: base_files or None]
    for copy in range(copies):
        if fmt == "jsonl":
            folder.mkdir(parents=True, exist_ok=True)
            with open(folder / f"copy{copy:02d}.jsonl", "w", encoding="utf-8") as out:
                for path in files:
                    text = path.read_bytes().decode("utf-8", errors="replace")
                    out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            continue
        for path in files:
            dest = folder / f"copy{copy:02d}" / path.relative_to(stdlib)
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, dest)
            except OSError:  # another filesystem: a copy costs disk, not correctness
                shutil.copyfile(path, dest)
    return folder


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_prepare(repo: Path, args: list[str]) -> dict:
    """Run ``repo``'s tools/prepare_data.py with ``args`` plus a temporary --output; sample its memory."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="bench_prepmem_") as tmp:
        out = Path(tmp) / "out"
        env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        cpu_start, start = children_cpu_seconds(), time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(repo / "tools" / "prepare_data.py"), "--output", str(out), *args],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        main = psutil.Process(proc.pid)
        peak_total = peak_main = peak_worker = 0
        while proc.poll() is None:
            try:
                tree = [main] + main.children(recursive=True)
            except psutil.Error:
                break
            total = 0
            for p in tree:
                try:
                    rss = p.memory_info().rss
                except psutil.Error:
                    continue
                total += rss
                if p.pid == proc.pid:
                    peak_main = max(peak_main, rss)
                else:
                    peak_worker = max(peak_worker, rss)
            peak_total = max(peak_total, total)
            time.sleep(SAMPLE_SECONDS)
        stderr = proc.stderr.read()
        wall, cpu = time.perf_counter() - start, children_cpu_seconds() - cpu_start
        if proc.returncode != 0:
            raise SystemExit(f"prepare_data.py failed ({proc.returncode}):\n{stderr[-4000:]}")
        meta = json.loads((out / "meta.json").read_text())
    return {"peak_total_mb": peak_total / 1e6, "peak_main_mb": peak_main / 1e6, "peak_worker_mb": peak_worker / 1e6,
            "wall_s": wall, "cpu_s": cpu, "tokens": sum(s["n_tokens"] for s in meta["splits"].values()),
            "documents": sum(s["n_documents"] for s in meta["splits"].values()),
            "tokens_per_sec_meta": meta["timing"]["tokens_per_sec"]}


def mode_args(mode: str, args) -> list[str]:
    common = ["--num-proc", str(args.num_proc)] if args.num_proc else []
    if mode == "given":
        return ["--tokenizer", args.tokenizer, *common]
    return ["--vocab-size", str(args.vocab_size), *common]


def scaling(args, report, workdir: Path) -> None:
    runs = {}
    for copies in args.copies:
        corpus = build_corpus(workdir, copies, args.format, args.base_files)
        size_mb = sum(p.stat().st_size for p in corpus.rglob("*") if p.is_file()) / 1e6
        report.line(f"corpus {copies}x: {corpus.name}, {size_mb:.0f} MB")
    repo = Path(args.repo).resolve() if args.repo else C.ROOT
    for mode in args.modes:
        for i in range(args.pairs):
            for copies in args.copies if i % 2 == 0 else args.copies[::-1]:
                corpus = build_corpus(workdir, copies, args.format, args.base_files)
                got = run_prepare(repo, [*mode_args(mode, args), "--input", str(corpus)])
                runs.setdefault(mode, {}).setdefault(copies, []).append(got)
                report.line(f"{mode:7s} {copies:2d}x: {got['tokens']:>11,} tokens, {got['documents']:>6,} documents | peak RSS "
                            f"{got['peak_total_mb']:6.0f} MB (main {got['peak_main_mb']:4.0f} MB, largest worker "
                            f"{got['peak_worker_mb']:4.0f} MB) | {got['wall_s']:6.1f} s wall, {got['cpu_s']:6.1f} CPU-s, "
                            f"{got['tokens'] / got['wall_s']:,.0f} tokens/s over the whole run")
    report.line()
    ratios = {}
    base = min(args.copies)
    for mode, by_copies in runs.items():
        peak = {copies: statistics.median(r["peak_total_mb"] for r in rs) for copies, rs in by_copies.items()}
        main_peak = {copies: statistics.median(r["peak_main_mb"] for r in rs) for copies, rs in by_copies.items()}
        for copies in sorted(peak):
            if copies == base:
                continue
            ratios[f"{mode} {copies}x/{base}x"] = {"total": peak[copies] / peak[base],
                                                   "main": main_peak[copies] / main_peak[base]}
            report.line(f"{mode}: peak RSS {copies}x / {base}x = {peak[copies] / peak[base]:.3f} ({peak[copies]:.0f} / "
                        f"{peak[base]:.0f} MB); main process alone {main_peak[copies] / main_peak[base]:.3f} "
                        f"({main_peak[copies]:.0f} / {main_peak[base]:.0f} MB)")
    report.figures = {"runs": runs, "ratios": ratios, "format": args.format}


def compare(args, report, workdir: Path) -> None:
    corpus = build_corpus(workdir, 1, args.format, args.base_files)
    repos = {"before": Path(args.compare_repo).resolve(), "after": C.ROOT}
    report.line(f"before: {repos['before']}; after: {repos['after']}; corpus {corpus.name}")
    runs, stats = {}, {}
    for mode in args.modes:
        report.line(f"{mode}:")
        runs[mode], ratios = C.interleave(
            report, args.pairs, ("before", "after"),
            lambda side: run_prepare(repos[side], [*mode_args(mode, args), "--input", str(corpus)]),
            {f"{key} after/before": (lambda k: lambda g: g["after"][k] / g["before"][k])(key)
             for key in ("wall_s", "cpu_s", "peak_total_mb")},
            lambda g: " | ".join(f"{side} {r['wall_s']:5.1f} s wall, {r['cpu_s']:5.1f} CPU-s, peak RSS "
                                 f"{r['peak_total_mb']:4.0f} MB, {r['tokens']:,} tokens" for side, r in g.items()))
        stats[mode] = {key.split()[0]: value for key, value in ratios.items()}
    report.line()
    for mode, ratio in stats.items():
        report.line(f"{mode}: after / before: wall {C.fmt_ratio(ratio['wall_s'])}; CPU seconds "
                    f"{C.fmt_ratio(ratio['cpu_s'])}; peak RSS {C.fmt_ratio(ratio['peak_total_mb'])}")
    report.figures = {"runs": runs, "ratios": stats}
