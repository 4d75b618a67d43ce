"""A real Mooncake master on loopback, started and stopped by the tests.

``mooncake_master`` comes from the ``mooncake-transfer-engine-non-cuda`` wheel (the
``cluster`` extra of kvfs, installed in the dev venv by ``make install``). It runs
with its built-in HTTP metadata server, so one process is the whole cluster's
control plane; every kvfs mount of a test is a client ("node") of it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

LEASE_MS = 500
"""The master's object lease in the tests (Mooncake's default is 10 s): a delete of an
object read or written less than a lease ago is refused until the lease ends."""


def master_binary() -> str | None:
    """The ``mooncake_master`` next to this interpreter, or on PATH."""
    here = Path(sys.executable).parent / "mooncake_master"
    return str(here) if here.exists() else shutil.which("mooncake_master")


def require_mooncake() -> str:
    """The master's path; fails under CI when it is missing, skips elsewhere."""
    path = master_binary()
    if path is None:
        reason = "mooncake_master missing: make install (the cluster extra)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Master:
    """One ``mooncake_master`` (RPC + HTTP metadata) on fixed loopback ports, so that
    a restart comes back at the same address as a real master would."""

    def __init__(self, log: Path, lease_ms: int = LEASE_MS) -> None:
        self.binary = require_mooncake()
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()  # its default (9003) would clash between tests
        self.log = log
        self.lease_ms = lease_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``--cluster`` value that points a kvfs mount at this master."""
        return (
            f"mooncake://127.0.0.1:{self.rpc_port}"
            f"?metadata=http://127.0.0.1:{self.http_port}/metadata"
        )

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        argv = [
            self.binary,
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--default_kv_lease_ttl={self.lease_ms}",
            f"--metrics_port={self.metrics_port}",
        ]
        out = self.log.open("ab")
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        deadline = time.monotonic() + 30
        while not (_listening(self.rpc_port) and _listening(self.http_port)):
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited {self.proc.returncode}: {self.log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"mooncake_master did not listen in 30 s: {self.log}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the master dies as in a crash (its objects' index is lost)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc = None


@contextlib.contextmanager
def running_master(log: Path, lease_ms: int = LEASE_MS) -> Iterator[Master]:
    master = Master(log, lease_ms)
    master.start()
    try:
        yield master
    finally:
        master.stop()
