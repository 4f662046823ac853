"""Checkpoints to object storage (``checkpoint.remote``): upload throughput, and the training stall with uploads on
against off, in one run of the recipe at --hidden-size x --layers (docs/benchmarks/16-remote-upload.md). Without
--endpoint it starts a local S3-compatible server (SeaweedFS, as ``tests/s3_server.py`` does).
"""

import contextlib
import logging
import os
import runpy
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import _common as C

from lmrecipe.errors import fail

PAIRS = 6
SIDES = ("off", "on")


def options(parser) -> None:
    C.add_wide_model_options(parser)
    parser.add_argument("--uploads", type=int, default=3, help="timed uploads for the throughput (default: %(default)s)")
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint to use (default: start a local SeaweedFS)")
    parser.add_argument("--bucket", default=None, help="an existing bucket at --endpoint (credentials: AWS_* variables)")


def check(args) -> None:
    if args.endpoint and not args.bucket:
        raise fail(f"--endpoint {args.endpoint} needs --bucket: name a bucket that exists there.")


def run(args, report) -> None:
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench_remote_", dir=args.tmp) as tmp, contextlib.ExitStack() as stack:
        bucket = args.bucket
        if args.endpoint is None:  # the tests' local SeaweedFS
            server = runpy.run_path(str(C.ROOT / "tests" / "s3_server.py"))["S3Server"](Path(tmp) / "server")
            server.start()
            stack.callback(server.stop)
            os.environ.update(server.env())
            bucket = server.make_bucket(f"bench-{uuid.uuid4().hex[:8]}")
        else:
            os.environ["AWS_ENDPOINT_URL"] = args.endpoint
        measure(args, report, Path(tmp), f"s3://{bucket}/bench")


def measure(args, report, tmp: Path, url: str) -> None:
    from lmrecipe.checkpoint.remote import CheckpointMirror
    from lmrecipe.objstore import Store
    from lmrecipe.train.callbacks.checkpointing import build_checkpointer
    from lmrecipe.train.callbacks.remote import Uploader
    from lmrecipe.train.state import TrainState

    run = C.build_wide_run(args, tmp / "run", ["checkpoint.keep_last=2"])
    checkpointer = build_checkpointer(run, tmp / "run")
    store, state = Store.open(url), TrainState()

    def save():
        C.advance(run, state)  # each save its own folder
        with C.quiet_stdout():
            return checkpointer.maybe_save(run.model, state)

    C.advance(run, state)
    size_mb = C.folder_mb(save())
    report.line(f"model {run.n_params / 1e6:.1f}M params, checkpoint {size_mb:,.1f} MB, {args.steps_between} steps "
                f"between saves, threads {args.threads or 'default'}, object storage {os.environ.get('AWS_ENDPOINT_URL')}")
    mirror, speeds = CheckpointMirror(store, checkpointer.root, rank=0, world_size=1, keep_last=2), []
    for i in range(args.uploads):
        folder, start = save(), time.perf_counter()
        mirror.upload(folder)
        speeds.append(size_mb / (time.perf_counter() - start))
        report.line(f"upload {i + 1}: {size_mb:,.1f} MB at {speeds[-1]:,.1f} MB/s")
    report.line(f"upload throughput: {C.fmt_ratio(C.ratio_stats(speeds), ' MB/s')}")
    uploader = Uploader(CheckpointMirror(store, checkpointer.root, rank=0, world_size=1, keep_last=2))
    uploader.pinned = checkpointer.store.pinned

    def one_round(side: str) -> float:
        start, folder = time.perf_counter(), save()
        with C.quiet_stdout():
            if side == "on":
                uploader.submit(folder)
            for _ in range(args.steps_between):
                C.advance(run, state)
        seconds = time.perf_counter() - start
        while uploader.busy():  # drained outside the timed part: the next round starts with the worker idle
            time.sleep(0.01)
        return seconds

    times, stats = C.interleave(report, args.pairs, SIDES, one_round, {"ratio": lambda g: g["on"] / g["off"]},
                                lambda g: f"off {1e3 * g['off']:,.0f} ms | on {1e3 * g['on']:,.0f} ms", warm_up=True)
    uploader.close()
    report.line(f"round (save + {args.steps_between} steps), upload on / off: {C.fmt_ratio(stats['ratio'])}; median off "
                f"{1e3 * statistics.median(times['off']):,.0f} ms, on {1e3 * statistics.median(times['on']):,.0f} ms")
    report.figures = {"checkpoint_mb": size_mb, "upload_mb_s": speeds, "stall_ratio": stats["ratio"], "times_s": times,
                      "n_params": run.n_params, "steps_between": args.steps_between}
    run.prefetcher.close()
