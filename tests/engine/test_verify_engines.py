"""The engines as the cache's verifiers (``cache.verify``): the reference ``Server`` recomputes a
restored prefix with caching disabled and compares it bit for bit, the batched engine's
synthetic model checks its own bytes, each only for the prefixes the cache samples."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_scale_run import SMALL_LLAMA, TINY
from tests.engine.test_serve import MC, Recorder, cache_config, check_against_no_cache, serve
from tiered_kv.cache import TieredKVCache
from tiered_kv.engine.model import TinyLlama
from tiered_kv.engine.scale_run import run_mode
from tiered_kv.engine.scale_workload import ScaleConfig
from tiered_kv.engine.serve import PagedKV, Server


@pytest.fixture
def server(tmp_path, request):
    def make(**changes) -> Server:
        cache = TieredKVCache(cache_config(tmp_path, **changes))
        request.addfinalizer(cache.close)
        return Server(Recorder(TinyLlama(MC)), cache)

    return make


def prompt(n: int, base: int = 3) -> list[int]:
    return [(base * 37 + 11 * i) % 250 + 1 for i in range(n)]  # within the vocabulary


def test_the_reference_server_finds_a_wrong_restored_page_and_serves_exact_logits(server):
    s = server(verify_fraction=1.0)
    cache = s.cache
    p = prompt(70)
    first = serve(s, p, 2)
    assert first.record.recomputed == len(p)
    again = serve(s, p, 2)  # the whole prefix restored, recomputed, equal
    assert again.record.device == 64 and cache.stats()["verify"]["verified"] == 1
    node = cache.tree.match(p, probe=False).steps[-1][0]
    slot = int(node.device[16 + 5])  # page 1 of the cached prefix
    cache.device_pool.get_value_buffer(1)[slot].view(torch.uint8).view(-1)[1] ^= 0x08
    third = serve(s, p, 2)
    v = cache.stats()["verify"]
    assert v["mismatched"] == 1 and v["quarantined_pages"] == 1, v
    assert third.record.device == 16 and third.record.recomputed == len(p) - 16
    check_against_no_cache(s, p, third, bitwise=True)  # the wrong byte was never used
    assert third.record.verify_s > 0 and third.record.ttft_s < third.record.total_s


def test_the_server_checks_nothing_at_fraction_zero(server):
    s = server(verify_fraction=0.0)
    p = prompt(40)
    serve(s, p, 1)
    serve(s, p, 1)
    v = s.cache.stats()["verify"]
    assert v["sampled"] == 0 and v["skipped"] == 1


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_the_scale_run_verifies_the_sampled_share(tmp_path, fraction):
    cfg = ScaleConfig(SMALL_LLAMA, **TINY, verify_fraction=fraction)
    res = run_mode(cfg, "tiered", str(tmp_path))
    v = res["verification"]
    assert v["restores"] > 0 and v["mismatched_tokens"] == 0
    # What a real engine would spend recomputing the checked prefixes, modeled apart.
    want = cfg.cost.prefill_s(v["verified_tokens"] + v["recomputed_tokens"])
    assert res["modeled"]["verify_s"] == pytest.approx(want)
    if fraction == 0.0:
        assert v["sampled"] == v["verified_tokens"] == 0
    else:
        assert 0 < v["sampled"] < v["restores"] and v["verified_tokens"] > 0


def test_a_corrupted_restore_in_the_scale_run_is_quarantined_and_computed_again(tmp_path):
    cfg = ScaleConfig(SMALL_LLAMA, **TINY)  # verify_fraction 1.0: every restore
    flipped = []

    def corrupt(cache, req):
        if len(flipped) < 3:
            slot = int(cache.req_to_token.req_to_token[req.row, req.prefix_len - 1])
            cache.device_pool.get_key_buffer(1)[slot].view(torch.uint8).view(-1)[5] ^= 0x10
            flipped.append(slot)

    res = run_mode(cfg, "tiered", str(tmp_path), on_restored=corrupt)
    v = res["verification"]
    assert len(flipped) == 3 and v["mismatched_tokens"] == 3 and v["quarantined_pages"] == 3
    assert v["recomputed_tokens"] >= 3 * 16 and res["generated_tokens"] == 8 * 3 * 8


class HybridRecorder(Recorder):
    def forward(self, tokens, start, kv, chunk, **kwargs):
        out = self.model.forward(tokens, start, kv, chunk, **kwargs)
        if isinstance(kv, PagedKV):
            self.calls.append((start, out))
        return out


def test_a_hybrid_models_wrong_page_is_caught_and_its_state_restored_before_it(tmp_path):
    """A hybrid model: the cut-back prefix needs the recurrent state at its new end (restored
    from a snapshot there, or cut back further); the served logits stay bit for bit."""
    from tiered_kv.engine.hybrid import HybridModelConfig, TinyHybrid

    mc = HybridModelConfig(
        num_layers=4, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, full_layer_every=2
    )
    geometry = dict(
        model="hybrid_linear", head_num=2, head_dim=16, full_layer_every=2,
        conv_kernel=mc.conv_kernel, linear_heads=mc.linear_heads,
        linear_key_dim=mc.linear_key_dim, linear_value_dim=mc.linear_value_dim,
        state_snapshot_every=1,
    )  # fmt: skip
    config = cache_config(tmp_path, verify_fraction=1.0, **{**geometry, "num_layers": 4})
    cache = TieredKVCache(config)
    try:
        s = Server(HybridRecorder(TinyHybrid(mc)), cache)
        p = prompt(70, base=5)
        serve(s, p, 2)
        again = serve(s, p, 2)
        assert again.record.device == 64 and cache.stats()["verify"]["verified"] == 1
        node = cache.tree.match(p, probe=False).steps[-1][0]
        full = mc.full_layer_ids()[0]
        slot = int(node.device[3 * 16 + 2])  # page 3
        cache.device_pool.get_key_buffer(full)[slot].view(torch.uint8).view(-1)[0] ^= 0x20
        third = serve(s, p, 2)
        v = cache.stats()["verify"]
        assert v["mismatched"] == 1 and third.record.device <= 48, (v, third.record)
        check_against_no_cache(s, p, third, bitwise=True)
    finally:
        cache.close()
