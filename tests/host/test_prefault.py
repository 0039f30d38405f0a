"""Host buffers are faulted in when built: their pages are resident before the first copy."""

from __future__ import annotations

import psutil
import pytest
import torch

from tiered_kv import prefault as pf
from tiered_kv.host.memory import HostBuffer

MIB = 1 << 20


def _rss() -> int:
    return psutil.Process().memory_info().rss


@pytest.mark.parametrize("populate", [True, False])
def test_a_host_buffer_is_resident_when_built(monkeypatch, populate):
    if not populate:  # the fallback: one write per 4 KiB page
        monkeypatch.setattr(pf, "_populate_write", lambda start, length: False)
    nbytes = 48 * MIB + 12_345  # not a whole number of pages
    before = _rss()
    buf = HostBuffer((nbytes,), torch.uint8, pin=None)
    grew = _rss() - before
    assert buf.warm_how == ("populate" if populate else "touch")
    assert buf.warm_seconds >= 0
    # every page is resident (an unfaulted torch.empty of this size grows RSS by ~nothing)
    assert grew >= 0.9 * nbytes, (grew, nbytes)
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
