"""tiered_kv as SGLang 0.5.23's HiCache storage backend, driven by SGLang's own HiCacheController
on CPU (``tiered_kv.bench.sglang_rig``): device -> host -> store -> host -> device bit for bit for
MHA and MLA host pools in every layout SGLang's CPU io backends copy, two tensor-parallel ranks
(MHA apart, MLA one copy), a damaged value a miss, a dead store counted misses, bad
configuration refused by name, SGLang's metrics. What is not SGLang's own code: the host pools'
copy ops (torch stand-ins, ``tools/sglang_peer/stubs``), and no process group (one process)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.integrations.sglang_stack import OUR_BACKEND, sglang_missing

pytestmark = pytest.mark.skipif(sglang_missing() is not None, reason=str(sglang_missing()))

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
PAGE = 8


def shape(mla: bool, layout: str, **kw):
    from tiered_kv.bench.sglang_rig import RigShape

    # irregular sizes: 5 layers, 3 heads of 20 (MHA), a 40 + 12 latent row (MLA)
    geometry = dict(page_size=PAGE, layers=5, heads=3, head_dim=20, kv_lora_rank=40, rope_dim=12)
    return RigShape(mla, layout, device_tokens=1024, **{**geometry, **kw})


def ours(path, **extra):
    from tiered_kv.bench.sglang_rig import dynamic_extra_config

    return dynamic_extra_config(
        *OUR_BACKEND, storage_path=str(path), storage_bytes=64 << 20, **extra
    )


def rig_for(path, mla=False, layout="page_first", *, tp_rank=0, tp_size=1, **kw):
    from tiered_kv.bench.sglang_rig import SGLangRig

    extra = kw.pop("extra", None) or ours(path)
    return SGLangRig(shape(mla, layout), "dynamic", extra, tp_rank=tp_rank, tp_size=tp_size, **kw)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def tokens(gen, pages):
    return torch.randint(0, 150_000, (pages * PAGE,), generator=gen).tolist()


def round_trip(rig, gen, pages):
    """Back ``pages`` fresh random pages up through SGLang's controller, forget them on device
    and host, prefetch and load them back; (tokens stored, tokens prefetched, exact)."""
    toks = tokens(gen, pages)
    dev = rig.fill_device(len(toks), gen)
    want = rig.device_bytes(dev)
    host = rig.write_to_host(dev)
    stored = rig.backup(host, toks)
    rig.host.free(host)
    rig.scrub_device(dev)
    got, host2 = rig.prefetch(toks)
    if host2 is None or got < len(toks):
        return stored, got, False
    back = rig.device_bytes(rig.load_to_device(host2))
    return stored, got, all(torch.equal(a, b) for a, b in zip(back, want, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_round_trip_through_sglangs_controller(tmp_path, gen, mla, layout):
    from tiered_kv.integrations.sglang_hicache import TieredKVHiCacheStorage

    rig = rig_for(tmp_path, mla, layout)
    try:
        assert type(rig.backend) is TieredKVHiCacheStorage  # SGLang loaded ours by module path
        assert rig.controller.page_get_func == rig.controller._page_get_zero_copy  # interface_v1
        assert round_trip(rig, gen, 7) == (7 * PAGE, 7 * PAGE, True)
        s = rig.backend.storage_stats()
        assert (s.sets, s.hits, s.misses, s.checksum_failures) == (7, 7, 0, 0)
        assert rig.backend.namespace.description.count(f'"layout":"{layout}"') == 1
    finally:
        rig.close()


@pytest.mark.parametrize("mla, layout", [(False, "page_first"), (True, "page_first_direct")])
def test_round_trip_through_sglangs_hybrid_controller(tmp_path, gen, mla, layout):
    """The controller SGLang 0.5.23's radix cache really builds for a plain model: its
    HybridCacheController over a host pool group, which registers the KV pool a second time
    through register_mem_host_pool_v2."""
    rig = rig_for(tmp_path, mla, layout, group=True)
    try:
        assert type(rig.controller).__name__ == "HybridCacheController"
        assert round_trip(rig, gen, 6) == (6 * PAGE, 6 * PAGE, True)
        assert rig.backend.storage_stats().hits == 6
    finally:
        rig.close()


def test_sglangs_page_hashes_are_our_chain_digests(tmp_path, gen):
    from tiered_kv.storage.keys import page_keys

    rig = rig_for(tmp_path)
    try:
        toks = tokens(gen, 5)
        ours_keys = page_keys(rig.backend.namespace, toks, PAGE)
        assert rig.backend.keys_of(rig.page_hashes(toks)) == ours_keys
    finally:
        rig.close()


def test_mha_tp_ranks_keep_apart(tmp_path, gen):
    rank0 = rig_for(tmp_path, tp_rank=0, tp_size=2)
    rank1 = rig_for(tmp_path, tp_rank=1, tp_size=2)
    try:
        assert rank0.backend.namespace != rank1.backend.namespace
        assert (rank0.backend.settings.rank, rank1.backend.settings.rank) == ("tp0of2", "tp1of2")
        toks = tokens(gen, 4)
        dev = rank0.fill_device(len(toks), gen)
        assert rank0.backup(rank0.write_to_host(dev), toks) == len(toks)
        assert rank1.prefetch(toks) == (0, None)  # rank 1 never reads rank 0's heads
        # each rank stores and serves its own bytes for the same tokens
        assert round_trip(rank1, gen, 4)[1:] == (4 * PAGE, True)
        assert rank1.backend.storage_stats().sets == 4
    finally:
        rank0.close()
        rank1.close()


def test_mla_tp_ranks_share_one_copy_written_by_rank_0(tmp_path, gen):
    rank0 = rig_for(tmp_path, mla=True, tp_rank=0, tp_size=2)
    rank1 = rig_for(tmp_path, mla=True, tp_rank=1, tp_size=2)
    try:
        assert rank0.backend.namespace == rank1.backend.namespace
        assert rank0.backend.settings.writer and not rank1.backend.settings.writer
        toks = tokens(gen, 6)
        dev = rank0.fill_device(len(toks), gen)
        want = rank0.device_bytes(dev)
        dev1 = rank1.fill_device(len(toks), gen)  # rank 1's backup is skipped by SGLang
        rank1.backup(rank1.write_to_host(dev1), toks)
        assert rank1.backend.storage_stats().sets == 0
        assert rank0.backup(rank0.write_to_host(dev), toks) == len(toks)
        got, host = rank1.prefetch(toks)  # rank 1 reads rank 0's copy
        assert got == len(toks)
        back = rank1.device_bytes(rank1.load_to_device(host))
        assert all(torch.equal(a, b) for a, b in zip(back, want, strict=True))
    finally:
        rank0.close()
        rank1.close()


def test_a_flipped_stored_byte_is_a_miss_never_served(tmp_path, gen):
    from tiered_kv.storage.slab_file import BLOCK

    rig = rig_for(tmp_path, extra=ours(tmp_path, storage_layout="slab"))
    try:
        toks = tokens(gen, 5)
        dev = rig.fill_device(len(toks), gen)
        want = rig.device_bytes(dev)
        host = rig.write_to_host(dev)
        assert rig.backup(host, toks) == len(toks)
        rig.host.free(host)
        nbytes = rig.backend.pages.page_nbytes
        slab = tmp_path / "slabs" / f"{rig.backend.namespace.fingerprint.hex()}.slab"
        at = 2 * (-(-nbytes // BLOCK) * BLOCK) + nbytes // 3  # inside page 2's bytes
        with open(slab, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0x5A]))
        got, host2 = rig.prefetch(toks)
        assert got == 2 * PAGE  # pages 0 and 1; page 2 failed its checksum
        back = rig.device_bytes(rig.load_to_device(host2))
        first = 2 * PAGE
        assert all(torch.equal(a, b[:first]) for a, b in zip(back, want, strict=True))
        assert rig.backend.storage_stats().checksum_failures == 1
        assert rig.backend.batch_exists(rig.page_hashes(toks)) == 2  # and it was deleted
    finally:
        rig.close()


def test_a_dead_store_is_counted_misses_and_the_controller_goes_on(tmp_path, gen):
    from tests.storage.redis_server import RedisServer

    server = RedisServer()
    extra = ours(tmp_path, storage_backend="redis", storage_options={"url": server.url})
    rig = rig_for(tmp_path, extra=extra)
    try:
        toks = tokens(gen, 3)
        dev = rig.fill_device(len(toks), gen)
        host = rig.write_to_host(dev)
        assert rig.backup(host, toks) == len(toks)
        server.stop()
        assert rig.prefetch(toks) == (0, None)  # the hit query failed: a miss
        assert rig.backup(host, tokens(gen, 3)) == 0  # nothing stored, nothing raised
        s = rig.backend.storage_stats()
        assert sum(s.errors.values()) >= 2 and s.hits == 0
        for t in (rig.controller.prefetch_thread, rig.controller.backup_thread):
            assert t.is_alive()
        server.start()
        assert round_trip(rig, gen, 3) == (3 * PAGE, 3 * PAGE, True)  # storing again once back
    finally:
        rig.close()
        server.stop()


def test_legacy_interface_round_trips_too(tmp_path, gen):
    extra = ours(tmp_path)
    extra["interface_v1"] = 0
    rig = rig_for(tmp_path, mla=True, layout="layer_first", extra=extra)
    try:
        assert rig.controller.page_get_func == rig.controller._generic_page_get
        assert round_trip(rig, gen, 3) == (3 * PAGE, 3 * PAGE, True)
    finally:
        rig.close()


def test_storage_metrics_per_batch(tmp_path, gen):
    rig = rig_for(tmp_path, storage_metrics=True)
    try:
        assert round_trip(rig, gen, 5)[2]
        m = rig.backend.get_stats()
        assert (m.backup_pgs, m.prefetch_pgs) == ([5], [5])
        assert m.backup_bandwidth[0] > 0 and m.prefetch_bandwidth[0] > 0
        assert rig.backend.get_stats().backup_pgs == []  # cleared by the read
        missing = rig.page_hashes(tokens(gen, 2))  # pages per batch asked for, GB/s of hits
        assert rig.backend.batch_get_v1(missing, torch.arange(2 * PAGE)) == [False, False]
        m = rig.backend.get_stats()
        assert (m.prefetch_pgs, m.prefetch_bandwidth) == ([2], [0.0])
    finally:
        rig.close()


def test_only_the_kv_pool_is_registered(tmp_path):
    from tiered_kv.errors import TieredKVError

    rig = rig_for(tmp_path)
    try:
        rig.backend.register_mem_host_pool_v2(rig.host, "kv")  # its HybridCacheController's call
        with pytest.raises(TieredKVError, match="'mamba'.*KV pool only|KV pool only.*'mamba'"):
            rig.backend.register_mem_host_pool_v2(rig.host, "mamba")
        with pytest.raises(TieredKVError, match="KV pool only"):
            rig.backend.register_mem_host_pool_v2(object(), "kv")
    finally:
        rig.close()


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"storage_bytes": 1 << 20, "storage_path": "x", "colour": 1}, "colour=1 is invalid"),
        ({"storage_path": "x"}, "storage_bytes=None is invalid"),
        ({"storage_bytes": 1 << 20}, "storage_path"),
        ({"storage_bytes": 1 << 20, "storage_backend": "nope!"}, "storage_backend"),
    ],
    ids=["unknown-key", "no-budget", "no-path", "bad-backend"],
)
def test_bad_extra_config_fails_the_attach_by_name(tmp_path, extra, match):
    from tiered_kv.bench.sglang_rig import SGLangRig, dynamic_extra_config
    from tiered_kv.errors import TieredKVError

    with pytest.raises(ValueError, match=match) as info:
        SGLangRig(
            shape(False, "page_first"), "dynamic", dynamic_extra_config(*OUR_BACKEND, **extra)
        )
    assert isinstance(info.value.__cause__, TieredKVError)


# -- request identity (issue 27) ----------------------------------------------------------------
def test_other_lora_adapters_never_share_a_stored_page(tmp_path, gen):
    """Two requests with the same tokens and different ``extra_key`` (SGLang's LoRA adapter)
    through SGLang's own controller: each finds only its own pages; the same adapter hits."""
    rig = rig_for(tmp_path)
    try:
        assert rig.backend.identity_checked  # SGLang's hashes were probed at registration
        toks = tokens(gen, 4)
        dev = rig.fill_device(len(toks), gen)
        want = rig.device_bytes(dev)
        host = rig.write_to_host(dev)
        assert rig.backup(host, toks, extra_key="lora-a") == len(toks)
        rig.host.free(host)
        rig.scrub_device(dev)
        assert rig.prefetch(toks, extra_key="lora-b")[0] == 0
        assert rig.prefetch(toks)[0] == 0  # no adapter is another identity too
        got, host2 = rig.prefetch(toks, extra_key="lora-a")
        assert got == len(toks)
        back = rig.device_bytes(rig.load_to_device(host2))
        assert all(torch.equal(a, b) for a, b in zip(back, want, strict=True))
    finally:
        rig.close()


def test_an_sglang_whose_hashes_drop_the_extra_key_is_refused(tmp_path, monkeypatch):
    """Where SGLang's storage hashes would not carry the adapter (an older SGLang), the
    backend refuses to open rather than share KV across adapters."""
    from tiered_kv.errors import StorageOpenError

    utils = pytest.importorskip("sglang.srt.mem_cache.utils")

    def dropped(key, prior_hash=None, page_size=None):
        return utils.get_hash_str(list(key.token_ids), prior_hash, page_size=page_size)

    monkeypatch.setattr(utils, "get_storage_hash_str", dropped)
    with pytest.raises(StorageOpenError, match="drop the request's extra_key"):
        rig_for(tmp_path)
