"""Start-up: time from launching train.py to the end of its first optimizer step, on a small and a large data folder.

    .venv/bin/python bench/startup.py                                   # data/stdlib (3M tokens) against 1B tokens
    .venv/bin/python bench/startup.py --large-tokens 300000000 --pairs 3
    .venv/bin/python bench/startup.py --sparse --large-tokens 100000000000   # 100B tokens, without writing 200 GB

The large folder is made cheaply from the small one (default data/stdlib, prepared by tools/prepare_data.py): its
train.bin and val.bin are written N times over, the document indexes shifted to match, and meta.json updated
(token and document counts, max_token_id unchanged). It is a valid data folder of the current format. With
``--sparse`` its train.bin is the small one's followed by a sparse tail of zeros up to ``--large-tokens`` (one more
document in the index; the file takes the disk space of the small one), so 100B tokens cost no disk.

Each round launches ``train.py recipes/tiny.yaml`` on each folder (a fresh process, order rotated per round) with
``logging.log_every_steps=1`` and no tracker, and polls the run's metrics.jsonl: the figure is the wall time from
the launch to the first row (optimizer step 1 done), with the process's peak resident memory then (``VmHWM``).
The process is then killed. Per round, large / small is
reported; the target is 1.0 within the spread of the rounds.

Then, in this process, the pieces that could grow with the data: ``open_data`` (meta.json, file sizes, the
sampled check), the first epoch's permutation of window indices (``SampleOrder``, built at the first step), and
for reference the full scan of train.bin that start-up used to run before meta.json held max_token_id (page cache
warm, so a cold start on a network filesystem is slower).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as C  # noqa: E402

OVERRIDES = ["logging.log_every_steps=1", "logging.progress_bar=false", "logging.trackers=[]", "train.eval_every_steps=0",
             "checkpoint.every_steps=0", "checkpoint.resume=none", "checkpoint.export_at_end=false"]


def build_sparse(small: Path, dest: Path, tokens: int) -> Path:
    """``small`` with its train.bin extended by a sparse tail of zeros to ``tokens`` tokens; returns ``dest``."""
    import numpy as np

    from lmrecipe.data.format import INDEX_DTYPE, load_meta

    meta = load_meta(small)
    dest.mkdir(parents=True)
    for path in small.iterdir():
        if path.name not in ("train.bin", "train.idx", "meta.json"):
            shutil.copy2(path, dest / path.name)
    info = meta["splits"]["train"]
    shutil.copy2(small / "train.bin", dest / "train.bin")
    with open(dest / "train.bin", "r+b") as f:
        f.truncate(tokens * np.dtype(meta["dtype"]).itemsize)  # a hole: no disk blocks, reads as zeros
    index = np.fromfile(small / "train.idx", dtype=INDEX_DTYPE)
    np.append(index, np.array([tokens], dtype=INDEX_DTYPE)).tofile(dest / "train.idx")
    info.update(n_tokens=tokens, n_documents=info["n_documents"] + 1, sha256=f"sparse extension of {info['sha256']}")
    meta["source"] = f"{small} with a sparse tail to {tokens:,} tokens"
    (dest / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    load_meta(dest)
    return dest


def build_large(small: Path, dest: Path, tokens: int) -> Path:
    """``small`` replicated until train.bin holds at least ``tokens`` tokens; returns ``dest``."""
    import numpy as np

    from lmrecipe.data.format import INDEX_DTYPE, SPLITS, load_meta

    meta = load_meta(small)
    copies = -(-tokens // int(meta["splits"]["train"]["n_tokens"]))
    dest.mkdir(parents=True)
    for path in small.iterdir():  # the tokenizer files
        if path.suffix not in (".bin", ".idx") and path.name != "meta.json":
            shutil.copy2(path, dest / path.name)
    for split in SPLITS:
        info = meta["splits"][split]
        data = (small / f"{split}.bin").read_bytes()
        index = np.fromfile(small / f"{split}.idx", dtype=INDEX_DTYPE)
        with open(dest / f"{split}.bin", "wb") as bin_file, open(dest / f"{split}.idx", "wb") as idx_file:
            idx_file.write(index[:1].tobytes())
            for copy in range(copies):
                bin_file.write(data)
                idx_file.write((index[1:] + np.uint64(copy * int(info["n_tokens"]))).astype(INDEX_DTYPE).tobytes())
        info.update(n_tokens=info["n_tokens"] * copies, n_documents=info["n_documents"] * copies,
                    sha256=f"{copies} copies of {info['sha256']}")
    meta["source"] = f"{copies} copies of {small} ({meta['source']})"
    (dest / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    load_meta(dest)
    return dest


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def time_to_first_step(data: Path, run_dir: Path, recipe: str, timeout: float) -> tuple[float, int]:
    metrics = run_dir / "metrics.jsonl"
    cmd = [sys.executable, "train.py", recipe, f"out_dir={run_dir}", f"data.path={data}", *OVERRIDES]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=C.ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if metrics.is_file() and any('"step"' in line for line in metrics.read_text().splitlines()):
                return time.perf_counter() - start, peak_rss_bytes(proc.pid)
            if proc.poll() is not None:
                raise SystemExit(f"train.py exited {proc.returncode} before its first step:\n{proc.stderr.read()[-4000:]}")
            if time.perf_counter() - start > timeout:
                raise SystemExit(f"no first step within {timeout} s")
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def in_process(folders: dict[str, Path], seq_len: int, vocab: int, report) -> dict:

    from lmrecipe.data.format import open_data
    from lmrecipe.data.order import SampleOrder

    figures = {}
    for name, folder in folders.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            _, train, _ = open_data(folder, seq_len, vocab)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        SampleOrder(len(train), seed=0).windows(0, 1024)
        first_windows = time.perf_counter() - start
        figures[name] = {"open_data_s": statistics.median(times), "first_1024_windows_s": first_windows,
                         "windows": len(train), "tokens": len(train.tokens)}
        line = (f"{name}: {len(train.tokens):,} train tokens; open_data {1e3 * statistics.median(times):.1f} ms "
                f"(median of 5); the order's first 1,024 windows of {len(train):,} {1e3 * first_windows:.2f} ms")
        if len(train) <= 50_000_000:  # the earlier order (version 1) materialises the epoch: only where it fits
            start = time.perf_counter()
            SampleOrder(len(train), seed=0, version=1).permutation(0)
            figures[name]["v1_permutation_s"] = time.perf_counter() - start
            line += f"; order version 1's first-epoch permutation {1e3 * figures[name]['v1_permutation_s']:.0f} ms"
        report.line(line)
    tokens = open_data(folders["large"], seq_len, vocab)[1].tokens
    if len(tokens) <= 5_000_000_000:
        start = time.perf_counter()
        top = max(int(tokens[i : i + (1 << 26)].max()) for i in range(0, len(tokens), 1 << 26))
        scan = time.perf_counter() - start
        figures["full_scan_large_s"] = scan
        report.line(f"reference: a full scan of the large train.bin for its largest id ({top}), as start-up did "
                    f"before format 2: {scan:.2f} s (page cache warm), per process and per split")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="data/stdlib", help="the small folder (default: %(default)s)")
    parser.add_argument("--large-tokens", type=int, default=1_000_000_000, help="train tokens of the large folder")
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--workdir", default=None, help="where to build the large folder (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds to wait for one run's first step")
    parser.add_argument("--sparse", action="store_true", help="build the large folder with a sparse train.bin tail")
    C.add_common_args(parser, pairs=5, device=False)
    args = parser.parse_args()
    C.check_data(args.data)
    report = C.Report("startup", "cpu", args.output)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_startup_"))
    try:
        start = time.perf_counter()
        build = build_sparse if args.sparse else build_large
        folders = {"small": Path(args.data).resolve(), "large": build(Path(args.data).resolve(), workdir / "large",
                                                                    args.large_tokens)}
        size_gb = sum(p.stat().st_size for p in folders["large"].iterdir()) / 1e9
        report.line(f"large folder: {size_gb:.2f} GB ({'sparse, ' if args.sparse else ''}"
                    f"{args.large_tokens:,} train tokens), built in {time.perf_counter() - start:.1f} s")
        runs = {"small": [], "large": []}
        rss = {"small": [], "large": []}
        ratios = []
        for i, order in enumerate(C.pair_orders(args.pairs, ("small", "large"))):
            got = {side: time_to_first_step(folders[side], workdir / f"run_{i}_{side}", args.recipe, args.timeout)
                   for side in order}
            for side in order:
                runs[side].append(got[side][0])
                rss[side].append(got[side][1])
            ratios.append(got["large"][0] / got["small"][0])
            report.line(f"round {i + 1} ({' '.join(order)}): launch to first step: small {got['small'][0]:.2f} s, "
                        f"large {got['large'][0]:.2f} s; peak RSS small {got['small'][1] / 1e9:.3f} GB, large "
                        f"{got['large'][1] / 1e9:.3f} GB")
        report.line()
        stats = C.ratio_stats(ratios)
        report.line(f"median launch to first step: small {statistics.median(runs['small']):.2f} s "
                    f"(min {min(runs['small']):.2f}, max {max(runs['small']):.2f}), large "
                    f"{statistics.median(runs['large']):.2f} s (min {min(runs['large']):.2f}, max {max(runs['large']):.2f})")
        report.line(f"large / small: {C.fmt_ratio(stats)}")
        rss_gain = statistics.median(rss["large"]) - statistics.median(rss["small"])
        report.line(f"peak RSS at the first step, median: small {statistics.median(rss['small']) / 1e9:.3f} GB, large "
                    f"{statistics.median(rss['large']) / 1e9:.3f} GB ({rss_gain / 1e9:+.3f} GB)")
        report.line()
        from lmrecipe.config import load_config

        cfg = load_config(args.recipe, [])
        vocab = cfg.model.vocab_size or int(json.loads((folders["small"] / "meta.json").read_text())["vocab_size"])
        report.figures = {"runs": runs, "peak_rss_bytes": rss, "ratio": stats, "large_gb": size_gb,
                          "in_process": in_process(folders, cfg.data.seq_len, vocab, report)}
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
