"""Checkpoints and data in object storage (``checkpoint.remote``, data URLs), against a real S3-compatible server.

The server (``s3_server``, SeaweedFS on free ports, one identity) is shared by the module; each test takes its own
bucket. Training runs in-process except where a process must die (``kill -9`` during an upload) or a script's exit
code is the point (``train.py --dry-run``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES, metric_rows, run_script, script_module

from lmrecipe.config import load_config
from lmrecipe.errors import UserError

COMMON = ["train.max_steps=6", "checkpoint.every_steps=2", "checkpoint.keep_last=1", "train.eval_every_steps=0"]


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The server, its variables set for this test, and a fresh bucket (``s3.bucket``)."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    s3_server.bucket = s3_server.make_bucket(f"t-{uuid.uuid4().hex[:12]}")
    return s3_server


def train_tiny(out_dir: Path, data: str | Path, *overrides: str) -> Path:
    from lmrecipe.train.trainer import train

    train(load_config("recipes/tiny.yaml", [f"out_dir={out_dir}", f"data.path={data}", *TINY_OVERRIDES, *COMMON,
                                            *overrides]))
    return out_dir


def script(path: str):
    """A script of the repository (train.py, tools/export_hf.py) as a module, to call its ``main`` in-process."""
    return script_module(path)


def upload_folder(server, folder: Path, prefix: str) -> str:
    client = server.client()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        client.upload_file(str(path), server.bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://{server.bucket}/{prefix}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def assert_mirrors(server, prefix: str, folder: Path) -> None:
    """The remote objects under ``prefix`` are the files of ``folder``, byte for byte."""
    local = {p.relative_to(folder).as_posix(): sha(p.read_bytes()) for p in folder.rglob("*") if p.is_file()}
    keys = [k for k in server.keys(server.bucket, prefix + "/")]
    remote = {k[len(prefix) + 1:]: sha(server.read(server.bucket, k)) for k in keys}
    assert remote == local


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_data) -> Path:
    """The uninterrupted run, without object storage."""
    return train_tiny(tmp_path_factory.mktemp("remote_ref") / "run", tiny_data)


@pytest.mark.slow
def test_a_run_killed_during_an_upload_resumes_exactly_on_a_fresh_node_from_the_server(s3, reference, tiny_data,
                                                                                       tmp_path, monkeypatch, capsys):
    data_url = upload_folder(s3, tiny_data, "data/tiny")
    remote = f"s3://{s3.bucket}/run"
    cache = tmp_path / "cache"
    # Node 1: trains from the data URL, uploads step 2, and is killed (SIGKILL) two files into the upload of the next
    # checkpoint (step 4; or step 6 where a loaded machine saved it before step 4's upload began, superseding it).
    killed = run_script(["train.py", "recipes/tiny.yaml", f"out_dir={tmp_path / 'node1'}", f"data.path={data_url}",
                         f"data.cache_dir={cache}", *TINY_OVERRIDES, *COMMON, f"checkpoint.remote={remote}"],
                        check=False, env_extra={**s3.env(), "LMRECIPE_FAULT_KILL_UPLOAD": "step_00000004+:2"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    (cut,) = re.findall(r"Killing this process during the upload of (step_\d+)", killed.stderr)
    assert cut in ("step_00000004", "step_00000006")
    keys = s3.keys(s3.bucket, "run/checkpoints/")
    assert s3.read(s3.bucket, "run/checkpoints/latest") == b"step_00000002\n"
    assert "run/checkpoints/step_00000002/train_state.json" in keys
    partial = [k for k in keys if k.startswith(f"run/checkpoints/{cut}/")]
    assert len(partial) == 2 and not any(k.endswith("train_state.json") for k in partial)
    manifest = json.loads(s3.read(s3.bucket, "run/checkpoints/step_00000002/train_state.json"))["manifest"]
    assert {k.split("step_00000002/")[1] for k in keys if "step_00000002/" in k} == {*manifest, "train_state.json"}

    # Node 2: no local folder, its own empty data cache; resumes from the remote latest and ends as if never stopped.
    node2 = train_tiny(tmp_path / "node2", data_url, f"data.cache_dir={tmp_path / 'cache2'}",
                       f"checkpoint.remote={remote}", "checkpoint.export_at_end=true", "checkpoint.export_dtype=fp32")
    got, want = metric_rows(node2, "loss"), metric_rows(reference, "loss")
    assert sorted(got) == [3, 4, 5, 6]
    assert got == {s: want[s] for s in got}  # exactly: the same data, weights, optimizer state and RNG
    assert s3.read(s3.bucket, "run/checkpoints/latest") == b"step_00000006\n"
    steps = {k.split("/")[2] for k in s3.keys(s3.bucket, "run/checkpoints/step_")}
    assert steps == {"step_00000006"}  # keep_last=1 remotely: step 2 and the partial step 4 are gone
    assert_mirrors(s3, "run/checkpoints/step_00000006", node2 / "checkpoints" / "step_00000006")
    assert_mirrors(s3, "run/export", node2 / "export")
    for name in ("report.md", "final.json", "metrics.jsonl"):
        assert s3.read(s3.bucket, f"run/{name}") == (node2 / name).read_bytes()

    # A dry run on a third fresh node names the remote checkpoint it would download.
    capsys.readouterr()
    assert script("train.py").main(["recipes/tiny.yaml", "--dry-run", f"out_dir={tmp_path / 'node3'}",
                                    f"data.path={tiny_data}", *TINY_OVERRIDES, f"checkpoint.remote={remote}"]) == 0
    assert f"resumes from {remote}/checkpoints/step_00000006 (newer than" in capsys.readouterr().out
    # The remote run reads like a local one: tools/export_hf.py (and eval.py) download its newest checkpoint first.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the checkpoint cache: ~/.cache/lmrecipe/checkpoints
    assert script("tools/export_hf.py").main([remote, str(tmp_path / "exported"), "--dtype", "fp32"]) == 0
    for name in [p.name for p in (node2 / "export").glob("*.safetensors")]:
        assert (tmp_path / "exported" / name).read_bytes() == (node2 / "export" / name).read_bytes()


def test_the_server_stopping_during_an_upload_delays_it_and_training_goes_on(s3, reference, tiny_data, tmp_path,
                                                                             monkeypatch, caplog):
    from lmrecipe.checkpoint import remote as remote_module

    out = tmp_path / "run"
    upload = remote_module.CheckpointMirror.upload
    stopped, restarter = threading.Event(), []

    def back_when_training_went_on():
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "step_00000004").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        s3.start()

    def upload_after_an_outage(self, folder):
        if not stopped.is_set():
            stopped.set()
            s3.stop(grace_s=0.5)
            restarter.append(threading.Thread(target=back_when_training_went_on, daemon=True))
            restarter[0].start()
        return upload(self, folder)

    monkeypatch.setattr(remote_module.CheckpointMirror, "upload", upload_after_an_outage)
    caplog.set_level(logging.INFO)
    try:
        train_tiny(out, tiny_data, f"checkpoint.remote=s3://{s3.bucket}/run")
    finally:  # the server is back (and no thread left to start it later) whatever happened
        for thread in restarter:
            thread.join()
    assert any(r.levelno == logging.WARNING and "Object storage unreachable" in r.getMessage() for r in caplog.records)
    assert metric_rows(out, "loss") == metric_rows(reference, "loss")  # training went on, unchanged
    assert s3.read(s3.bucket, "run/checkpoints/latest") == b"step_00000006\n"
    assert_mirrors(s3, "run/checkpoints/step_00000006", out / "checkpoints" / "step_00000006")


def test_an_upload_that_cannot_finish_by_the_end_is_named_and_uploaded_by_the_next_run(s3, tiny_data, tmp_path,
                                                                                       monkeypatch, caplog):
    from lmrecipe.checkpoint import remote as remote_module

    out = tmp_path / "run"
    upload = remote_module.CheckpointMirror.upload

    def upload_while_down(self, folder):
        s3.stop(grace_s=0.5)
        return upload(self, folder)

    monkeypatch.setattr(remote_module.CheckpointMirror, "upload", upload_while_down)
    caplog.set_level(logging.INFO)
    try:
        train_tiny(out, tiny_data, f"checkpoint.remote=s3://{s3.bucket}/run", "checkpoint.remote_wait_s=1",
                   "train.max_steps=4", "schedule.decay=constant")  # lengthened below at the same rate
    finally:
        s3.start()
    missing = [r.getMessage() for r in caplog.records if "Not uploaded to" in r.getMessage()]
    assert len(missing) == 1 and "step_00000004" in missing[0] and "checkpoint.remote_wait_s=1" in missing[0]
    assert json.loads((out / "final.json").read_text())["remote_not_uploaded"] == ["step_00000004"]
    assert (out / "checkpoints" / "step_00000004" / "train_state.json").is_file()  # the local checkpoint is whole
    assert "run/checkpoints/latest" not in s3.keys(s3.bucket, "run/")

    monkeypatch.setattr(remote_module.CheckpointMirror, "upload", upload)
    train_tiny(out, tiny_data, f"checkpoint.remote=s3://{s3.bucket}/run", "train.max_steps=6", "schedule.decay=constant")
    assert s3.read(s3.bucket, "run/checkpoints/latest") == b"step_00000006\n"




def test_a_remote_latest_naming_a_missing_checkpoint_stops_a_fresh_run_before_it_uploads(s3, tiny_data, tmp_path,
                                                                                        capsys):
    url, client = f"s3://{s3.bucket}/run", s3.client()
    state = json.dumps({"format_version": 1, "state": {"step": 6}, "manifest": {}})
    client.put_object(Bucket=s3.bucket, Key="run/checkpoints/step_00000006/train_state.json", Body=state.encode())
    client.put_object(Bucket=s3.bucket, Key="run/checkpoints/latest", Body=b"step_00000008\n")  # deleted, or not copied
    before = {key: s3.read(s3.bucket, key) for key in s3.keys(s3.bucket, "run/")}
    refusal = f"The remote latest ({url}/checkpoints/latest) names 'step_00000008', which is not a complete checkpoint"
    with pytest.raises(UserError) as err:
        train_tiny(tmp_path / "fresh", tiny_data, f"checkpoint.remote={url}")
    message = str(err.value)
    assert message.startswith(refusal) and "the complete remote checkpoints are step_00000006" in message
    assert "write step_00000006 into it" in message
    assert {key: s3.read(s3.bucket, key) for key in s3.keys(s3.bucket, "run/")} == before  # nothing uploaded over it
    assert not (tmp_path / "fresh" / "metrics.jsonl").exists() and not list(tmp_path.glob("fresh/checkpoints/step_*"))
    code = script("train.py").main(["recipes/tiny.yaml", "--dry-run", f"out_dir={tmp_path / 'dry'}",
                                    f"data.path={tiny_data}", *TINY_OVERRIDES, f"checkpoint.remote={url}"])
    assert code == 2 and refusal in capsys.readouterr().err


def remote_run(server, reference: Path, prefix: str) -> str:
    """The URL of a remote run holding ``reference``'s checkpoint step 6, its ``latest`` pointing at it."""
    upload_folder(server, reference / "checkpoints" / "step_00000006", f"{prefix}/checkpoints/step_00000006")
    server.client().put_object(Bucket=server.bucket, Key=f"{prefix}/checkpoints/latest", Body=b"step_00000006\n")
    return f"s3://{server.bucket}/{prefix}"


def assert_untouched(out: Path) -> None:
    """Nothing trained, downloaded or left half-written in ``out``."""
    assert not (out / "metrics.jsonl").exists()
    assert not [p.name for p in (out / "checkpoints").iterdir()] if (out / "checkpoints").exists() else True


def test_a_damaged_remote_checkpoint_is_named_by_its_url_and_leaves_no_partial_download(s3, reference, tiny_data,
                                                                                       tmp_path, monkeypatch, capsys):
    url = remote_run(s3, reference, "run")
    weights = (reference / "checkpoints" / "step_00000006" / "model.safetensors").read_bytes()
    s3.client().put_object(Bucket=s3.bucket, Key="run/checkpoints/step_00000006/model.safetensors",
                           Body=b"\xff" * 8 + weights[8:])  # the same size, a header length past the end
    damaged = (f"The remote checkpoint {url}/checkpoints/step_00000006 is damaged: model.safetensors has an "
               "impossible header length (its size is right, its content is not).")
    with pytest.raises(UserError) as err:
        train_tiny(tmp_path / "fresh", tiny_data, f"checkpoint.remote={url}")
    message = str(err.value)
    assert message.startswith(damaged) and f"the local folder {tmp_path / 'fresh' / 'checkpoints'} is unchanged" in message
    assert f"write the name of an earlier complete checkpoint into {url}/checkpoints/latest" in message
    assert ".tmp_" not in message and "checkpoint.resume=" not in message
    assert_untouched(tmp_path / "fresh")
    # eval.py names the same URL, not the cache folder it downloads into.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    capsys.readouterr()
    assert script("eval.py").main([url, "--data", str(tiny_data)]) == 2
    err_text = capsys.readouterr().err
    assert damaged in err_text and str(tmp_path / "home") not in err_text and "Traceback" not in err_text


def test_a_remote_run_of_another_seed_is_refused_before_anything_is_downloaded(s3, reference, tiny_data, tmp_path):
    url = remote_run(s3, reference, "other_run")
    with pytest.raises(UserError) as err:
        train_tiny(tmp_path / "mine", tiny_data, f"checkpoint.remote={url}", "train.seed=7")
    assert str(err.value).startswith(f"Cannot resume from {url}/checkpoints/step_00000006: this run differs in what "
                                     "the checkpoint's weights, optimizer state or data position depend on "
                                     "(train.seed: 1337 -> 7)")
    assert_untouched(tmp_path / "mine")


def test_wrong_credentials_and_a_missing_bucket_stop_before_the_first_step(s3, tiny_data, tmp_path, monkeypatch,
                                                                           capsys):
    url = f"s3://{s3.bucket}/run"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    code = script("train.py").main(["recipes/tiny.yaml", "--dry-run", f"out_dir={tmp_path / 'a'}", f"data.path={tiny_data}",
                                *TINY_OVERRIDES, f"checkpoint.remote={url}"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"checkpoint.remote={url}: access denied" in err and "AWS_SECRET_ACCESS_KEY" in err
    assert "Traceback" not in err

    with pytest.raises(UserError, match="access denied"):
        train_tiny(tmp_path / "b", tiny_data, f"checkpoint.remote={url}")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env()["AWS_SECRET_ACCESS_KEY"])
    with pytest.raises(UserError, match="the bucket does not exist.*Create it"):
        train_tiny(tmp_path / "c", tiny_data, "checkpoint.remote=s3://no-such-bucket-here/run")
    for out in (tmp_path / "b", tmp_path / "c"):
        assert not (out / "metrics.jsonl").exists() and not list(out.glob("checkpoints/step_*"))


def test_a_data_url_is_staged_verified_and_reused(s3, tiny_data, tmp_path, caplog, capsys):
    from lmrecipe.data.remote import stage

    url = upload_folder(s3, tiny_data, "data/tiny")
    # A dry run reads the remote meta.json and downloads nothing.
    code = script("train.py").main(["recipes/tiny.yaml", "--dry-run", f"out_dir={tmp_path / 'run'}", f"data.path={url}",
                                    f"data.cache_dir={tmp_path / 'cache'}", *TINY_OVERRIDES])
    assert code == 0 and f"data {url}: in object storage" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()
    caplog.set_level(logging.INFO)
    local = stage(url, str(tmp_path / "cache"))
    assert {p.name: p.read_bytes() for p in local.iterdir() if p.name[0] != "."} == \
        {p.name: p.read_bytes() for p in tiny_data.iterdir() if p.is_file()}
    assert stage(url, str(tmp_path / "cache")) == local
    assert sum("using the cached copy" in r.getMessage() for r in caplog.records) == 1

    # Tokens changed under the URL with meta.json left as it was: the sha256 meta.json records catches it.
    bad = bytearray((tiny_data / "train.bin").read_bytes())
    bad[100] ^= 0xFF
    s3.client().put_object(Bucket=s3.bucket, Key="data/bad/train.bin", Body=bytes(bad))
    for name in ("meta.json", "val.bin", "val.idx", "train.idx", "tokenizer.json"):
        if (tiny_data / name).is_file():
            s3.client().upload_file(str(tiny_data / name), s3.bucket, f"data/bad/{name}")
    with pytest.raises(UserError, match="train.bin does not match the sha256"):
        stage(f"s3://{s3.bucket}/data/bad", str(tmp_path / "cache"))
    assert not any("bad" in p.name and not p.name.endswith(".lock") for p in (tmp_path / "cache").iterdir())
    shutil.rmtree(tmp_path / "cache")


@pytest.mark.slow
def test_a_two_process_zero2_run_resumes_from_the_server_on_one_process(s3, tiny_data, tmp_path):
    remote = f"s3://{s3.bucket}/z"
    zero2 = ["distributed.deepspeed_config=ds_configs/zero2.json", "checkpoint.keep_last=2", "train.max_steps=4"]
    # Two ranks, each uploading its own ZeRO shards and RNG file; the run stops at step 3, after step 2's upload.
    crashed = run_script(["train.py", "recipes/tiny.yaml", f"out_dir={tmp_path / 'a'}", f"data.path={tiny_data}",
                          *TINY_OVERRIDES, *COMMON, *zero2, f"checkpoint.remote={remote}"], nproc=2, check=False,
                         env_extra={**s3.env(), "LMRECIPE_FAULT_OOM_AT_STEP": "3"})
    assert crashed.returncode != 0 and "out of memory" in crashed.stderr
    source = tmp_path / "a" / "checkpoints" / "step_00000002"
    assert s3.read(s3.bucket, "z/checkpoints/latest") == b"step_00000002\n"
    assert any("zero_pp_rank_1" in k for k in s3.keys(s3.bucket, "z/checkpoints/step_00000002/"))
    assert not s3.keys(s3.bucket, "z/checkpoints/.uploads/")
    remote_files = {k.split("step_00000002/")[1] for k in s3.keys(s3.bucket, "z/checkpoints/step_00000002/")}
    assert remote_files == {p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file()}

    # One process without DeepSpeed: from the server on a fresh node, and from the local folder: the same run.
    fresh = train_tiny(tmp_path / "b", tiny_data, "train.max_steps=4", f"checkpoint.remote={remote}")
    local = train_tiny(tmp_path / "c", tiny_data, "train.max_steps=4", f"checkpoint.resume={source}")
    got, want = metric_rows(fresh, "loss"), metric_rows(local, "loss")
    assert sorted(got) == [3, 4] and got == want
