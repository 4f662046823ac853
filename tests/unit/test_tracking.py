"""The trackers' start-up check (``check_trackers``): a tracker that cannot start stops the run with exit 2 and its
fix before anything is written to ``out_dir``; an unreachable server is found with one request, not minutes of
retries."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_OVERRIDES, free_port, write_data

from lmrecipe.config import load_config
from lmrecipe.errors import UserError
from lmrecipe.observe.trackers import check_trackers

TRACKER_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE", "WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY",
               "WANDB_BASE_URL", "NETRC", "WANDB_CONFIG_DIR")


@pytest.fixture(autouse=True)
def clean_tracker_env(monkeypatch, tmp_path):
    """No tracker variable of the caller's, and a home without a wandb login; the wandb service a check started
    (``wandb.login`` with a key starts one in this process, named in ``WANDB_SERVICE``) ends with the test."""
    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_SERVICE", "")  # recorded: the caller's value (or none) comes back after the test
    monkeypatch.delenv("WANDB_SERVICE")
    yield
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


def refused(names: list[str], out_dir: Path, match: str) -> str:
    with pytest.raises(UserError, match=match) as err:
        check_trackers(names, out_dir)
    assert err.value.exit_code == 2
    return str(err.value)


def test_trackers_that_can_start_pass_and_the_check_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    check_trackers(["wandb", "tensorboard", "mlflow"], out)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}")
    check_trackers(["mlflow"], out)
    assert not out.exists() and not (tmp_path / "store").exists()


def test_a_tensorboard_folder_that_is_a_file_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("not a folder")
    message = refused(["tensorboard"], out, "which is a file, not a folder")
    assert "move the file away" in message
    assert sorted(p.name for p in out.iterdir()) == ["tensorboard"]


def test_an_unreachable_mlflow_server_is_refused_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    start = time.monotonic()
    message = refused(["mlflow"], tmp_path / "run", "did not answer")
    assert time.monotonic() - start < 5
    assert "or unset it (a SQLite store in out_dir)" in message


@pytest.mark.parametrize("uri, match", [
    ("sqlite:////proc/lmrecipe-store/mlflow.db", "cannot be created"),  # /proc takes no new folder, not even root's
    ("file:///tmp/mlruns", "MLFLOW_ALLOW_FILE_STORE=true"),  # MLflow 3 refuses a file store unless told
])
def test_an_mlflow_store_that_cannot_be_written_is_refused(tmp_path, monkeypatch, uri, match):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    refused(["mlflow"], tmp_path / "run", match)


def test_wandb_online_without_a_login_is_refused_with_the_offline_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    message = refused(["wandb"], tmp_path / "run", "no wandb login was found")
    assert "WANDB_MODE=offline" in message and "wandb sync" in message
    monkeypatch.delenv("WANDB_MODE")  # without WANDB_MODE and without a login, wandb logs offline
    check_trackers(["wandb"], tmp_path / "run")


def test_wandb_online_with_a_login_and_no_server_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")
    refused(["wandb"], tmp_path / "run", "did not answer.*WANDB_MODE=offline")


@pytest.mark.parametrize("env, match", [
    ({"WANDB_MODE": "onlin"}, "is not a wandb mode"),
    ({"WANDB_MODE": "offline", "WANDB_DIR": "FILE/sub"}, r"cannot be created \(.* is a file\).*WANDB_DIR"),
])
def test_a_wandb_mode_or_folder_that_cannot_work_is_refused(tmp_path, monkeypatch, env, match):
    (tmp_path / "FILE").write_text("")
    for name, value in env.items():
        monkeypatch.setenv(name, value.replace("FILE", str(tmp_path / "FILE")))
    refused(["wandb"], tmp_path / "run", match)


def test_a_run_whose_tracker_cannot_start_writes_nothing(tmp_path, monkeypatch):
    """Through train(): exit 2 before config.yaml, metrics.jsonl or run_meta.json exist."""
    from lmrecipe.train.trainer import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    out = tmp_path / "run"
    cfg = load_config("recipes/tiny.yaml", [f"out_dir={out}", f"data.path={write_data(tmp_path / 'data')}",
                                            *TINY_OVERRIDES, "train.max_steps=2", "logging.trackers=[mlflow]"])
    with pytest.raises(UserError, match="did not answer") as err:
        train(cfg)
    assert err.value.exit_code == 2 and not out.exists()
