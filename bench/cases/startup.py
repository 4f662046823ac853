"""Start-up: time from launching train.py to the end of its first optimizer step, on a small and a large data folder.

    bench/run.py startup                                                   # data/stdlib (3M tokens) against 1B
    bench/run.py startup --sparse --large-tokens 100000000000 --pairs 3    # 100B tokens, without writing 200 GB

The large folder is --data written over and over (--sparse: with a sparse tail); each round launches ``train.py`` on
each folder, timing the launch to its first metrics row, with the peak RSS then (docs/benchmarks/07-data-at-scale.md).
"""

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import _common as C

PAIRS = 5


def options(parser) -> None:
    parser.add_argument("--large-tokens", type=int, default=1_000_000_000, help="train tokens of the large folder")
    parser.add_argument("--tmp", default=None, help="where to build the large folder (default: system temp)")
    parser.add_argument("--sparse", action="store_true", help="build the large folder with a sparse train.bin tail")


def name(args) -> str:
    return "startup_sparse" if args.sparse else "startup"


def run(args, report) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_startup_", dir=args.tmp) as tmp:
        start, small, workdir = time.perf_counter(), Path(args.data).resolve(), Path(tmp)
        folders = {"small": small, "large": build_large(small, workdir / "large", args.large_tokens, args.sparse)}
        size_gb = C.folder_mb(folders["large"]) / 1e3
        report.line(f"large folder: {size_gb:.2f} GB ({'sparse, ' if args.sparse else ''}{args.large_tokens:,} train "
                    f"tokens), built in {time.perf_counter() - start:.1f} s")
        got, stats = C.interleave(
            report, args.pairs, ("small", "large"),
            lambda side: time_to_first_step(folders[side], workdir / f"run_{side}", args.recipe),
            {"large/small": lambda g: g["large"][0] / g["small"][0]},
            lambda g: ", ".join(f"{side} {s:.2f} s (peak RSS {rss / 1e9:.3f} GB)" for side, (s, rss) in g.items()))
    runs, rss = ({side: [row[i] for row in rows] for side, rows in got.items()} for i in (0, 1))
    report.line("median launch to first step: " + ", ".join(
        f"{side} {statistics.median(v):.2f} s (peak RSS {statistics.median(rss[side]) / 1e9:.3f} GB)"
        for side, v in runs.items()) + f"; large / small {C.fmt_ratio(stats['large/small'])}")
    report.figures = {"runs": runs, "peak_rss_bytes": rss, "ratio": stats["large/small"], "large_gb": size_gb}


def build_large(small: Path, dest: Path, tokens: int, sparse: bool) -> Path:
    """``small`` replicated until train.bin holds at least ``tokens`` tokens, or (``sparse``) its train.bin extended by
    a sparse tail of zeros to ``tokens`` tokens (a hole: no disk blocks); returns ``dest``."""
    import numpy as np

    from lmrecipe.data.format import INDEX_DTYPE, SPLITS, load_meta

    meta = load_meta(small)
    dest.mkdir(parents=True)
    for path in small.iterdir():  # the tokenizer files
        if path.suffix not in (".bin", ".idx") and path.name != "meta.json":
            shutil.copy2(path, dest / path.name)
    copies = 1 if sparse else -(-tokens // int(meta["splits"]["train"]["n_tokens"]))
    for split in SPLITS:
        info, data, tail = meta["splits"][split], (small / f"{split}.bin").read_bytes(), sparse and split == "train"
        index = np.fromfile(small / f"{split}.idx", dtype=INDEX_DTYPE)
        with open(dest / f"{split}.bin", "wb") as bin_file, open(dest / f"{split}.idx", "wb") as idx_file:
            idx_file.write(index[:1].tobytes())
            for copy in range(copies):
                bin_file.write(data)
                idx_file.write((index[1:] + np.uint64(copy * int(info["n_tokens"]))).astype(INDEX_DTYPE).tobytes())
            if tail:
                bin_file.truncate(tokens * np.dtype(meta["dtype"]).itemsize)
                idx_file.write(np.array([tokens], dtype=INDEX_DTYPE).tobytes())
        info.update(n_tokens=tokens if tail else info["n_tokens"] * copies,
                    n_documents=info["n_documents"] * copies + int(tail),  # the tail is one more document
                    sha256=f"{copies} copies of {info['sha256']}" + (", with a sparse tail" if tail else ""))
    meta["source"] = f"{small}, extended to {tokens:,} train tokens ({meta['source']})"
    (dest / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    load_meta(dest)
    return dest


def time_to_first_step(data: Path, run_dir: Path, recipe: str, timeout: float = 300) -> tuple[float, int]:
    metrics, start = run_dir / "metrics.jsonl", time.perf_counter()
    proc = subprocess.Popen(C.train_command(recipe, run_dir, data, ["logging.log_every_steps=1"]), cwd=C.ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if metrics.is_file() and '"step"' in metrics.read_text():
                return time.perf_counter() - start, C.status_kb("VmHWM", proc.pid) * 1024
            if proc.poll() is not None:
                raise SystemExit(f"train.py exited {proc.returncode} before its first step:\n"
                                 f"{proc.stderr.read()[-4000:]}")
            if time.perf_counter() - start > timeout:
                raise SystemExit(f"no first step within {timeout} s")
            time.sleep(0.005)
    finally:
        proc.kill()  # a no-op where it has ended
        proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
