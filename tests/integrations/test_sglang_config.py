"""The SGLang backend's settings and page bridge without SGLang: rank identity (MHA apart, MLA
shared, pipeline and context-parallel ranks always apart), bad extra config refused by name, key
digests, layouts and host indices checked. Runs in the main venv (SGLang not needed)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from tiered_kv.errors import InvalidArgumentError, TieredKVError
from tiered_kv.integrations.sglang_config import rank_identity, read_settings
from tiered_kv.integrations.sglang_hicache import TieredKVHiCacheStorage, digest_of_hash
from tiered_kv.integrations.sglang_pages import HostPoolPages, namespace_of

DEFAULT_EXTRA = {"storage_path": "/tmp/x", "storage_bytes": 1 << 20}


def config(extra=None, **kw):
    base = dict(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, model_name="m@1",
        extra_config=DEFAULT_EXTRA if extra is None else extra,
        is_storage_writer=True,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "kw, rank",
    [
        ({}, "tp0of1"),
        ({"tp_rank": 3, "tp_size": 4}, "tp3of4"),
        ({"tp_rank": 3, "tp_size": 4, "is_mla_model": True}, None),
        ({"tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2}, "tp1of2-pp1of2"),
        ({"is_mla_model": True, "pp_rank": 1, "pp_size": 3}, "pp1of3"),
        ({"is_mla_model": True, "attn_cp_rank": 1, "attn_cp_size": 2}, "cp1of2"),
    ],
)
def test_rank_identity(kw, rank):
    assert rank_identity(config(**kw)) == rank


def test_settings_carry_the_store_model_and_writer():
    s = read_settings(config(extra={
        "backend_name": "x", "module_path": "y", "class_name": "z", "interface_v1": 1,
        "storage_path": "/tmp/x", "storage_bytes": 5 << 20, "storage_layout": "lmdb",
        "namespace_salt": "tenant-a",
    }, is_mla_model=True, tp_rank=1, is_storage_writer=False))  # fmt: skip
    assert (s.model_id, s.rank, s.writer) == ("m@1", None, False)
    st = s.storage
    assert (st.storage_bytes, st.storage_layout, st.namespace_salt) == (5 << 20, "lmdb", "tenant-a")
    assert (
        read_settings(config(extra={**config().extra_config, "model_id": "m@2"})).model_id == "m@2"
    )


@pytest.mark.parametrize(
    "extra, kw, match",
    [
        (
            {"storage_path": "/x", "storage_bytes": 1, "color": 2},
            {},
            r"color=2 is invalid: unknown",
        ),
        ({"storage_path": "/x"}, {}, r"storage_bytes=None is invalid: an int >= 1"),
        ({"storage_path": "/x", "storage_bytes": 1, "storage_batch_pages": 8}, {}, "unknown key"),
        ({"storage_path": "/x", "storage_bytes": True}, {}, r"storage_bytes=True"),
        ({"storage_bytes": 1}, {}, r"storage_path"),
        ({"storage_path": "/x", "storage_bytes": 1, "storage_layout": "tape"}, {}, "tape"),
        ({"storage_path": "/x", "storage_bytes": 1}, {"model_name": None}, r"model_id=None"),
        (
            {"storage_path": "/x", "storage_bytes": 1},
            {"model_name": "meta-llama/Llama-3-8B"},
            r"model_id='meta-llama/Llama-3-8B' is invalid: '<name>@<weights revision>'",
        ),
        ({"storage_path": "/x", "storage_bytes": 1, "model_id": "m@"}, {}, r"model_id='m@'"),
        ({"storage_path": "/x", "storage_bytes": 1}, {"dcp_size": 2}, r"dcp_size > 1"),
        ({"storage_path": "/x", "storage_bytes": 1}, {"tp_rank": -1}, r"tp_rank=-1"),
        ({"storage_path": "/x", "storage_bytes": 1}, {"should_split_heads": True}, r"tp_lcm_size"),
        ("not a dict", {}, r"a JSON object"),
    ],
)
def test_bad_configuration_is_refused_by_name(extra, kw, match):
    with pytest.raises(TieredKVError, match=match):
        TieredKVHiCacheStorage(config(extra=extra, **kw), {})


def test_sglang_hashes_are_digests_and_other_keys_hash_apart():
    h = hashlib.sha256(b"page").hexdigest()
    assert digest_of_hash(h) == bytes.fromhex(h)
    assert len(digest_of_hash("abc.mamba")) == 32 and digest_of_hash("abc") != digest_of_hash("abd")
    assert digest_of_hash("z" * 64) != digest_of_hash("y" * 64)  # 64 chars, not hex


class FakeMHAPool:
    """The page calls of SGLang's MHA host pool in page_first order, for the bridge's checks."""

    def __init__(self, layout="page_first", page_size=4, size=32):
        self.page_size, self.size, self.layout = page_size, size, layout
        self.dtype, self.layer_num, self.head_num, self.head_dim, self.v_head_dim = (
            torch.float16, 3, 2, 5, 5,
        )  # fmt: skip
        self.kv_buffer = torch.randn(2, size, 3, 2, 5).to(torch.float16)

    def get_data_page(self, index, flat=True):
        return self.kv_buffer[:, index : index + self.page_size].flatten()

    def get_dummy_flat_data_page(self):
        return torch.zeros(2 * self.page_size * 3 * 2 * 5, dtype=self.dtype)

    def set_from_flat_data_page(self, index, data_page):
        shape = (2, self.page_size, 3, 2, 5)
        self.kv_buffer[:, index : index + self.page_size] = data_page.reshape(shape)


def test_page_bridge_bytes_and_host_indices():
    pool = FakeMHAPool()
    pages = HostPoolPages(pool)
    assert (pages.page_nbytes, pages.num_pages) == (2 * 4 * 3 * 2 * 5 * 2, 8)
    page3 = pages.get_page_bytes(3).clone()
    pages.set_page_bytes(5, page3.numpy().tobytes())
    assert torch.equal(
        pool.kv_buffer[:, 20:24].view(torch.uint8), pool.kv_buffer[:, 12:16].view(torch.uint8)
    )
    assert pages.pages_of(torch.arange(8, 16), 2) == [2, 3]
    assert pages.pages_of(torch.cat([torch.arange(20, 24), torch.arange(4, 8)]), 2) == [5, 1]
    for bad in (torch.arange(2, 6), torch.tensor([0, 1, 3, 2]), torch.arange(0, 8)):
        with pytest.raises(InvalidArgumentError):
            pages.pages_of(bad, 1)
    with pytest.raises(InvalidArgumentError, match="bytes for a host pool"):
        pages.set_page_bytes(0, b"123")


def test_namespace_covers_layout_rank_and_refuses_unknown_layouts():
    a = namespace_of(FakeMHAPool("page_first"), model="m", rank="tp0of2", tenant=None)
    b = namespace_of(FakeMHAPool("layer_first"), model="m", rank="tp0of2", tenant=None)
    c = namespace_of(FakeMHAPool("page_first"), model="m", rank="tp1of2", tenant=None)
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3
    assert namespace_of(FakeMHAPool("page_head"), model="m", rank=None, tenant=None)
    with pytest.raises(InvalidArgumentError, match="page_unified"):
        namespace_of(FakeMHAPool("page_unified"), model="m", rank=None, tenant=None)


def test_calls_before_the_host_pool_are_counted_misses(tmp_path):
    backend = TieredKVHiCacheStorage(config(), {})
    assert backend.batch_exists(["ab" * 32]) == 0
    assert backend.batch_get_v1(["ab" * 32], torch.arange(4)) == [False]
    assert backend.storage_stats().errors == {"sglang.batch_exists": 1, "sglang.batch_get_v1": 1}


def test_a_non_writer_stores_nothing_and_reports_stored(tmp_path):
    extra = {"storage_path": str(tmp_path), "storage_bytes": 8 << 20}
    backend = TieredKVHiCacheStorage(
        config(extra=extra, is_mla_model=True, is_storage_writer=False)
    )
    backend.register_mem_pool_host(FakeMHAPool())
    assert backend.batch_set_v1(["ab" * 32], torch.arange(4)) == [True]
    assert backend.storage_stats().sets == 0 and backend.batch_exists(["ab" * 32]) == 0
    backend.close()
