"""`make s3-server` (tests/s3_server.py as a script): a local S3 server on free ports that a run can use as it is
printed, stopped by Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from helpers import ROOT


def test_the_local_s3_server_serves_the_printed_endpoint_until_ctrl_c(tmp_path):
    import boto3

    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "s3_server.py"), "--folder", str(tmp_path / "s3"),
                             "--bucket", "trial"], stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline() for _ in range(3)]
        exports = dict(re.findall(r"(\w+)=(\S+)", lines[1]))
        assert set(exports) == {"AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"}
        client = boto3.client("s3", endpoint_url=exports["AWS_ENDPOINT_URL"], region_name=exports["AWS_DEFAULT_REGION"],
                              aws_access_key_id=exports["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=exports["AWS_SECRET_ACCESS_KEY"])
        client.put_object(Bucket="trial", Key="a", Body=b"bytes")
        assert client.get_object(Bucket="trial", Key="a")["Body"].read() == b"bytes"
        assert "checkpoint.remote=s3://trial/my-run" in lines[2]
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    assert not any(p.isdigit() and "weed" in _cmdline(p) and str(tmp_path) in _cmdline(p) for p in os.listdir("/proc"))


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""
