"""Data preparation: tokenizer round trip, .bin/.idx contents, streaming, determinism, inputs, atomic output, CLI errors."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT, VOCAB, siblings

from lmrecipe.data.format import load_meta, read_meta_file
from lmrecipe.data.prepare import pipeline as prep
from lmrecipe.errors import UserError

SCRIPT = ROOT / "tools" / "prepare_data.py"


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_refuses_existing_output_then_overwrites_it(documents_dir, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("precious")
    result = run_script("--input", str(documents_dir), "--output", str(out_dir), "--vocab-size", str(VOCAB))
    assert result.returncode == 2
    assert "--overwrite" in result.stderr and "Traceback" not in result.stderr
    assert [p.name for p in out_dir.iterdir()] == ["keep.txt"] and siblings(out_dir) == []

    meta = prep.prepare(output=out_dir, inputs=[documents_dir], vocab_size=VOCAB, overwrite=True, num_proc=1)
    assert not (out_dir / "keep.txt").exists()
    assert read_meta_file(out_dir)["splits"] == meta["splits"]
    assert siblings(out_dir) == []


def _error_case(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """CLI arguments for one error case, and a phrase its message must contain."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("one document")
    (docs / "b.txt").write_text("another document")
    if case == "missing input":
        return ["--input", str(tmp_path / "nope.txt")], "does not exist"
    if case == "unknown type":
        (tmp_path / "x.docx").write_bytes(b"PK")
        return ["--input", str(tmp_path / "x.docx")], "Supported"
    if case == "all empty":
        (tmp_path / "blank").mkdir()
        (tmp_path / "blank" / "a.txt").write_text("")
        (tmp_path / "blank" / "b.md").write_text("\n\n")
        return ["--input", str(tmp_path / "blank")], "No documents"
    if case == "one document":
        return ["--input", str(docs / "a.txt")], "at least 2"
    if case == "empty val split":  # both documents hash to train at this val fraction
        return ["--input", str(docs), "--val-fraction", "0.5"], "val split would be empty"
    if case == "sample size":
        return ["--input", str(docs), "--tokenizer-sample-mb", "0"], "must be positive"
    if case == "vocab too small":
        return ["--input", str(docs), "--vocab-size", "257"], "at least 258"
    if case == "val fraction":
        return ["--input", str(docs), "--val-fraction", "0.6"], "(0, 0.5]"
    if case == "missing tokenizer folder":
        return ["--input", str(docs), "--tokenizer", str(tmp_path / "no_tokenizer")], "no such folder"
    if case == "missing text field":
        (tmp_path / "r.jsonl").write_text('{"content": "a"}\n{"content": "b"}\n')
        return ["--input", str(tmp_path / "r.jsonl")], "--text-field"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    ["missing input", "unknown type", "all empty", "one document", "empty val split", "sample size",
     "vocab too small", "val fraction", "missing tokenizer folder", "missing text field"],
)
def test_cli_errors_exit_2_with_a_message_and_write_nothing(tmp_path, case):
    args, phrase = _error_case(tmp_path, case)
    out_dir = tmp_path / "out"
    result = run_script(*args, "--output", str(out_dir))
    assert result.returncode == 2, result.stderr
    assert "error:" in result.stderr and phrase in result.stderr
    assert "Traceback" not in result.stderr
    assert not out_dir.exists() and siblings(out_dir) == []


@pytest.mark.slow
def test_killed_preparation_leaves_nothing_that_training_accepts_and_reruns_cleanly(prepared_documents, tmp_path):
    out_dir = tmp_path / "out"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, str(SCRIPT), "--output", str(out_dir), "--tokenizer", str(prepared_documents[0]), "--num-proc", "1"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # Kill it once tokens are being written: the worst moment, with a half-written train.bin on disk.
        while not any(p.stat().st_size for p in tmp_path.glob("out.tmp-*/train.bin")):
            assert proc.poll() is None, f"finished before it could be killed: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not out_dir.exists()
    [leftover] = siblings(out_dir)
    with pytest.raises(UserError, match="not a prepared data folder"):
        load_meta(tmp_path / leftover)

    result = run_script("--output", str(out_dir), "--tokenizer", str(prepared_documents[0]), "--max-documents", "40",
                        "--val-fraction", "0.2", "--num-proc", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert leftover in result.stderr and "interrupted preparation" in result.stderr
    assert load_meta(out_dir)["source"].endswith("(first 40 documents)")


def test_trained_tokenizer_workers_do_not_import_torch(prepared_documents):
    # Each worker process imports the preparation modules and builds its encoder; torch would add ~200 MB to each.
    code = (
        "import sys\n"
        "from lmrecipe.data.prepare import pipeline\n"
        "from lmrecipe.data.prepare.tokenize import ChunkEncoder, EncoderSpec\n"
        f"encoder = ChunkEncoder(EncoderSpec({str(prepared_documents[0])!r}, True, 0, {VOCAB}, 'uint16'))\n"
        "data, lengths, top = encoder(['def f(x):\\n    return x\\n'])\n"
        "assert len(lengths) == 1 and top < {VOCAB}\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    ).replace("{VOCAB}", str(VOCAB))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
