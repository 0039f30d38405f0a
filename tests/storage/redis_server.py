"""A real redis-server for the tests: on 127.0.0.1, a free port, no persistence, no protected
mode needed (it listens on loopback only); started and stopped by the tests' fixtures. The
binary comes with ``make install`` (Debian's redis-server)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``stop`` kills it, ``start`` brings it back on its port."""

    def __init__(self, maxmemory: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; `make install` installs it")
        self.binary, self.port, self.maxmemory = binary, free_port(), maxmemory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        args = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        args += ["--appendonly", "no", "--daemonize", "no", "--loglevel", "warning"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                if client.ping():
                    break
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                    raise RuntimeError(f"redis-server did not start: {err}") from None
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def flush(self) -> None:
        client = redis.Redis.from_url(self.url)
        client.flushall()
        client.close()
