"""RawRows: a DSA pool's latent and indexer rows written and read raw, in every mode (the
native block copier, numpy, torch) against torch's indexing as the reference, on random bits
(NaN payloads included: compared as bytes), irregular sizes and layers in another order than
the pool's. Bad slots and rows raise before anything is written or read. (SparseDSA and the
KV accesses are tested with the swapper: ``tests/host/test_hisparse_decode.py``.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.engine.hisparse_model import RawRows
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.kernels import native_available

SIZE, PAGE, LAYERS = 37, 1, 5
SLOTS = SIZE + PAGE  # the pool's slots: its size and the padding page
MODES = [
    pytest.param("blocks", marks=pytest.mark.skipif(not native_available(), reason="no native")),
    "numpy",
    "torch",
]


def _pool(gen: torch.Generator) -> DSATokenToKVPool:
    pool = DSATokenToKVPool(SIZE, PAGE, torch.bfloat16, 13, 6, LAYERS, index_head_dim=128)
    for b in pool.buffers():
        raw = b.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))
    return pool


def _bytes(gen, n: int, width: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=gen)


@pytest.mark.parametrize("mode", MODES)
def test_write_gather_and_take_answer_torchs_indexing(gen, mode):
    pool = _pool(gen)
    layers = [3, 0, 4, 1, 2]  # layer index i is pool layer layers[i]
    raw = RawRows(pool, layers, mode, chunk=23)
    assert raw.mode == mode and raw.row_bytes == (38, 132)
    ref = [b.view(torch.uint8).reshape(SLOTS, -1).clone() for b in pool.kv_buffer]
    for slot in (0, 17, SLOTS - 1):
        # the generator's rows are padded to whole words: a view of every row's first bytes
        latents, index = _bytes(gen, LAYERS, 40)[:, :38], _bytes(gen, LAYERS, 132)
        before = [b.clone() for b in pool.index_k_with_scale_buffer]
        raw.write(torch.tensor([slot]), latents, index)
        for i, layer in enumerate(layers):
            ref[layer][slot] = latents[i]
            before[layer][slot] = index[i]
        for layer in range(LAYERS):
            assert torch.equal(
                pool.kv_buffer[layer].view(torch.uint8).reshape(SLOTS, -1), ref[layer]
            )
            assert torch.equal(pool.index_k_with_scale_buffer[layer], before[layer])
    for n in (1, 9, 23):  # runs of one layer, repeats, every slot
        idx = np.sort(torch.randint(0, LAYERS, (n,), generator=gen).numpy())
        idx[: n // 3] = idx[: n // 3][::-1].copy()  # a layer again after another
        slots = torch.randint(0, SLOTS, (n,), generator=gen).numpy()
        want = torch.stack([ref[layers[i]][s] for i, s in zip(idx, slots, strict=True)])
        assert torch.equal(torch.from_numpy(np.array(raw.gather(idx, slots))), want), n
    rows = torch.tensor([5, 0, SLOTS - 1, 5, 11])
    got_latent, got_index = raw.take(2, rows)
    assert torch.equal(got_latent, ref[2][rows])
    assert torch.equal(got_index, pool.index_k_with_scale_buffer[2][rows])


@pytest.mark.parametrize("mode", MODES)
def test_bad_slots_and_rows_raise_before_touching_anything(gen, mode):
    pool = _pool(gen)
    raw = RawRows(pool, [1, 0, 2, 3, 4], mode, chunk=8)
    before = [b.view(torch.uint8).clone() for b in pool.buffers()]  # NaN payloads: as bytes
    rows = [_bytes(gen, LAYERS, w) for w in raw.row_bytes]
    for slot in (SLOTS, -1):
        with pytest.raises(InvalidArgumentError, match=f"slot {slot}"):
            raw.write(torch.tensor([slot]), *rows)
    with pytest.raises(InvalidArgumentError, match="expected uint8 rows"):
        raw.write(torch.tensor([3]), rows[0][:2], rows[1])
    with pytest.raises(InvalidArgumentError, match="expected uint8 rows"):
        raw.write(torch.tensor([3]), rows[0].view(torch.int16), rows[1])
    after = [b.view(torch.uint8) for b in pool.buffers()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    if mode == "blocks":  # raw addresses: checked before reading
        for slots in (np.array([SLOTS]), np.array([-1]), np.zeros(9, dtype=np.int64)):
            with pytest.raises(InvalidArgumentError, match="at most 8 rows"):
                raw.gather(np.zeros(len(slots), dtype=np.int64), slots)


def test_modes_refused_by_name(gen):
    pool = _pool(gen)
    with pytest.raises(InvalidArgumentError, match="copy_mode='nope'"):
        RawRows(pool, [0], "nope")
    assert RawRows(pool, [0], "auto").mode == ("blocks" if native_available() else "numpy")
