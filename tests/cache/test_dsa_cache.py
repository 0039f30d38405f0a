"""Issue 14: a DSA model's cache (latent + indexer keys, two declared host pools moved as one)
through every tier. A stand-in model gives every (prefix, layer) a random latent and indexer key;
every served prefix is read back from the device pool and compared bit for bit, both parts:
from the device, from host, from storage, after a restart over the same store, and a stored page
whose indexer part was corrupted on disk is a miss (the prefix stops before it)."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.device.dsa_pool import quantize_index_k
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.pool_group import HostPoolGroup
from tiered_kv.storage.keys import page_keys

PAGE, LAYERS, RANK, ROPE, INDEX = 4, 3, 16, 8, 128


def config(tmp_path, **kw) -> TieredKVConfig:
    base = dict(
        num_layers=LAYERS, model="dsa", kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
        index_head_dim=INDEX, page_size=PAGE, device_tokens=96, host_tokens=160,
        storage_bytes=64 << 20, storage_path=str(tmp_path / "store"), model_id="dsa-test@1",
        prefetch_threshold=PAGE, prefetch_policy="wait_complete", max_requests=4,
        max_context_len=256,
    )  # fmt: skip
    base.update(kw)
    return TieredKVConfig.flat(**base)


class Oracle:
    def __init__(self, gen: torch.Generator) -> None:
        self.gen, self.kv = gen, {}

    def token(self, prefix: tuple, layer: int):
        key = (prefix, layer)
        if key not in self.kv:
            lat = torch.randn(1, RANK + ROPE, generator=self.gen)
            idx = torch.randn(INDEX, generator=self.gen) * 4
            self.kv[key] = (lat, idx)
        return self.kv[key]

    def serve(self, cache: TieredKVCache, prompt: list[int]):
        req = cache.begin(prompt)
        self.check(cache, req)
        rest = prompt[req.prefix_len :]
        slots = cache.extend(req, rest)
        start = req.prefix_len
        for layer in range(LAYERS):
            got = [self.token(tuple(prompt[: start + i + 1]), layer) for i in range(len(rest))]
            cache.write_kv(layer, slots, torch.stack([g[0] for g in got]), None)
            cache.write_index_k(layer, slots, torch.stack([g[1] for g in got]))
        cache.finish(req)
        cache.drain()
        return req

    def check(self, cache: TieredKVCache, req) -> None:
        pool, n = cache.device_pool, req.prefix_len
        slots = req.slots[:n]
        for layer in range(LAYERS):
            want = [self.token(tuple(req.tokens[: i + 1]), layer) for i in range(n)]
            if not n:
                continue
            lat = pool.get_key_buffer(layer)[slots]
            assert torch.equal(lat, torch.stack([w[0] for w in want])), f"latent, layer {layer}"
            rows = pool.get_index_k_with_scale_buffer(layer)[slots]
            assert torch.equal(rows, quantize_index_k(torch.stack([w[1] for w in want]))), (
                f"indexer keys, layer {layer}, hits {req.hits}"
            )


def test_every_tier_serves_both_parts_exactly(tmp_path, gen):
    cache = TieredKVCache(config(tmp_path))
    oracle = Oracle(gen)
    prompt = torch.randint(0, 50_000, (29,), generator=gen).tolist()
    try:
        assert isinstance(cache.host_pool, HostPoolGroup)
        oracle.serve(cache, prompt)
        assert oracle.serve(cache, prompt).hits.device == 28
        cache.manager.evict_device(1 << 30)
        assert oracle.serve(cache, prompt).hits.host == 28
        cache.clear_tree()
        assert oracle.serve(cache, prompt).hits.storage == 28
    finally:
        cache.close()
    again = TieredKVCache(config(tmp_path))  # a restart over the same store
    try:
        assert oracle.serve(again, prompt).hits.storage == 28
    finally:
        again.close()


@pytest.mark.parametrize("part", ["latent", "indexer"])
def test_a_corrupt_part_is_a_miss(tmp_path, gen, part):
    cache = TieredKVCache(config(tmp_path, storage_layout="slab"))
    oracle = Oracle(gen)
    prompt = torch.randint(0, 50_000, (29,), generator=gen).tolist()
    try:
        oracle.serve(cache, prompt)
        cache.clear_tree()
        store = cache.storage.inner
        keys = page_keys(cache.manager.namespace, prompt[:28], PAGE)
        files = store._files
        entry = files.read(lambda txn: files.books.lookup(txn, keys[2]))
        latent = cache.host_pool.members[0].page_nbytes
        offset = latent // 2 if part == "latent" else latent + 5
        with open(files.slab.path, "r+b") as f:  # the third page's part
            f.seek(entry.slot * files.slab.slot_bytes + offset)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x5A]))
        req = oracle.serve(cache, prompt)  # checks every served byte of both parts
        assert req.hits.storage == 2 * PAGE, req.hits  # stops before the corrupt page
        assert cache.stats()["storage"]["checksum_failures"] >= 1
    finally:
        cache.close()


def test_write_index_k_needs_a_dsa_pool(tmp_path, gen):
    cache = TieredKVCache(config(tmp_path, model="mla", storage_bytes=0, host_tokens=0))
    try:
        with pytest.raises(InvalidArgumentError, match="needs geometry model='dsa'"):
            cache.write_index_k(0, torch.tensor([4]), torch.randn(1, INDEX))
    finally:
        cache.close()
    with pytest.raises(InvalidArgumentError, match="index_head_dim"):
        config(tmp_path, index_head_dim=100)
