"""Object storage that answers badly: a real S3-compatible server behind a fault proxy (tests/s3_server.py's
``FaultProxy``: chosen requests answer 500), or no server at all. Every read a command waits on before it can start
has a deadline, a signal stops the wait at once, and each case ends in exit 2 (or the signal's code) with one
paragraph naming the problem and the fix, nothing written. The patience is shortened here (60 s in a run)."""

from __future__ import annotations

import importlib
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES, script_module

from lmrecipe.config import load_config
from lmrecipe.errors import UserError

HEAL_AFTER_S = 30.0
"""The proxy stops failing after this long whatever happens: a wait with no deadline ends, and its test fails."""


@pytest.fixture
def faulty(s3_server, monkeypatch):
    """The server behind a fault proxy (``faulty.proxy``), the variables pointing at the proxy, a fresh bucket
    (``faulty.bucket``); the faults heal after :data:`HEAL_AFTER_S`."""
    from s3_server import FaultProxy

    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    s3_server.bucket = s3_server.make_bucket(f"f-{uuid.uuid4().hex[:12]}")
    proxy = FaultProxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    healer = threading.Timer(HEAL_AFTER_S, proxy.heal)
    healer.start()
    s3_server.proxy = proxy
    yield s3_server
    healer.cancel()
    proxy.close()


@pytest.fixture
def short_patience(monkeypatch):
    """Each remote read retries for 1 s instead of 60 s, in every module that waits on one."""
    modules = ("lmrecipe.objstore", "lmrecipe.train.callbacks.remote", "lmrecipe.data.remote", "lmrecipe.train.preflight")
    for module in modules:  # imported before any is patched: one imported after would bind 1 s, and keep it after the test
        importlib.import_module(module)
    for module in modules:
        monkeypatch.setattr(f"{module}.READ_PATIENCE_S", 1.0)


def train_tiny(out_dir: Path, data, *overrides: str) -> None:
    from lmrecipe.train.trainer import train

    train(load_config("recipes/tiny.yaml", [f"out_dir={out_dir}", f"data.path={data}", *TINY_OVERRIDES,
                                            "train.max_steps=2", "train.eval_every_steps=0", *overrides]))


def script(path: str):
    return script_module(path)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def latest_failing(server) -> str:
    """The URL of a remote run whose ``checkpoints/latest`` exists and answers every GET with 500."""
    server.client().put_object(Bucket=server.bucket, Key="run/checkpoints/latest", Body=b"step_00000002\n")
    server.proxy.fail("GET", "run/checkpoints/latest")
    return f"s3://{server.bucket}/run"


def assert_nothing_trained(out: Path) -> None:
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("checkpoints/*step_*"))


def test_a_remote_latest_answering_500_stops_the_resume_by_its_deadline(faulty, short_patience, tiny_data, tmp_path):
    url = latest_failing(faulty)
    start = time.monotonic()
    with pytest.raises(UserError) as err:
        train_tiny(tmp_path / "run", tiny_data, f"checkpoint.remote={url}")
    assert time.monotonic() - start < HEAL_AFTER_S
    message = str(err.value)
    assert err.value.exit_code == 2 and message.startswith(f"Downloading the newest checkpoint of {url} failed")
    assert "injected fault" in message and "checkpoint.resume=none" in message
    assert_nothing_trained(tmp_path / "run")
    # The dry run reads the same pointer: a problem named, not a wait.
    code = script("train.py").main(["recipes/tiny.yaml", "--dry-run", f"out_dir={tmp_path / 'dry'}",
                                    f"data.path={tiny_data}", *TINY_OVERRIDES, f"checkpoint.remote={url}"])
    assert code == 2 and time.monotonic() - start < HEAL_AFTER_S


@pytest.mark.parametrize("signum, exit_code", [(signal.SIGTERM, 124), (signal.SIGINT, 130)])
def test_a_signal_stops_a_wait_for_object_storage_at_once(faulty, tiny_data, tmp_path, signum, exit_code):
    from lmrecipe.train.callbacks import remote

    assert remote.READ_PATIENCE_S > HEAL_AFTER_S  # the run's patience: only the signal can end the wait in time
    url = latest_failing(faulty)
    sent, returned = [], threading.Event()

    def signal_once_waiting():
        deadline = time.monotonic() + HEAL_AFTER_S
        while not any(m == "GET" and p.endswith("checkpoints/latest") for m, p in faulty.proxy.hits):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        time.sleep(0.5)  # in the back-off between two attempts
        if not returned.is_set():  # a signal after the run would hit the test process itself
            sent.append(time.monotonic())
            os.kill(os.getpid(), signum)

    # Ctrl-C as a terminal's process sees it: a pytest-xdist worker starts with SIGINT ignored, and the run keeps an
    # ignored SIGINT ignored (a background job's).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    killer = threading.Thread(target=signal_once_waiting, daemon=True)
    killer.start()
    try:
        with pytest.raises(UserError) as err:
            train_tiny(tmp_path / "run", tiny_data, f"checkpoint.remote={url}")
    finally:
        returned.set()
        killer.join()
        signal.signal(signal.SIGINT, previous)
    assert sent and time.monotonic() - sent[0] < 5
    name = signal.Signals(signum).name
    assert err.value.exit_code == exit_code
    assert str(err.value).startswith(f"Stopped by {name} while waiting for object storage ({url})")
    assert_nothing_trained(tmp_path / "run")


@pytest.fixture
def server_down(monkeypatch):
    """Credentials set and the endpoint a port where nothing listens."""
    from s3_server import ACCESS_KEY, REGION, SECRET_KEY

    for key, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port()}", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                       "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION}.items():
        monkeypatch.setenv(key, value)


def test_eval_export_and_a_data_url_with_the_server_down_exit_2_naming_the_endpoint(server_down, short_patience,
                                                                                     tiny_data, tmp_path, monkeypatch,
                                                                                     capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the checkpoint cache
    for argv in (["eval.py", "s3://bucket/run", "--data", str(tiny_data)],
                 ["tools/export_hf.py", "s3://bucket/run", str(tmp_path / "exported")]):
        assert script(argv[0]).main(argv[1:]) == 2
        err = capsys.readouterr().err
        assert "s3://bucket/run: object storage at http://127.0.0.1:" in err and "could not be read" in err
        assert "Check AWS_ENDPOINT_URL" in err and "Traceback" not in err
    assert not (tmp_path / "exported").exists() and not list((tmp_path / "home").rglob("*.safetensors"))
    with pytest.raises(UserError, match=r"data.path=s3://bucket/data: object storage at .* could not be read"):
        train_tiny(tmp_path / "run", "s3://bucket/data", f"data.cache_dir={tmp_path / 'cache'}")
    assert not (tmp_path / "run").exists()


def test_a_remote_latest_answering_500_or_not_utf8_is_named_by_eval(faulty, short_patience, tiny_data, tmp_path,
                                                                    monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    url = latest_failing(faulty)
    assert script("eval.py").main([url, "--data", str(tiny_data)]) == 2
    err = capsys.readouterr().err
    assert f"{url}: object storage at {faulty.proxy.endpoint} could not be read" in err and "Traceback" not in err
    faulty.proxy.heal()
    faulty.client().put_object(Bucket=faulty.bucket, Key="run/checkpoints/latest", Body=b"\xff\xfestep\n")
    assert script("eval.py").main([url, "--data", str(tiny_data)]) == 2
    err = capsys.readouterr().err
    assert f"{url}/checkpoints/latest names" in err and "not a checkpoint folder (step_N)" in err
    # The resume reads the same pointer: the remote's state named with its fix, nothing trained.
    with pytest.raises(UserError, match=r"The remote latest .* which is not a complete checkpoint there"):
        train_tiny(tmp_path / "run", tiny_data, f"checkpoint.remote={url}")
    assert_nothing_trained(tmp_path / "run")


def test_a_url_whose_client_cannot_connect_is_refused_naming_it(tiny_data, tmp_path, capsys):
    url = f"ftp://127.0.0.1:{closed_port()}/run"
    with pytest.raises(UserError, match=rf"{url}: cannot connect to open this URL \(ConnectionRefusedError"):
        train_tiny(tmp_path / "run", tiny_data, f"checkpoint.remote={url}")
    assert not (tmp_path / "run").exists()
    code = script("train.py").main(["recipes/tiny.yaml", "--dry-run", f"out_dir={tmp_path / 'dry'}",
                                    f"data.path={tiny_data}", *TINY_OVERRIDES, f"checkpoint.remote={url}"])
    assert code == 2 and "cannot connect to open this URL" in capsys.readouterr().err
