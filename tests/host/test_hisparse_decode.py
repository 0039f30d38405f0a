"""Issue 14 (HiSparse): TinyDSA decoding through HiSparseSwapper gives the dense layout's logits,
bit for bit.

The reference decodes with every token's latent and indexer key in dense tensors
(``DenseDSAKV``) and records, per decode position and layer, the keys its indexer selected.
The served run prefills into a DSA pool behind a HiSparse allocator, admits the request (every
part backed up to host, a fixed device buffer smaller than the context), and then decodes: the
indexer scores the keys the swapper keeps on device for every token, and attention reads only
the selected tokens' latents from the device slots ``swap_in`` returns (every other key is
zeros, which the indexer's mask hides). Logits are equal bitwise, the served run selects the
same keys, and tokens really came from host (loaded > 0). A control corrupts one resident slot
and sees the logits change, so the check can fail.
"""

from __future__ import annotations

import pytest
import torch

from tiered_kv.device.allocator.hisparse import HiSparseTokenToKVPoolAllocator
from tiered_kv.device.dsa_pool import DSATokenToKVPool
from tiered_kv.device.hisparse_index import HiSparseIndexKeys
from tiered_kv.engine.dsa import DenseDSAKV, DSAModelConfig, TinyDSA
from tiered_kv.host.hisparse_swap import HiSparseSwapper
from tiered_kv.host.pool_group import HostPoolGroup

CHUNK = 4  # the model's chunk is the KV page size
PROMPT, STEPS, BUFFER = 29, 15, 8


class RecordingDSA(TinyDSA):
    """TinyDSA that records each real query row's selected key positions, per layer."""

    def __init__(self, cfg: DSAModelConfig) -> None:
        super().__init__(cfg)
        self.selected: dict[tuple[int, int], torch.Tensor] = {}

    def _mask_keys(self, i, p, h, mask, rows, end, base, chunk, kv) -> torch.Tensor:
        out = super()._mask_keys(i, p, h, mask, rows, end, base, chunk, kv)
        for r in range(rows.start, rows.stop):
            self.selected[(base + r, i)] = torch.nonzero(~out[r]).flatten()
        return out


class PoolKV:
    """Prefill: every token on the device at its own slot (``dev`` by position)."""

    def __init__(self, pool: DSATokenToKVPool, dev: torch.Tensor) -> None:
        self.pool, self.dev, self.start = pool, dev, 0

    def write(self, layer, k, v):
        self.pool.set_kv_buffer(layer, self.dev[self.start : self.start + len(k)], k)

    def read(self, layer, end):
        return self.pool.kv_buffer[layer][self.dev[:end]], None

    def write_index(self, layer, keys):
        self.pool.set_index_k_buffer(layer, self.dev[self.start : self.start + len(keys)], keys)

    def read_index(self, layer, end):
        return self.pool.get_index_k(layer, self.dev[:end])


class SwappedKV:
    """A decode step: the newest token at the reserved slot, the selected ones swapped in."""

    def __init__(self, sw: HiSparseSwapper, slot: torch.Tensor, pos: int, selected) -> None:
        self.sw, self.slot, self.pos, self.selected = sw, slot, pos, selected
        self.start = pos

    def write(self, layer, k, v):
        self.sw.pool.set_kv_buffer(layer, self.slot, k)

    def read(self, layer, end):
        pool = self.sw.pool
        sel = self.selected[(self.pos, layer)]
        got = self.sw.swap_in(layer, sel)
        assert got.failed.numel() == 0
        out = torch.zeros(end, 1, pool.kv_cache_dim)
        out[sel] = pool.kv_buffer[layer][got.device_slots]
        return out, None

    def write_index(self, layer, keys):
        self.sw.pool.set_index_k_buffer(layer, self.slot, keys)

    def read_index(self, layer, end):
        keys = self.sw.score_keys(layer)
        assert keys.shape[0] == end
        return keys


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _reference(cfg, prompt):
    model = RecordingDSA(cfg)
    dense = DenseDSAKV(cfg, PROMPT + STEPS)
    logits = [model.forward(prompt, 0, dense, CHUNK)[-1]]
    tokens = []
    for step in range(STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(model.forward(_t(tokens[-1:]), PROMPT + step, dense, CHUNK)[-1])
    return model.selected, tokens, torch.stack(logits)


def _served(cfg, prompt, tokens, selected, corrupt_at: int | None = None):
    model = RecordingDSA(cfg)
    size = 48
    pool = DSATokenToKVPool(
        size, CHUNK, torch.float32, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_layers,
        index_head_dim=cfg.index_head_dim,
    )  # fmt: skip
    alloc = HiSparseTokenToKVPoolAllocator(
        size, CHUNK, torch.float32, "cpu", pool, host_to_device_ratio=4, kernel_backend="torch"
    )
    host = HostPoolGroup(pool.host_pool_decls(), alloc, size_tokens=64, reserve_bytes=0)
    keys = HiSparseIndexKeys(alloc, pool)
    z = _t([0])
    logical = alloc.alloc_extend(z, z.clone(), _t([PROMPT]), _t([PROMPT]), _t([-1]), PROMPT)
    logits = [model.forward(prompt, 0, PoolKV(pool, alloc.translate_loc(logical)), CHUNK)[-1]]
    host_slots = host.alloc(48)
    sw = HiSparseSwapper.admit(alloc, pool, host, keys, logical, host_slots[:PROMPT], BUFFER)
    assert sw is not None
    for step, tok in enumerate(tokens):
        pos = PROMPT + step
        seq = _t([pos + 1])
        lg = alloc.alloc_decode(seq, seq.clone(), sw.logical[-1:])
        slot = sw.begin_token(lg, host_slots[pos : pos + 1])
        if step == corrupt_at:  # a resident slot's bytes become another token's
            layer_buf = pool.kv_buffer[1]
            j = int(torch.nonzero(sw.resident(1) >= 0)[0])
            layer_buf[sw.buffer[j]] = layer_buf[sw.buffer[j]] + 1.0
        kv = SwappedKV(sw, slot, pos, selected)
        logits.append(model.forward(_t([tok]), pos, kv, CHUNK)[-1])
        sw.commit_token()
    return model.selected, torch.stack(logits), sw


def test_decode_through_the_swapper_equals_the_dense_layout():
    cfg = DSAModelConfig(num_layers=3, index_topk=8, seed=3)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    ref_selected, tokens, ref_logits = _reference(cfg, prompt)
    selected, logits, sw = _served(cfg, prompt, tokens, ref_selected)
    assert torch.equal(logits, ref_logits)
    for (pos, layer), sel in ref_selected.items():
        assert torch.equal(selected[(pos, layer)], sel), (pos, layer)
    # the context outgrew the buffer, and tokens came in from host
    assert sw.num_tokens == PROMPT + STEPS > BUFFER
    assert sw.num_loaded > 0 and sw.num_hits > 0 and sw.num_failed == 0


@pytest.mark.parametrize("corrupt_at", [4])
def test_a_wrong_resident_slot_changes_the_logits(corrupt_at):
    cfg = DSAModelConfig(num_layers=3, index_topk=8, seed=3)
    prompt = torch.randint(0, cfg.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(5))
    ref_selected, tokens, ref_logits = _reference(cfg, prompt)
    _, logits, _ = _served(cfg, prompt, tokens, ref_selected, corrupt_at=corrupt_at)
    assert torch.equal(logits[: corrupt_at + 1], ref_logits[: corrupt_at + 1])
    assert not torch.equal(logits, ref_logits)
