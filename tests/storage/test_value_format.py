"""The record beside every stored page: a flip of any byte of the header (its padding too) or of
the payload is refused; an intact record is accepted."""

from __future__ import annotations

import os
import random

from tiered_kv.storage import value_format as vf


def test_every_flipped_byte_is_refused():
    rng = random.Random(os.urandom(8))
    fp, payload = os.urandom(16), os.urandom(rng.randrange(1, 4099))
    header = vf.pack(fp, payload, tick=rng.randrange(1 << 40))
    assert len(header) == vf.HEADER_BYTES
    assert vf.verify(vf.unpack(header), fp, payload)
    for at in range(vf.HEADER_BYTES):
        bad = bytearray(header)
        bad[at] ^= 1 << rng.randrange(8)
        assert not vf.verify(vf.unpack(bytes(bad)), fp, payload), f"header byte {at}"
    for at in rng.sample(range(len(payload)), min(64, len(payload))):
        bad = bytearray(payload)
        bad[at] ^= 1 << rng.randrange(8)
        assert not vf.verify(vf.unpack(header), fp, bytes(bad)), f"payload byte {at}"
    assert not vf.verify(vf.unpack(header), os.urandom(16), payload)  # another namespace's
    assert vf.unpack(header[:-1]) is None


def test_with_tick_keeps_the_checksum():
    fp, payload = os.urandom(16), os.urandom(777)
    moved = vf.with_tick(vf.pack(fp, payload, tick=5), 9)
    h = vf.unpack(moved)
    assert h.tick == 9 and vf.verify(h, fp, payload)
