"""tools/offline_install.py and tools/offline_pack.sh, the install on an offline node: a pack of a wheel built here
installs with no index into its own folder, once; a missing, incomplete or stale pack exits 2 with the fix and
installs nothing."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

TOOL = ROOT / "tools" / "offline_install.py"


def wheel(folder: Path, name: str, version: str, source: str) -> str:
    """A pure-Python wheel of one module ``name`` holding ``source``, written by hand (no build, no index)."""
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": source, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    filename = f"{name}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / filename, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return filename


def pack(folder: Path, requirement: str, *files: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "files.txt").write_text("".join(f"{f}\n" for f in files))
    (folder / "requirements.txt").write_text(requirement + "\n")
    return folder


def install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.slow
def test_a_pack_installs_offline_into_its_folder_once(tmp_path):
    name = "lmrecipe_offline_probe"
    packed = pack(tmp_path / "pack", f"{name}==1.0", wheel(tmp_path / "pack", name, "1.0", "ANSWER = 42\n"))
    target = tmp_path / "site"
    first = install("--pack", str(packed), "--target", str(target))
    assert first.returncode == 0, first.stderr
    assert f"PYTHONPATH={target}" in first.stdout and "install: 1 wheels" in first.stdout
    probe = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.ANSWER, {name}.__file__)"],
                           capture_output=True, text=True, env={"PYTHONPATH": str(target)})
    assert probe.stdout.split() == ["42", str(target / f"{name}.py")], probe.stderr
    again = install("--pack", str(packed), "--target", str(target), "--json")
    assert again.returncode == 0 and '"installed": "already, by an earlier run"' in again.stdout


def test_a_missing_incomplete_or_stale_pack_exits_2_with_the_fix_and_installs_nothing(tmp_path):
    target = tmp_path / "site"
    missing = install("--pack", str(tmp_path / "nothing"), "--target", str(target))
    assert missing.returncode == 2 and "not a pack" in missing.stderr and "tools/offline_pack.sh" in missing.stderr
    incomplete = pack(tmp_path / "incomplete", "deepspeed==0.0.1", "deepspeed-0.0.1.tar.gz")
    proc = install("--pack", str(incomplete), "--check")
    assert proc.returncode == 2 and "lacks deepspeed-0.0.1.tar.gz" in proc.stderr
    (incomplete / "deepspeed-0.0.1.tar.gz").write_bytes(b"")
    proc = install("--pack", str(incomplete), "--target", str(target))
    assert proc.returncode == 2 and "packed for deepspeed==0.0.1" in proc.stderr and "again" in proc.stderr
    assert not target.exists()
    pinned = next(line for line in (ROOT / "pyproject.toml").read_text().split('"') if line.startswith("deepspeed=="))
    (incomplete / "requirements.txt").write_text(pinned + "\n")
    assert install("--pack", str(incomplete), "--check").returncode == 0


def test_the_pack_script_passes_shellcheck():
    shellcheck = Path(sys.executable).with_name("shellcheck")
    proc = subprocess.run([str(shellcheck), "--shell=bash", str(ROOT / "tools" / "offline_pack.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
