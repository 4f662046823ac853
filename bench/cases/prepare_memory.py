"""Preparation memory: peak resident memory of tools/prepare_data.py on 1x, 4x and 16x copies of one corpus.

    bench/run.py prepare_memory --base-files 250      # 1x = the first 250 files (4 MB): quicker

Each run a fresh ``tools/prepare_data.py --input`` of the embedded corpus copied N times (or N jsonl files), its and
its workers' RSS sampled every 20 ms. Target: 16x <= 1.15x the peak at 1x (docs/benchmarks/07-data-at-scale.md).
"""

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C

PAIRS, DATA, RECIPE = 1, None, None


def options(parser) -> None:
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 4, 16], help="corpus sizes, in copies (default: 1 4 16)")
    parser.add_argument("--modes", nargs="+", choices=["given", "trained"], default=["given", "trained"])
    parser.add_argument("--base-files", type=int, default=0, help="1x = the first N files of the embedded corpus; 0 = all")
    parser.add_argument("--format", choices=["files", "jsonl"], default="files", help="corpus as text files or jsonl")
    parser.add_argument("--tokenizer", default="data/stdlib", help="tokenizer of the given mode (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="trained mode's BPE size (default: %(default)s)")
    parser.add_argument("--tmp", default=None, help="where to build the corpora (default: system temp)")


def check(args) -> None:
    if "given" in args.modes:
        C.check_tokenizer(args.tokenizer, " (for the given mode), or --modes trained")


def name(args) -> str:
    return "prepare_memory" + ("" if args.format == "files" else f"_{args.format}")


def build_corpus(root: Path, copies: int, fmt: str, base_files: int) -> Path:
    from lmrecipe.data.prepare.read import embedded_corpus_files, stdlib_root

    stdlib, folder = stdlib_root(), root / f"corpus_{copies}x_{fmt}"
    files = embedded_corpus_files()[: base_files or None]
    folder.mkdir(parents=True, exist_ok=True)
    for copy in range(copies):
        if fmt == "jsonl":
            with open(folder / f"copy{copy:02d}.jsonl", "w", encoding="utf-8") as out:
                for path in files:
                    out.write(json.dumps({"text": path.read_bytes().decode("utf-8", errors="replace")}) + "\n")
            continue
        for path in files:
            dest = folder / f"copy{copy:02d}" / path.relative_to(stdlib)
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, dest)
            except OSError:  # another filesystem: a copy costs disk, not correctness
                shutil.copyfile(path, dest)
    return folder


def run_prepare(args: list[str]) -> dict:
    """Run tools/prepare_data.py with ``args`` plus a temporary --output, sampling the RSS of it and its workers."""
    import psutil

    with tempfile.TemporaryDirectory(prefix="bench_prepmem_") as tmp:
        out = Path(tmp) / "out"
        env = {**os.environ, "PYTHONPATH": str(C.ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
        cpu_start, start = C.cpu_seconds(resource.RUSAGE_CHILDREN), time.perf_counter()
        with open(Path(tmp) / "stderr.txt", "w") as stderr:  # a file, not a pipe: a long run's log would fill a pipe
            proc = subprocess.Popen([sys.executable, str(C.ROOT / "tools" / "prepare_data.py"), "--output", str(out),
                                     *args], env=env, stdout=subprocess.DEVNULL, stderr=stderr)
        main, peak_total, peak_main = psutil.Process(proc.pid), 0, 0
        while proc.poll() is None:
            with_rss = {}
            with contextlib.suppress(psutil.Error):  # the process, or one of its workers, ended while sampled
                for p in [main, *main.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        with_rss[p.pid] = p.memory_info().rss
            peak_total, peak_main = max(peak_total, sum(with_rss.values())), max(peak_main, with_rss.get(proc.pid, 0))
            time.sleep(0.02)
        stderr = (Path(tmp) / "stderr.txt").read_text()
        wall, cpu = time.perf_counter() - start, C.cpu_seconds(resource.RUSAGE_CHILDREN) - cpu_start
        if proc.returncode != 0:
            raise SystemExit(f"prepare_data.py failed ({proc.returncode}):\n{stderr[-4000:]}")
        splits = json.loads((out / "meta.json").read_text())["splits"].values()
    return {"peak_total_mb": peak_total / 1e6, "peak_main_mb": peak_main / 1e6, "wall_s": wall, "cpu_s": cpu,
            "tokens": sum(s["n_tokens"] for s in splits), "documents": sum(s["n_documents"] for s in splits)}


def run(args, report) -> None:
    mode_args = {"given": ["--tokenizer", args.tokenizer], "trained": ["--vocab-size", str(args.vocab_size)]}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="bench_corpora_", dir=args.tmp) as tmp:
        corpora = {copies: build_corpus(Path(tmp), copies, args.format, args.base_files) for copies in args.copies}
        for copies, corpus in corpora.items():
            report.line(f"corpus {copies}x: {corpus.name}, {C.folder_mb(corpus):.0f} MB")
        for mode in args.modes:
            for i in range(args.pairs):
                for copies in args.copies if i % 2 == 0 else args.copies[::-1]:
                    got = run_prepare([*mode_args[mode], "--input", str(corpora[copies])])
                    runs.setdefault(mode, {}).setdefault(copies, []).append(got)
                    report.line(f"{mode:7s} {copies:2d}x: {got['tokens']:>11,} tokens | peak RSS {got['peak_total_mb']:6.0f} MB "
                                f"(main {got['peak_main_mb']:4.0f} MB) | {got['wall_s']:6.1f} s wall, {got['cpu_s']:6.1f} CPU-s")
    ratios, base = {}, min(args.copies)
    for mode, by_copies in runs.items():
        peak = {copies: C.median_of(rs, "peak_total_mb") for copies, rs in by_copies.items()}
        for copies in sorted(peak)[1:]:
            ratios[f"{mode} {copies}x/{base}x"] = ratio = peak[copies] / peak[base]
            report.line(f"{mode}: peak RSS {copies}x / {base}x = {ratio:.3f} ({peak[copies]:.0f} / {peak[base]:.0f} MB)")
    report.figures = {"runs": runs, "ratios": ratios, "format": args.format}
