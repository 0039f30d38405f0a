"""MooncakeMaster: one ``mooncake_master`` process on 127.0.0.1 (the binary that
``mooncake-transfer-engine-non-cuda`` installs), for tests, benchmarks and single-machine runs;
MooncakeLender: a ``mooncake_client`` process lending memory to it.

Mooncake's clients and its built-in metadata server listen on every address whatever they are
told, so anything short of a real deployment belongs in a loopback-only network namespace
(``unshare -n`` then ``ip link set lo up``, as ``make test`` does); ``loopback_only`` says
whether this process is in one.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

from tiered_kv.errors import StorageOpenError


def loopback_only() -> bool:
    """Whether the only network interface this process sees is ``lo``."""
    return [name for _, name in socket.if_nameindex()] == ["lo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> str | None:
    """``mooncake_master`` beside this interpreter (a venv's bin), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    return here if os.access(here, os.X_OK) else shutil.which("mooncake_master")


class MooncakeMaster:
    """One master process; ``stop`` kills it, ``start`` brings it back (empty) on its port.

    ``lease_ms``: how long a read keeps an object from eviction and plain removal (the
    master's ``default_kv_lease_ttl``)."""

    def __init__(self, *, lease_ms: int = 10_000, start_timeout_s: float = 10.0) -> None:
        binary = master_binary()
        if binary is None:
            raise StorageOpenError(
                "mooncake_master is not installed; pip install mooncake-transfer-engine-non-cuda "
                "(`make install` does)"
            )
        self.binary, self.lease_ms, self.start_timeout_s = binary, lease_ms, start_timeout_s
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [
            self.binary,
            f"--rpc_port={self.port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            f"--default_kv_lease_ttl={self.lease_ms}",
            "--enable_http_metadata_server=false",
        ]
        # Its log goes nowhere: a pipe nobody reads would fill and stall the master.
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while not _accepts(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise StorageOpenError(
                    f"mooncake_master did not listen on {self.address} within "
                    f"{self.start_timeout_s} s"
                )
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None


class MooncakeLender:
    """A ``mooncake_client`` process lending ``nbytes`` of its memory to the store at
    ``master``: the store's memory outlives the nodes that use it, and their bytes cross the
    transport (stores on it give ``segment_bytes=0``)."""

    def __init__(self, master: str, nbytes: int, *, start_timeout_s: float = 10.0) -> None:
        binary = os.path.join(os.path.dirname(master_binary() or ""), "mooncake_client")
        if not os.access(binary, os.X_OK):
            raise StorageOpenError(
                "mooncake_client is not installed beside mooncake_master; pip install "
                "mooncake-transfer-engine-non-cuda"
            )
        self.port = free_port()
        args = [
            binary,
            f"--master_server_address={master}",
            "--metadata_server=P2PHANDSHAKE",
            f"--global_segment_size={nbytes}",
            "--host=127.0.0.1",
            f"--port={self.port}",
            "--protocol=tcp",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while not _accepts(self.port):  # its service port opens once its segment is mounted
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise StorageOpenError(f"mooncake_client did not start within {start_timeout_s} s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False
