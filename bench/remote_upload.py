"""Checkpoints to object storage (``checkpoint.remote``): upload throughput, and the training stall with uploads on
against off, in one run.

    .venv/bin/python bench/remote_upload.py --threads 1 --pairs 6
    .venv/bin/python bench/remote_upload.py --hidden-size 1024 --layers 12 --endpoint http://HOST:PORT --bucket B

Without --endpoint it starts a local S3-compatible server (SeaweedFS's ``weed``, from the ``[test]`` extra, as the
tests do: ``tests/s3_server.py``) and a bucket. One process, one model (``build_run`` of the recipe with
--hidden-size / --layers), a checkpointer built by the trainer's own ``build_checkpointer`` (synchronous saves).

1. **Throughput**: the checkpoint's upload on this thread (``CheckpointMirror.upload``: every file, the marker, the
   commit, the remote ``latest``, the remote prune), repeated --uploads times: MB/s of checkpoint files.
2. **Stall**: rounds of a save then --steps-between training steps (``train_step``), each side in turn (A B, B A,
   ...): *off* saves only; *on* also hands the checkpoint to the upload worker thread, as ``RemoteUpload.on_save``
   does, and the steps run while it uploads (the worker is then drained, untimed). The figure is the median of the
   per-round ratios on / off of the round's time (save + steps): what the upload costs the loop on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import _common as C  # noqa: E402

SIDES = ("off", "on")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="recipes/tiny.yaml")
    parser.add_argument("--data", default="data/stdlib")
    parser.add_argument("--hidden-size", type=int, default=512, help="model width (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks (default: %(default)s)")
    parser.add_argument("--steps-between", type=int, default=3, help="training steps after each save (default: %(default)s)")
    parser.add_argument("--uploads", type=int, default=3, help="timed uploads for the throughput (default: %(default)s)")
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint to use (default: start a local SeaweedFS)")
    parser.add_argument("--bucket", default=None, help="an existing bucket at --endpoint (credentials: AWS_* variables)")
    parser.add_argument("--tmp", default=None, help="folder for the run, its checkpoints and the server (default: system temp)")
    C.add_common_args(parser, pairs=6, device=False)
    args = parser.parse_args()
    C.check_data(args.data)
    C.set_threads(args.threads)

    import logging

    logging.disable(logging.WARNING)
    report = C.Report("remote_upload", "cpu", args.output)
    with tempfile.TemporaryDirectory(prefix="bench_remote_", dir=args.tmp) as tmp:
        server = None
        if args.endpoint is None:
            import importlib.util

            spec = importlib.util.spec_from_file_location("s3_server", C.ROOT / "tests" / "s3_server.py")
            s3_server = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(s3_server)
            S3Server = s3_server.S3Server

            server = S3Server(Path(tmp) / "server")
            server.start()
            os.environ.update(server.env())
            bucket = server.make_bucket(f"bench-{uuid.uuid4().hex[:8]}")
        else:
            os.environ["AWS_ENDPOINT_URL"] = args.endpoint
            bucket = args.bucket or sys.exit("--bucket is needed with --endpoint")
        try:
            measure(args, report, Path(tmp), f"s3://{bucket}/bench")
        finally:
            if server is not None:
                server.stop()
    report.save()
    return 0


def measure(args, report: C.Report, tmp: Path, url: str) -> None:
    from lmrecipe.checkpoint.remote import CheckpointMirror
    from lmrecipe.objstore import Store
    from lmrecipe.train.callbacks.checkpointing import build_checkpointer
    from lmrecipe.train.callbacks.remote import Uploader
    from lmrecipe.train.setup import build_run
    from lmrecipe.train.state import TrainState
    from lmrecipe.train.step import train_step

    cfg = C.bench_config(args.recipe, [f"model.hidden_size={args.hidden_size}", f"model.num_layers={args.layers}",
                                       f"model.intermediate_size={(8 * args.hidden_size // 3 + 63) // 64 * 64}",
                                       "checkpoint.every_steps=1", "checkpoint.keep_last=2"], f"{tmp}/run", args.data)
    run = build_run(cfg, tmp / "run")
    checkpointer = build_checkpointer(dataclasses.replace(run, cfg=cfg), tmp / "run")
    store = Store.open(url)
    state = TrainState()

    def step() -> None:
        result = train_step(run, state.step)
        state.record_step(result.skipped, run.tokens_per_step)

    def save():
        step()  # a new step per save: each checkpoint gets its own folder
        return checkpointer.maybe_save(run.model, state)

    for _ in range(2):
        step()
    with C.quiet_stdout():
        folder = save()
    size_mb = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6
    report.line(f"model {run.n_params / 1e6:.1f}M params, checkpoint {size_mb:,.1f} MB, {args.steps_between} steps "
                f"between saves, threads {args.threads or 'default'}, object storage {os.environ.get('AWS_ENDPOINT_URL')}")

    mirror = CheckpointMirror(store, checkpointer.root, rank=0, world_size=1, keep_last=2)
    speeds = []
    for i in range(args.uploads):
        with C.quiet_stdout():
            folder = save()
        start = time.perf_counter()
        mirror.upload(folder)
        seconds = time.perf_counter() - start
        speeds.append(size_mb / seconds)
        report.line(f"upload {i + 1}: {size_mb:,.1f} MB in {seconds:.2f} s = {speeds[-1]:,.1f} MB/s")
    report.line(f"upload throughput: median {statistics.median(speeds):,.1f} MB/s (min {min(speeds):,.1f}, max "
                f"{max(speeds):,.1f}, n={len(speeds)})")

    uploader = Uploader(CheckpointMirror(store, checkpointer.root, rank=0, world_size=1, keep_last=2))
    uploader.pinned = checkpointer.store.pinned

    def one_round(side: str) -> float:
        start = time.perf_counter()
        with C.quiet_stdout():
            folder = save()
            if side == "on":
                uploader.submit(folder)
            for _ in range(args.steps_between):
                step()
        seconds = time.perf_counter() - start
        while uploader.busy():  # drained outside the timed part: the next round starts with the worker idle
            time.sleep(0.01)
        return seconds

    for side in SIDES:
        one_round(side)
    ratios, times = [], {side: [] for side in SIDES}
    for order in C.pair_orders(args.pairs, SIDES):
        got = {side: one_round(side) for side in order}
        for side in SIDES:
            times[side].append(got[side])
        ratios.append(got["on"] / got["off"])
        report.line(f"round {len(ratios)}: off {1e3 * got['off']:,.0f} ms | on {1e3 * got['on']:,.0f} ms | "
                    f"ratio {ratios[-1]:.3f}")
    uploader.close()
    stall = C.ratio_stats(ratios)
    report.line(f"round (save + {args.steps_between} steps), upload on / off: {C.fmt_ratio(stall)}; median off "
                f"{1e3 * statistics.median(times['off']):,.0f} ms, on {1e3 * statistics.median(times['on']):,.0f} ms")
    report.figures = {"checkpoint_mb": size_mb, "upload_mb_s": speeds, "stall_ratio": stall, "times_s": times,
                      "n_params": run.n_params, "steps_between": args.steps_between}
    run.prefetcher.close()


if __name__ == "__main__":
    sys.exit(main())
