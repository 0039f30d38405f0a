"""vLLM's per-layer KV caches as rows of whole blocks: each of the block-outermost layouts is
described by name, its rows are exactly the bytes of each block, and layouts that keep a block's
bytes apart are refused; the namespace tells every geometry apart."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.block_layout import describe_layers, physical_order

from ._kv import KINDS, block_bytes, layer_name, make_caches, page_bytes, rows_bytes

NB, H, N, D = 7, 3, 5, 20  # irregular: 7 blocks of 5 tokens, 3 heads of 20


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_the_bytes_of_each_block(gen, kind):
    ids = [9, 2, 5]
    caches, physical = make_caches(kind, ids, NB, H, N, D, gen)
    layout = describe_layers(caches, NB)
    assert layout.layer_ids == (2, 5, 9)
    assert layout.layer_names == tuple(layer_name(i) for i in (2, 5, 9))
    want = {"LBHNC": "LBHNC", "LBNHC": "LBNHC", "KV2": "KV2-LBNHC"}[kind]
    assert layout.layout == want
    assert layout.num_parts == (2 if kind == "KV2" else 1)
    assert (layout.heads, layout.block_size, layout.dtype) == (H, N, torch.float32)
    assert layout.content == (D if kind == "KV2" else 2 * D)
    assert layout.num_blocks == NB
    assert layout.page_nbytes == len(ids) * H * N * 2 * D * 4
    for li, i in enumerate(layout.layer_ids):
        for b in range(NB):
            want_parts = block_bytes(kind, physical[i], b)
            for p in range(layout.num_parts):
                got = layout.rows[p][li][b].view(torch.uint8)
                assert torch.equal(got, want_parts[p])
    for b in range(NB):
        assert torch.equal(rows_bytes(layout, b), page_bytes(kind, physical, b))
    # the rows are views: a write through the cache shows in them
    physical[9].view(-1)[0] = 1.25
    assert layout.rows[0][2][0][0].item() == 1.25


def test_one_kv_head_per_rank(gen):
    """A tensor-parallel rank with one KV head (or MLA's one latent row): every layout with
    ``heads == 1`` is block-outermost and must be accepted."""
    for kind in KINDS:
        caches, physical = make_caches(kind, [0, 1], NB, 1, N, D, gen)
        layout = describe_layers(caches, NB)
        for b in range(NB):
            assert torch.equal(rows_bytes(layout, b), page_bytes(kind, physical, b))


def test_names_without_a_distinct_index_keep_the_dicts_order(gen):
    caches = {
        name: torch.empty(NB, H, N, 2 * D)
        for name in ("dec.0.self_attn", "dec.0.cross_attn", "head")
    }
    layout = describe_layers(caches, NB)
    assert layout.layer_names == ("dec.0.self_attn", "dec.0.cross_attn", "head")
    assert layout.layer_ids == (0, 1, 2)


def test_physical_order():
    assert physical_order(torch.empty(NB, H, N, 8)) == "BHNC"
    assert physical_order(torch.empty(NB, N, H, 8).permute(0, 2, 1, 3)) == "BNHC"
    assert physical_order(torch.empty(H, NB, N, 8).permute(1, 0, 2, 3)) == "HBNC"
    with pytest.raises(InvalidArgumentError, match="4-D"):
        physical_order(torch.empty(NB, H, N))
    with pytest.raises(InvalidArgumentError, match="not dense"):
        physical_order(torch.empty(NB, H, N, 16)[..., :8])


def test_head_outermost_is_refused_by_name():
    caches = {layer_name(0): torch.empty(H, NB, N, 2 * D).permute(1, 0, 2, 3)}
    with pytest.raises(InvalidArgumentError, match="LHBNC"):
        describe_layers(caches, NB)


def test_layer_interleaved_is_refused():
    whole = torch.empty(NB, 3, H, N, 2 * D)  # BLHNC: one tensor, layers inside each block
    caches = {layer_name(i): whole[:, i] for i in range(3)}
    with pytest.raises(InvalidArgumentError, match="not dense"):
        describe_layers(caches, NB)


@pytest.mark.parametrize(
    "other",
    [
        torch.empty(NB, H, N, 2 * D + 2),  # another content size
        torch.empty(NB, H + 1, N, 2 * D),  # another head count
        torch.empty(NB, H, N, 2 * D, dtype=torch.float16),  # another dtype
        torch.empty(NB, N, H, 2 * D).permute(0, 2, 1, 3),  # another layout
    ],
)
def test_layers_that_differ_are_refused(other):
    caches = {layer_name(0): torch.empty(NB, H, N, 2 * D), layer_name(1): other}
    with pytest.raises(InvalidArgumentError, match="layers differ"):
        describe_layers(caches, NB)


@pytest.mark.parametrize(
    "cache",
    [
        torch.empty(NB + 1, H, N, 2 * D),
        torch.empty(2, NB - 1, N, H, D),
        torch.empty(3, NB, N, H, D),
        torch.empty(NB, H, N),
    ],
)
def test_a_cache_of_another_block_count_or_rank_is_refused(cache):
    with pytest.raises(InvalidArgumentError, match=f"{NB} blocks"):
        describe_layers({layer_name(0): cache}, NB)


def test_nothing_or_not_a_tensor_is_refused():
    with pytest.raises(InvalidArgumentError, match="no layers"):
        describe_layers({}, NB)
    with pytest.raises(InvalidArgumentError, match="list"):
        describe_layers({layer_name(0): [1, 2]}, NB)


def _fingerprint(layout, **kw):
    args = dict(model="m@r1", rank=None, tenant=None, kv_scales=None, kv_cache_dtype=None)
    args.update(kw)
    return layout.namespace(**args).fingerprint


def test_namespace_tells_every_geometry_and_identity_apart(gen):
    def layout_of(kind, ids=(0, 1), dtype=torch.float32, heads=H, block_size=N):
        return describe_layers(make_caches(kind, ids, NB, heads, block_size, D, gen, dtype)[0], NB)

    base = layout_of("LBHNC")
    assert _fingerprint(base) == _fingerprint(layout_of("LBHNC"))  # same inputs, same key
    seen = {
        "base": _fingerprint(base),
        "LBNHC": _fingerprint(layout_of("LBNHC")),
        "KV2": _fingerprint(layout_of("KV2")),
        "bf16": _fingerprint(layout_of("LBHNC", dtype=torch.bfloat16)),
        "layers": _fingerprint(layout_of("LBHNC", ids=(0, 2))),
        "heads": _fingerprint(layout_of("LBHNC", heads=H + 1)),
        "block_size": _fingerprint(layout_of("LBHNC", block_size=N + 1)),
        "model": _fingerprint(base, model="m@r2"),
        "rank": _fingerprint(base, rank="tp1"),
        "tenant": _fingerprint(base, tenant="t"),
        "kv_scales": _fingerprint(base, kv_scales="per-tensor:abc"),
        "kv_cache_dtype": _fingerprint(base, kv_cache_dtype="fp8_e4m3"),
    }
    assert len(set(seen.values())) == len(seen), seen
    assert _fingerprint(base, kv_cache_dtype="auto") == seen["base"]


# -- hybrid groups: state rows, split kernel blocks, groups on one rank ------------------------


def _state_buffer(gen, nb: int, page: int, content: int, layers: int):
    """``layers`` raw int8 state views ``[nb, 1, 1, content]`` over one buffer, ``page`` bytes
    per block (vLLM's padded Mamba pages), each layer a region of ``nb`` pages."""
    buf = torch.randint(-128, 127, (layers * nb * page,), generator=gen, dtype=torch.int8)
    views = [
        torch.as_strided(buf, (nb, 1, 1, content), (page, content, content, 1), i * nb * page)
        for i in range(layers)
    ]
    return buf, views


def test_state_rows_are_whole_padded_pages(gen):
    from tiered_kv.integrations.vllm.block_layout import state_rows

    buf, views = _state_buffer(gen, NB, 96, 70, 2)
    for i, v in enumerate(views):
        rows = state_rows(v, NB, f"model.layers.{i}.linear_attn")
        assert rows.shape == (NB, 96)
        for b in range(NB):
            start = (i * NB + b) * 96
            assert torch.equal(rows[b], buf[start : start + 96])
    with pytest.raises(InvalidArgumentError, match="raw int8 pages"):
        state_rows(views[0].view(torch.uint8), NB, "x")
    with pytest.raises(InvalidArgumentError, match="raw int8 pages"):
        state_rows(views[0], NB + 1, "x")
    short = torch.as_strided(buf, (NB, 1, 1, 70), (96, 70, 70, 1), buf.numel() - NB * 96 + 1)
    with pytest.raises(InvalidArgumentError, match="not one run"):
        state_rows(short, NB, "x")


def test_split_kernel_blocks_are_one_row_per_vllm_block(gen):
    caches, physical = make_caches("LBHNC", [0, 1], 2 * NB, H, N, D, gen)
    layout = describe_layers(caches, NB)
    assert layout.layout == "LBHNCx2" and layout.block_size == 2 * N
    assert layout.num_blocks == NB and layout.row_elems == 2 * H * N * 2 * D
    for b in range(NB):
        want = torch.cat([page_bytes("LBHNC", {i: physical[i]}, k) for i in (0, 1)
                          for k in (2 * b, 2 * b + 1)])  # fmt: skip
        assert torch.equal(rows_bytes(layout, b), want)


def test_groups_on_one_rank(gen):
    from types import SimpleNamespace

    from tiered_kv.integrations.vllm.block_layout import describe_groups
    from tiered_kv.integrations.vllm.groups import GroupGrid, GroupKind, GroupPlan

    attn, _ = make_caches("LBHNC", [1, 3], NB, H, N, D, gen)
    _, states = _state_buffer(gen, NB, 96, 70, 2)
    kv = dict(attn)
    kv["model.layers.0.linear_attn"], kv["model.layers.2.linear_attn"] = states
    kv[layer_name(5)] = attn[layer_name(1)]  # a KV-sharing layer: in no group, not stored twice
    spec = SimpleNamespace(shapes=((3, 8), (2, 4)), dtypes=(torch.bfloat16, torch.bfloat16))
    config = SimpleNamespace(
        kv_cache_groups=[
            SimpleNamespace(layer_names=[f"model.layers.{i}.linear_attn" for i in (0, 2)],
                            kv_cache_spec=spec),
            SimpleNamespace(layer_names=[layer_name(1), layer_name(3)], kv_cache_spec=None),
            SimpleNamespace(layer_names=[layer_name(7)], kv_cache_spec=None),  # another stage's
        ]
    )  # fmt: skip
    grid = GroupGrid(
        (GroupPlan(0, GroupKind.STATE, N), GroupPlan(1, GroupKind.FULL, N),
         GroupPlan(2, GroupKind.WINDOW, N, 8))
    )  # fmt: skip
    out = describe_groups(kv, config, grid, NB)
    assert sorted(out) == [0, 1]
    assert out[0].kind == "vllm-state" and out[0].layer_ids == (0, 2)
    assert out[0].layout.startswith("RAW") and "bfloat16" in out[0].layout
    assert out[0].page_nbytes == 2 * 96
    assert out[1].kind == "vllm-attention" and out[1].layer_ids == (1, 3)
    ns = [out[g].namespace(model="m@1", rank=None, tenant=None, kv_scales=None) for g in (0, 1)]
    assert ns[0] != ns[1]
