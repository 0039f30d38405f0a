"""The random fault campaign of ``test_random_faults`` on a real Mooncake Store (a master on
127.0.0.1 and memory lent by this process, in the loopback-only namespace ``make test`` makes).
Between the store's calls, at random: a stored value's byte is flipped (header or payload), a
value is dropped, torn to half its size, grown by stray bytes, or replaced by another namespace's
record of the same bytes, and the master is killed and restarted (empty; the client redials).
Whatever the store serves is the oracle's bytes; every damaged value asked for is refused."""

from __future__ import annotations

import time

import pytest
import torch

from tests.cache.test_random_faults import Faults, _campaign, server_faulted
from tiered_kv.storage import StorageNamespace, value_format
from tiered_kv.storage.mooncake_store import MooncakeStorage

KINDS = ("flip", "drop", "tear", "grow", "foreign", "restart")
DECK = ("flip",) * 4 + KINDS[1:]  # faults are dealt from shuffled decks: every kind comes soon
PROBE = "tkv-campaign-probe"


def _name(key: bytes) -> str:
    return "tkv:" + bytes(key).hex()


class MooncakeFaults(Faults):
    """Faults done to the store's objects through a raw client of the same master."""

    def __init__(self, seed: int, rate: float, server) -> None:
        super().__init__(seed, rate)
        self.server, self.raw = server, server.client.raw
        self.kinds = dict.fromkeys(KINDS, 0)
        self.written: dict[str, None] = {}  # names the store said it stored, in order
        self.damaged_values: dict[str, bytes] = {}  # name -> the damaged value put there
        self.refused = 0  # damaged values asked for and not served
        self.remount_in = 0  # calls left to run against a restarted master before waiting
        self.deck: list[str] = []
        self.other = StorageNamespace.create(
            model="someone-else", kind="mha", parts=[("k", (1, 1))], dtype="float32",
            layer_ids=[0], page_size=1, layout="page_first",
        ).fingerprint  # fmt: skip

    def maybe(self, what: str) -> None:
        if not what.startswith("batch_"):  # a host copy: it fails (raises) at random, as before
            super().maybe(what)
            return
        with self.lock:
            if self.remount_in:
                self.remount_in -= 1
                if not self.remount_in:
                    self.wait_for_room()
            if self.rng.random() >= self.rate:
                return
            if not self.deck:
                self.deck = self.rng.sample(DECK, len(DECK))
            kind = self.deck[-1]
            pick = self.rng.random()
            names = list(self.written)
            if kind == "restart":  # the master dies and is restarted (empty) at once
                self.deck.pop()
                self.fired += 1
                self.kinds[kind] += 1
                self.server.master.stop()
                self.server.master.start()
                self.written.clear()
                self.damaged_values.clear()
                # The lent memory comes back when the client notices (about a second): the
                # calls until then meet no room; after a few, wait for it so the campaign goes on
                # storing.
                self.remount_in = self.rng.randint(1, 12)
                return
            if not names:
                return
            name = names[int(pick * len(names))]
            value = self.raw.get(name)
            if not value:  # evicted or dropped meanwhile
                return
            self.deck.pop()
            self.fired += 1
            self.kinds[kind] += 1
            if kind == "drop":
                self.raw.remove(name, True)
                return
            damaged = bytearray(value)
            if kind == "flip":
                damaged[int(pick * 7919) % len(damaged)] ^= 1 << int(pick * 8)
            elif kind == "tear":
                damaged = damaged[: len(damaged) // 2]
            elif kind == "grow":
                damaged += bytes([0x5A]) * (1 + int(pick * 40))
            else:  # the same bytes, sealed for a namespace the store does not serve
                payload = bytes(damaged[value_format.HEADER_BYTES :])
                head = value_format.pack(self.other, payload, 0, key=self.other + bytes(32))
                damaged = bytearray(head + payload)
            assert self.raw.upsert(name, bytes(damaged)) == 0
            self.damaged_values[name] = bytes(damaged)

    def wait_for_room(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.raw.put(PROBE, b"probe") != 0:
            assert time.monotonic() < deadline, "the restarted master never got its memory back"
            time.sleep(0.05)
        self.raw.remove(PROBE, True)

    def stored(self, keys, ok) -> None:
        with self.lock:
            for key, stored in zip(keys, ok, strict=True):
                if stored:
                    self.written[_name(key)] = None

    def damaged_names(self) -> list[str]:
        """The names holding a value this campaign damaged, right now."""
        return [n for n, v in self.damaged_values.items() if self.raw.get(n) == v]

    def damaged(self, keys) -> list[int]:
        """Which of ``keys`` hold a value this campaign damaged, right now."""
        out = []
        for i, key in enumerate(keys):
            name = _name(key)
            if name in self.damaged_values and self.raw.get(name) == self.damaged_values[name]:
                out.append(i)
        return out


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_random_faults_on_a_mooncake_store_never_serve_wrong_kv(gen, monkeypatch, write_policy):
    from tests.storage.mooncake_server import MooncakeServer

    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    print(f"fault seed {seed}")
    server = MooncakeServer(lent_bytes=32 << 20, lease_ms=500)
    faults = None
    try:
        faults = MooncakeFaults(seed, 0.15, server)
        left = []

        def ask_for_every_damaged_value(stack) -> None:
            """The values still damaged at the end, each asked for: every one is refused."""
            faults.rate = 0.0  # no new faults while they are read
            left.extend(bytes.fromhex(n[4:]) for n in faults.damaged_names())
            before = faults.refused
            for key in left:  # one at a time: a refusal is not hidden behind another miss
                assert stack.storage_kv([key]) is None
            assert faults.refused - before == len(left)

        store_cls = server_faulted(MooncakeStorage, faults, master=server.address, segment_bytes=0)
        stats = _campaign(
            gen, monkeypatch, faults, seed, store_cls,
            finish=ask_for_every_damaged_value,
            write_policy=write_policy, page_size=4, device_pages=10, host_pages=12,
        )  # fmt: skip
        assert all(faults.kinds.values()), faults.kinds  # each kind of fault was done
        # The store counts what it refused: every damaged value it read is a checksum failure.
        assert stats["checksum_failures"] >= faults.refused, (stats, faults.refused)
        print(f"faults {faults.kinds}, damaged values refused: {faults.refused} (at the end "
              f"{len(left)}), stats {stats}")  # fmt: skip
    finally:
        server.close()
