"""Host buffers are faulted in when built: their pages are resident before the first copy.

Residency is read page by page with ``mincore(2)`` over the buffer's own range, not from the
process's RSS: RSS also moves with whatever else the process frees or reuses (an allocator that
hands back a range already resident makes an RSS delta read ~0 for a buffer that is resident).
"""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from tiered_kv import prefault as pf
from tiered_kv.host.memory import HostBuffer

MIB = 1 << 20
PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)


def _resident_pages(ptr: int, nbytes: int) -> tuple[int, int]:
    """(resident, total) 4 KiB pages of the range [ptr, ptr + nbytes), by mincore."""
    start = ptr // PAGE * PAGE
    length = ptr + nbytes - start
    total = (length + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * total)()
    rc = _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec), total


def _fresh_mapping(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """An anonymous private mapping no one has touched: none of its pages is resident."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, torch.frombuffer(m, dtype=torch.uint8)


@pytest.mark.parametrize("populate", [True, False])
def test_prefault_makes_every_page_of_an_untouched_range_resident(monkeypatch, populate):
    if not populate:  # the fallback: one write per 4 KiB page
        monkeypatch.setattr(pf, "_populate_write", lambda start, length: False)
    m, whole = _fresh_mapping(24 * MIB)
    try:
        t = whole[123 : 123 + 20 * MIB + 4321]  # starts and ends inside a page
        ptr, n = t.data_ptr(), t.numel()
        assert _resident_pages(ptr, n)[0] == 0  # the check can fail: nothing is resident yet
        how, secs = pf.prefault(t)
        assert how == ("populate" if populate else "touch") and secs >= 0
        resident, total = _resident_pages(ptr, n)
        assert resident == total, (resident, total)
    finally:
        del whole, t
        m.close()


@pytest.mark.parametrize("populate", [True, False])
def test_a_host_buffer_is_resident_when_built(monkeypatch, populate):
    if not populate:
        monkeypatch.setattr(pf, "_populate_write", lambda start, length: False)
    nbytes = 48 * MIB + 12_345  # not a whole number of pages
    buf = HostBuffer((nbytes,), torch.uint8, pin=None)
    try:
        assert buf.warm_how == ("populate" if populate else "touch")
        assert buf.warm_seconds >= 0
        resident, total = _resident_pages(buf.tensor.data_ptr(), nbytes)
        assert resident == total, (resident, total)
    finally:
        buf.destroy()


def test_touching_keeps_a_tensors_bytes_but_one_per_page(monkeypatch, gen):
    monkeypatch.setattr(pf, "_populate_write", lambda start, length: False)
    n = 3 * 4096 + int(torch.randint(1, 4096, (1,), generator=gen))
    t = torch.randint(1, 256, (n,), dtype=torch.uint8, generator=gen)
    want = t.clone()
    how, _ = pf.prefault(t)
    assert how == "touch"
    changed = (t != want).nonzero().flatten().tolist()
    # zeroed: the tensor's first byte and the first byte of each 4 KiB page after it
    first = (-t.data_ptr()) % 4096
    allowed = {0, *range(first, n, 4096)}
    assert set(changed) <= allowed and t[sorted(allowed)].eq(0).all()


def test_nothing_to_fault_in():
    assert pf.prefault(torch.empty(0, dtype=torch.uint8)) == ("none", 0.0)
