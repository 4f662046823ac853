"""The checkpoint mirror's rules, in-process against a ``file://`` store (fsspec's local filesystem): which rank
uploads which file, the commit order (``latest`` only after ``train_state.json``), remote retention, the retries
through an outage, and the upload worker (a newer checkpoint supersedes a queued one; a checkpoint being uploaded is
not pruned locally). The same code against a real S3 server: tests/integration/test_remote.py."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from lmrecipe.checkpoint.remote import CheckpointMirror, owner
from lmrecipe.checkpoint.storage import STATE_FILE, prune_checkpoints
from lmrecipe.errors import UserError
from lmrecipe.objstore import Store, check_access, open_filesystem, retrying


def fake_checkpoint(root: Path, step: int, val_loss: float | None = None) -> Path:
    folder = root / f"step_{step:08d}"
    files = {"model.safetensors": b"w" * (100 + step), "rng/rank_00000.safetensors": b"r0",
             "rng/rank_00001.safetensors": b"r1", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt": b"z1"}
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    state = {"format_version": 1, "state": {"step": step}, "val_loss": val_loss,
             "manifest": {rel: len(data) for rel, data in files.items()}}
    (folder / STATE_FILE).write_text(json.dumps(state))
    return folder


def test_each_rank_owns_the_files_that_name_it_and_the_main_process_the_rest():
    assert owner("model.safetensors", 2) == 0
    assert owner("rng/rank_00001.safetensors", 2) == 1
    assert owner("pytorch_model/zero_pp_rank_3_mp_rank_00_optim_states.pt", 4) == 3
    assert owner("pytorch_model/zero_pp_rank_3_mp_rank_00_optim_states.pt", 2) == 1  # another layout: spread over ranks
    assert owner("hf/tokenizer_config.json", 2) == 0  # "rank" only counts in a file's own name


def test_latest_moves_only_once_every_rank_uploaded_and_retention_applies_remotely(tmp_path):
    local, store = tmp_path / "local", Store.open(f"file://{tmp_path / 'remote'}")
    ranks = [CheckpointMirror(store, local, rank=r, world_size=2, keep_last=1) for r in (0, 1)]
    first = fake_checkpoint(local, 2, val_loss=1.0)
    (local / "best").write_text("step_00000002\n")
    ranks[1].upload(first)
    assert store.child("checkpoints").read_text("latest") is None  # rank 0 has not committed
    assert store.child("checkpoints").files("step_00000002") == {"rng/rank_00001.safetensors": 2,
                                                                 "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt": 2}
    ranks[0].upload(first)
    remote = store.child("checkpoints")
    assert remote.read_text("latest") == "step_00000002\n"
    assert set(remote.files("step_00000002")) == {*json.loads((first / STATE_FILE).read_text())["manifest"], STATE_FILE}
    assert remote.names(".uploads") == []  # the markers are removed after the commit

    for step in (4, 6):
        folder = fake_checkpoint(local, step, val_loss=2.0)
        ranks[1].upload(folder)
        ranks[0].upload(folder)
    # keep_last=1 and the best (the one the local best names) are kept remotely, as locally.
    assert [n for n in remote.names() if n.startswith("step_")] == ["step_00000002", "step_00000006"]
    assert remote.read_text("best") == "step_00000002\n"


def test_an_incomplete_upload_is_never_latest_and_is_pruned_by_the_next_commit(tmp_path):
    local, store = tmp_path / "local", Store.open(f"file://{tmp_path / 'remote'}")
    mirror = CheckpointMirror(store, local, rank=0, world_size=1, keep_last=1)
    mirror.upload(fake_checkpoint(local, 2))
    remote = store.child("checkpoints")
    remote.put_file(local / "step_00000002" / "model.safetensors", "step_00000004/model.safetensors")  # a killed upload
    assert mirror.latest() == ("step_00000002", 2)
    mirror.upload(fake_checkpoint(local, 6))
    assert [n for n in remote.names() if n.startswith("step_")] == ["step_00000006"]


def test_a_remote_latest_naming_a_missing_checkpoint_stops_the_resume_naming_what_is_there(tmp_path):
    from lmrecipe.checkpoint.remote import RemoteLatestError

    local, store = tmp_path / "local", Store.open(f"file://{tmp_path / 'remote'}")
    mirror = CheckpointMirror(store, local, rank=0, world_size=1, keep_last=3)
    for step in (4, 6):
        mirror.upload(fake_checkpoint(local, step))
    remote = store.child("checkpoints")
    assert mirror.resume_point(None) == ("step_00000006", 6) and mirror.resume_point(6) is None
    remote.write_text("latest", "step_00000008\n")  # its checkpoint deleted, or never copied
    for local_step in (None, 6):
        with pytest.raises(RemoteLatestError) as err:
            mirror.resume_point(local_step)
        message = str(err.value)
        assert f"The remote latest ({remote.url_of('latest')}) names 'step_00000008', which is not a complete " \
               "checkpoint there (no step_00000008/train_state.json)" in message
        assert "the complete remote checkpoints are step_00000004, step_00000006" in message
        assert "write step_00000006 into it" in message and "checkpoint.remote to another URL" in message
    assert isinstance(err.value, UserError) and err.value.exit_code == 2
    assert mirror.resume_point(8) is None  # the local folder is as far: nothing to download, its upload repairs latest
    # Without a latest (an upload cut before the first one), the newest complete checkpoint, as locally.
    remote.remove("latest")
    assert mirror.resume_point(None) == ("step_00000006", 6) and mirror.resume_point(6) is None


def test_retrying_warns_once_backs_off_and_gives_up_on_a_permanent_error(monkeypatch, caplog):
    sleeps = []
    monkeypatch.setattr("lmrecipe.objstore._sleep", lambda seconds, should_stop: sleeps.append(seconds))
    outcomes = iter([ConnectionError("refused")] * 5 + ["done"])

    def flaky():
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    caplog.set_level(logging.INFO)
    assert retrying(flaky, "uploading x") == "done"
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert [r.levelname for r in caplog.records if "uploading x" in r.getMessage()] == ["WARNING", "INFO"]
    with pytest.raises(PermissionError):
        retrying(lambda: (_ for _ in ()).throw(PermissionError("denied")), "uploading y")
    assert len(sleeps) == 5


def test_a_checkpoint_being_uploaded_is_not_pruned_locally(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    removed = prune_checkpoints(tmp_path, keep_last=1, pinned=frozenset({tmp_path / "step_00000002"}))
    assert [p.name for p in removed] == ["step_00000004"]


def test_the_access_check_names_the_url_and_the_fix(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(UserError, match=r"checkpoint.remote=file://.*/a_file/run: object storage cannot be written"):
        check_access(f"file://{tmp_path / 'a_file'}/run", "checkpoint.remote")
    assert check_access(f"file://{tmp_path / 'new'}/run", "checkpoint.remote").names() == []  # nothing left behind
    with pytest.raises(UserError, match=r"nosuchscheme://bucket/x: fsspec cannot open this URL"):
        open_filesystem("nosuchscheme://bucket/x")


@pytest.mark.parametrize("url", ["s3://", "s3:///runs/a", "gs://"])
def test_a_url_with_no_bucket_is_refused_naming_the_bucket_not_the_endpoint(url, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: a request would blame it
    with pytest.raises(UserError) as err:
        check_access(url, "checkpoint.remote")
    assert str(err.value) == (f"checkpoint.remote={url} names no bucket: the bucket comes right after "
                              f"{url[:5].rstrip(':/')}://. Write the URL as {url[:5].rstrip(':/')}://BUCKET/PREFIX "
                              f"(e.g. {url[:5].rstrip(':/')}://my-bucket/runs/NAME).")
    with pytest.raises(UserError, match=rf"^{url} names no bucket"):  # eval.py, export_hf.py, data.path
        open_filesystem(url)


class BlockingMirror:
    """Stands for CheckpointMirror: records what it uploads, the first upload held until released."""

    def __init__(self):
        import threading

        self.release, self.started = threading.Event(), threading.Event()
        self.uploaded: list[str] = []
        self.store = Store.open("file:///nowhere")
        self.bytes_done = 0

    def upload(self, folder: Path) -> None:
        self.started.set()
        self.release.wait(10)
        self.uploaded.append(folder.name)


def test_a_newer_checkpoint_supersedes_a_queued_one_and_what_the_worker_holds_stays_pinned(tmp_path):
    from lmrecipe.train.callbacks.remote import Uploader

    mirror = BlockingMirror()
    uploader = Uploader(mirror)
    pinned = uploader.pinned
    folders = [fake_checkpoint(tmp_path, step) for step in (2, 4, 6)]
    uploader.submit(folders[0])
    assert mirror.started.wait(10)
    uploader.submit(folders[1])
    uploader.submit(folders[2])  # step 4 never started: superseded
    assert pinned == {folders[0], folders[2]}
    mirror.release.set()
    assert uploader.wait(10, progress=False) == []
    uploader.close()
    assert mirror.uploaded == ["step_00000002", "step_00000006"] and pinned == set()


def test_without_the_client_libraries_a_url_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs now raises ImportError
    with pytest.raises(UserError, match=r's3://bucket/run is object storage, which needs the s3fs package: .*'
                                        r'pip install -e "\.\[remote\]"'):
        open_filesystem("s3://bucket/run")


def test_without_gcsfs_a_gcs_url_names_the_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gcsfs", None)
    with pytest.raises(UserError, match=r"gs://bucket/run is Google Cloud Storage, which needs the gcsfs package: "
                                        r"`pip install -e \"\.\[remote\]\" gcsfs`"):
        open_filesystem("gs://bucket/run")
