"""The servers and client pairs ``remote_stores`` measures: a redis-server on 127.0.0.1 and
``RedisStorage`` beside a plain redis-py client; a Mooncake master with a ``mooncake_client``
process lending the store's memory (so every byte crosses the transport) and
``MooncakeStorage`` beside the same process's ``MooncakeDistributedStore``."""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np
import redis

from tiered_kv.bench.page_stores import BenchPages
from tiered_kv.bench.remote_stores import Pair, bench_namespace
from tiered_kv.bench.verify import fail
from tiered_kv.errors import StorageOpenError
from tiered_kv.storage.mooncake_master import MooncakeLender, MooncakeMaster, free_port
from tiered_kv.storage.redis_store import RedisStorage


class RedisProcess:
    """redis-server on 127.0.0.1, a free port, no persistence."""

    def __init__(self, start_timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise StorageOpenError("redis-server is not installed; `make install` installs it")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        args = [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", ""]
        args += ["--appendonly", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2)
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise StorageOpenError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class MooncakeProcesses:
    """A master and a lender of ``lent_bytes``."""

    def __init__(self, lent_bytes: int) -> None:
        self.master = MooncakeMaster()
        try:
            self.lender = MooncakeLender(self.master.address, lent_bytes)
        except BaseException:
            self.master.stop()
            raise

    def stop(self) -> None:
        self.lender.stop()
        self.master.stop()


def redis_pair(url: str, pages: BenchPages) -> Pair:
    ours = RedisStorage(
        bench_namespace(pages.page_nbytes), pages.page_nbytes, url=url, timeout_s=60
    )
    raw = redis.Redis.from_url(url, socket_timeout=60)
    rows = pages.array

    def raw_set(names: list[str], src: list[int]) -> None:
        pipe = raw.pipeline(transaction=False)
        for name, p in zip(names, src, strict=True):
            pipe.set(name, memoryview(rows[p]))
        pipe.execute()

    def raw_get(names: list[str], dst: list[int]) -> list[bool]:
        out = []
        for value, p in zip(raw.mget(names), dst, strict=True):
            if value is not None:
                rows[p] = np.frombuffer(value, dtype=np.uint8)
            out.append(value is not None)
        return out

    def close() -> None:
        ours.close()
        raw.close()

    return Pair("redis", pages, ours, raw_set, raw_get, raw.flushall, close)


def mooncake_pair(master: str, pages: BenchPages) -> Pair:
    from tiered_kv.storage.mooncake_store import MooncakeStorage

    n = pages.page_nbytes
    ours = MooncakeStorage(bench_namespace(n), n, master=master, segment_bytes=0)
    client = ours._client  # the process's client: the raw arm calls the same connection
    client.register(pages.array)
    raw, base = client.raw, pages.array.ctypes.data

    def raw_set(names: list[str], src: list[int]) -> None:
        codes = raw.batch_put_from(names, [base + p * n for p in src], [n] * len(names))
        if any(c != 0 for c in codes):
            fail("mooncake raw client", f"batch_put_from answered {codes}")

    def raw_get(names: list[str], dst: list[int]) -> list[bool]:
        codes = raw.batch_get_into(names, [base + p * n for p in dst], [n] * len(names))
        return [c == n for c in codes]

    return Pair("mooncake", pages, ours, raw_set, raw_get, lambda: raw.remove_all(True), ours.close)
