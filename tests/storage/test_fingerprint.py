"""Issue 27: the fail-closed fingerprint. ``NAMESPACE_FIELDS`` is the one list of what a
namespace holds; each field changed alone gives another fingerprint and so a miss in a real
store (and through the cache, on the same store directory); a namespace missing a field a
store needs is refused before any store opens, naming it."""

from __future__ import annotations

import pytest
import torch

from tests.cache.test_facade import Model, aligned, make_config, make_prompts
from tiered_kv.cache import TieredKVCache
from tiered_kv.errors import InvalidArgumentError, StorageOpenError
from tiered_kv.storage import keys
from tiered_kv.storage.keys import NAMESPACE_FIELDS, StorageNamespace, page_keys
from tiered_kv.storage.lmdb_store import LMDBStorage

BASE = dict(
    kind="mha",
    parts=[("k", (3, 20)), ("v", (3, 20))],
    dtype=torch.bfloat16,
    layer_ids=[0, 1, 2, 3, 4],
    page_size=4,
    layout="page_first",
    tenant=None,
    model="llama-3-8b@0123abcd",
    rank=None,
    kv_scales=None,
)
# One change per field, alone (the two versions are constants: patched).
CHANGES = {
    "model": {"model": "llama-3-8b@0123abce"},
    "kind": {"kind": "mla"},
    "parts": {"parts": [("k", (3, 20)), ("v", (3, 21))]},
    "dtype": {"dtype": torch.float16},
    "kv_scales": {"kv_scales": "per-tensor:feed"},
    "page_size": {"page_size": 5},
    "layout": {"layout": "layer_first"},
    "layer_ids": {"layer_ids": [5, 6, 7, 8, 9]},
    "rank": {"rank": "tp1of2"},
    "tenant": {"tenant": "tenant-b"},
    "format": "_NAMESPACE_FORMAT",
    "value_format": "VALUE_FORMAT_VERSION",
}


def test_every_field_has_a_change_below():
    assert set(CHANGES) == set(NAMESPACE_FIELDS)


@pytest.mark.parametrize("field", sorted(NAMESPACE_FIELDS))
def test_each_field_changed_alone_is_a_miss(tmp_path, gen, field, monkeypatch):
    base = StorageNamespace.create(**BASE)
    change = CHANGES[field]
    if isinstance(change, str):
        monkeypatch.setattr(keys, change, getattr(keys, change) + 1)
        change = {}
    other = StorageNamespace.create(**{**BASE, **change})
    assert other.fingerprint != base.fingerprint, field
    tokens = torch.randint(0, 50_000, (3 * 4 + 1,), generator=gen).tolist()
    nbytes = 97
    page = torch.randint(0, 256, (3, nbytes), generator=gen, dtype=torch.uint8)
    store = LMDBStorage(tmp_path / "s", base, nbytes, budget_bytes=32 << 20)
    try:
        ks = page_keys(base, tokens, 4)
        assert store.batch_set(ks, _Pages(page), [0, 1, 2]) == [True] * 3
        assert store.batch_exists(ks) == 3
    finally:
        store.close()
    again = LMDBStorage(tmp_path / "s", other, nbytes, budget_bytes=32 << 20)
    try:
        assert again.batch_exists(page_keys(other, tokens, 4)) == 0, field
        with pytest.raises(InvalidArgumentError, match="unknown namespace"):
            again.batch_exists(page_keys(base, tokens, 4))  # another namespace's keys
    finally:
        again.close()


class _Pages:
    """A page source over rows of a uint8 tensor."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows
        self.page_nbytes = rows.shape[1]
        self.num_pages = rows.shape[0]

    def get_page_bytes(self, page: int) -> torch.Tensor:
        return self.rows[page]

    def set_page_bytes(self, page: int, data) -> None:
        self.rows[page].copy_(torch.as_tensor(data).view(torch.uint8).reshape(-1))


# -- through the cache: each config field of the namespace, changed alone, misses -------------
CONFIG_CHANGES = [
    {"model_id": "test-model@2"},
    {"dtype": "float16"},
    {"kv_scales_id": "per-tensor:beef"},
    {"host_layout": "layer_first"},
    {"num_layers": 4},
    {"head_dim": 6},
    {"rank": "tp1of2"},
    {"namespace_salt": "tenant-b"},
]


@pytest.mark.parametrize("change", CONFIG_CHANGES, ids=lambda c: next(iter(c)))
def test_a_config_field_changed_alone_misses_through_the_cache(tmp_path, gen, change):
    (prompt,) = make_prompts(gen, [27])
    cache = TieredKVCache(make_config(tmp_path))
    Model(cache, gen).serve(prompt, drain=True)
    cache.close()
    for cfg, want in ((make_config(tmp_path, **change), 0), (make_config(tmp_path), 24)):
        cache = TieredKVCache(cfg)
        try:
            req = cache.begin(prompt)
            assert req.hits.storage == want, (change, req.hits)
            cache.abort(req)
        finally:
            cache.close()
    assert aligned(27) == 24


# -- fail closed ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3-8b@", "@abc", None])
def test_a_model_without_a_revision_is_refused_before_any_store_opens(tmp_path, model):
    ns = StorageNamespace.create(**{**BASE, "model": model})
    assert ns.missing() and "model=" in ns.missing()[0]
    with pytest.raises(StorageOpenError, match="name and weights revision"):
        ns.check_complete()
    if model is not None:
        with pytest.raises(InvalidArgumentError, match="model_id"):
            make_config(tmp_path, model_id=model)
    assert not (tmp_path / "store").exists()


def test_float8_kv_without_its_scales_is_refused():
    ns = StorageNamespace.create(**{**BASE, "dtype": "torch.float8_e4m3fn"})
    with pytest.raises(StorageOpenError, match="kv_scales=None with dtype torch.float8_e4m3fn"):
        ns.check_complete()
    named = StorageNamespace.create(
        **{**BASE, "dtype": "torch.float8_e4m3fn", "kv_scales": "per-layer:9a1f"}
    )
    named.check_complete()
    other = StorageNamespace.create(
        **{**BASE, "dtype": "torch.float8_e5m2", "kv_scales": "per-layer:9a1f"}
    )
    assert other.fingerprint != named.fingerprint


def test_the_description_lists_exactly_the_documented_fields():
    import json

    ns = StorageNamespace.create(**BASE)
    assert set(json.loads(ns.description)) == set(NAMESPACE_FIELDS)
