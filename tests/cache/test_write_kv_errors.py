"""``TieredKVCache.write_kv`` refuses KV in a dtype its pool does not take, and writes nothing."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig
from tiered_kv.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("dtype", "bad"), [("bfloat16", torch.float64), ("float16", torch.bfloat16)]
)
def test_write_kv_of_a_foreign_dtype_is_refused_and_writes_nothing(dtype, bad, gen):
    cfg = TieredKVConfig.flat(num_layers=2, head_num=2, head_dim=8, page_size=4,
                              device_tokens=64, host_tokens=0, dtype=dtype)  # fmt: skip
    cache = TieredKVCache(cfg)
    try:
        prompt = torch.randint(0, 1000, (11,), generator=gen).tolist()
        req = cache.begin(prompt)
        slots = cache.extend(req, prompt)
        before = [t.clone() for t in cache.device_pool.buffers()]
        k = torch.randn(len(slots), 2, 8, generator=gen, dtype=bad)
        with pytest.raises(InvalidArgumentError, match=rf"cache_k has dtype {bad}.*{dtype}"):
            cache.write_kv(1, slots, k, k + 1)
        assert all(
            torch.equal(a, b) for a, b in zip(cache.device_pool.buffers(), before, strict=True)
        )
        good = torch.randn(len(slots), 2, 8, generator=gen)  # float32 is narrowed, as before
        cache.write_kv(1, slots, good, -good)
        cache.finish(req)
    finally:
        cache.close()
