"""HiSparseIndexKeys: the indexer rows of every logical slot, kept on the device.

``copy_from_device`` in both copy modes (the native block copier, one gather and scatter per
layer in torch) on random bits and irregular sizes: every layer's rows land at their logical
slots, byte for byte, nothing else changes; a one-token copy (a decode token's commit) too.
Bad input raises InvalidArgumentError before anything is copied. ``get_rows`` (numpy's take on
CPU) answers torch's gather."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.device.hisparse_index import HiSparseIndexKeys
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.kernels import native_available

LAYERS, PAGE, SIZE = 5, 4, 44
NATIVE = pytest.mark.skipif(not native_available(), reason="native copier not built")
MODES = [pytest.param("blocks", marks=NATIVE), "torch"]


def _keys(gen: torch.Generator, mode: str) -> HiSparseIndexKeys:
    pool = DSATokenToKVPool(SIZE, PAGE, torch.bfloat16, 13, 6, LAYERS, index_head_dim=256)
    alloc = HiSparseTokenToKVPoolAllocator(
        SIZE, PAGE, torch.bfloat16, "cpu", pool, host_to_device_ratio=3, kernel_backend="torch"
    )
    for b in pool.index_k_with_scale_buffer:
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    keys = HiSparseIndexKeys(alloc, pool, copy_mode=mode)
    assert keys.copy_mode == mode and keys.row_bytes == 256 + 8
    return keys


@pytest.mark.parametrize("mode", MODES)
def test_copy_from_device_moves_every_layers_rows(gen, mode):
    keys = _keys(gen, mode)
    pool = keys.pool
    for n in (1, 7, 23):
        logical = torch.randperm(keys.num_rows - 1, generator=gen)[:n] + 1
        dev = torch.randint(1, pool.num_slots, (n,), generator=gen, dtype=torch.int32)
        before = [b.clone() for b in keys.buffer]
        keys.copy_from_device(logical, dev)
        for layer, (mine, theirs) in enumerate(
            zip(keys.buffer, pool.index_k_with_scale_buffer, strict=True)
        ):
            assert torch.equal(mine[logical], theirs[dev.long()]), (n, layer)
            untouched = torch.ones(keys.num_rows, dtype=torch.bool)
            untouched[logical] = False
            assert torch.equal(mine[untouched], before[layer][untouched])


@pytest.mark.parametrize("mode", MODES)
def test_bad_input_raises_before_copying(gen, mode):
    keys = _keys(gen, mode)
    ok = torch.tensor([3, 4])
    before = [b.clone() for b in keys.buffer]
    bad = [
        (torch.tensor([0, 4]), ok, "outside the valid range"),  # logical 0 is the padding
        (torch.tensor([3, keys.num_rows]), ok, "outside the valid range"),
        (ok, torch.tensor([1, keys.pool.num_slots]), "outside the valid range"),
        (ok, torch.tensor([-1, 2]), "outside the valid range"),
        (ok, torch.tensor([1, 2, 3]), "they pair up"),
        (ok.float(), ok, "dtype"),
        (ok[None], ok[None], "1-D"),
        ([3, 4], ok, "torch.Tensor"),
    ]
    for logical, dev, match in bad:
        with pytest.raises(InvalidArgumentError, match=match):
            keys.copy_from_device(logical, dev)
    assert all(torch.equal(a, b) for a, b in zip(keys.buffer, before, strict=True))


def test_copy_modes_refused_by_name(gen):
    with pytest.raises(InvalidArgumentError, match="copy_mode='nope'"):
        _keys(gen, "nope")


def test_get_rows_answers_torchs_gather(gen):
    keys = _keys(gen, "torch")
    logical = torch.randperm(keys.num_rows - 1, generator=gen)[:19] + 1
    keys.copy_from_device(logical, torch.randint(1, keys.pool.num_slots, (19,), generator=gen))
    at = torch.cat([logical, logical[:3], torch.tensor([0])])  # repeats and the padding row
    for layer in range(LAYERS):
        assert torch.equal(keys.get_rows(layer, at), keys.buffer[layer][at])
    with pytest.raises(InvalidArgumentError, match="outside the valid range"):
        keys.get_rows(0, torch.tensor([keys.num_rows]))
