"""The record beside every stored page: a flip of any byte of the header (its padding too) or of
the payload is refused; an intact record is accepted."""

from __future__ import annotations

import os
import random

from tiered_kv.storage import value_format as vf


def test_every_flipped_byte_is_refused():
    rng = random.Random(os.urandom(8))
    fp, payload = os.urandom(16), os.urandom(rng.randrange(1, 4099))
    key = fp + os.urandom(32)
    header = vf.pack(fp, payload, tick=rng.randrange(1 << 40), key=key)
    assert len(header) == vf.HEADER_BYTES
    assert vf.verify(vf.unpack(header), fp, payload, key=key)
    for at in range(vf.HEADER_BYTES):
        bad = bytearray(header)
        bad[at] ^= 1 << rng.randrange(8)
        assert not vf.verify(vf.unpack(bytes(bad)), fp, payload, key=key), f"header byte {at}"
    for at in rng.sample(range(len(payload)), min(64, len(payload))):
        bad = bytearray(payload)
        bad[at] ^= 1 << rng.randrange(8)
        assert not vf.verify(vf.unpack(header), fp, bytes(bad), key=key), f"payload byte {at}"
    assert not vf.verify(vf.unpack(header), os.urandom(16), payload, key=key)  # other namespace
    for at in range(len(key)):  # the record of another key (a swapped or misfiled value)
        other = bytearray(key)
        other[at] ^= 1 << rng.randrange(8)
        assert not vf.verify(vf.unpack(header), fp, payload, key=bytes(other)), f"key byte {at}"
    assert vf.unpack(header[:-1]) is None


def test_a_version_1_record_reads_as_damaged():
    import struct

    import xxhash

    fp, payload = os.urandom(16), os.urandom(100)
    fields = struct.pack("<4sHH16sQQQQ", vf.MAGIC, 1, 0, fp, 100, vf.checksum(payload), 3, 0)
    old = fields + struct.pack("<I4x", xxhash.xxh32_intdigest(fields))
    assert vf.unpack(old) is None


def test_with_tick_keeps_the_checksum():
    fp, payload = os.urandom(16), os.urandom(777)
    key = fp + os.urandom(32)
    moved = vf.with_tick(vf.pack(fp, payload, tick=5, key=key), 9)
    h = vf.unpack(moved)
    assert h.tick == 9 and vf.verify(h, fp, payload, key=key)
