"""Faults for the connector's engine tests: damaged page bytes in a stopped engine's embedded
store, a Redis that refuses writes, and the Prometheus text of a server's ``/metrics``.

Damage goes where a disk or a bad write would put it: into the page bytes of the slab files
(``<storage_path>/slabs/<namespace fingerprint hex>.slab``, slot ``i`` at ``i * slot_bytes``),
never into LMDB's index, so a lookup still finds every page and only the read's checksum can
tell the bytes are not the ones written."""

from __future__ import annotations

import random
import re
from pathlib import Path

import redis

from tiered_kv.storage.slab_file import slot_bytes_for


def written_slots(slab: Path, page_nbytes: int) -> list[int]:
    """The slots of ``slab`` holding page bytes (a slot allocated but never written reads as
    zeros; a page of a model's KV never does)."""
    slot = slot_bytes_for(page_nbytes)
    data = slab.read_bytes()
    return [i for i in range(len(data) // slot) if any(data[i * slot : i * slot + page_nbytes])]


def damage_slab_pages(
    store_dir: str | Path, page_nbytes: int, rng: random.Random, fraction: float = 0.5
) -> tuple[int, int]:
    """Flip 1-4 random bits at random offsets in the page bytes of about ``fraction`` of the
    written slots of every slab file under ``store_dir`` (at least one slot, and at least one
    left intact where there are two). Returns (slots damaged, slots written)."""
    slabs = sorted(Path(store_dir, "slabs").glob("*.slab"))
    if not slabs:
        raise AssertionError(f"no slab file under {store_dir}/slabs: nothing was stored")
    slot = slot_bytes_for(page_nbytes)
    damaged = total = 0
    for slab in slabs:
        used = written_slots(slab, page_nbytes)
        total += len(used)
        chosen = [i for i in used if rng.random() < fraction]
        if not chosen and used:
            chosen = [rng.choice(used)]
        if len(chosen) == len(used) > 1:
            chosen.remove(rng.choice(chosen))
        with open(slab, "r+b") as f:
            for i in chosen:
                for _ in range(rng.randint(1, 4)):
                    at = i * slot + rng.randrange(page_nbytes)
                    f.seek(at)
                    b = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([b ^ (1 << rng.randrange(8))]))
        damaged += len(chosen)
    return damaged, total


def refuse_writes_beyond(url: str, headroom: int) -> int:
    """Make the Redis at ``url`` refuse writes (``noeviction``: an out-of-memory error, never an
    eviction) once it holds ``headroom`` bytes more than now. Returns the new maxmemory."""
    client = redis.Redis.from_url(url)
    try:
        used = int(client.info("memory")["used_memory"])
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", used + headroom)
        return used + headroom
    finally:
        client.close()


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def prom_value(text: str, name: str) -> float:
    """The sum over label sets of the samples named ``name`` in Prometheus text (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m and m.group(1) == name:
            total += float(m.group(3))
    return total
