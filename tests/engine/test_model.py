"""TinyLlama on its own: config validation, the maths against an independent float64 reference,
chunk-aligned determinism (one call == page-aligned pieces, bit for bit), causality, RoPE and
grouped-query attention."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tiered_kv.engine.model import DenseKV, ModelConfig, TinyLlama
from tiered_kv.errors import InvalidArgumentError

SMALL = dict(
    vocab_size=128,
    hidden=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate=96,
)


def small(**changes) -> ModelConfig:
    return ModelConfig(**{**SMALL, **changes})


def random_tokens(gen: torch.Generator, n: int, vocab: int = SMALL["vocab_size"]) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=gen)


def dense_forward(
    model: TinyLlama, tokens: torch.Tensor, chunk: int
) -> tuple[torch.Tensor, DenseKV]:
    kv = DenseKV(model.cfg, len(tokens))
    return model.forward(tokens, 0, kv, chunk), kv


# -- ModelConfig -------------------------------------------------------------------------------
def test_default_config_is_valid_gqa():
    cfg = ModelConfig()
    assert cfg.num_heads % cfg.num_kv_heads == 0 and cfg.head_dim % 2 == 0


POSITIVE_FIELDS = (
    "vocab_size",
    "hidden",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate",
)


@pytest.mark.parametrize("field", POSITIVE_FIELDS)
@pytest.mark.parametrize("value", [0, -2, 2.0, True, None])
def test_config_rejects_non_positive_or_non_int_sizes(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        small(**{field: value})


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 3), (6, 4), (2, 4)])
def test_config_rejects_heads_not_multiple_of_kv_heads(heads, kv_heads):
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        small(num_heads=heads, num_kv_heads=kv_heads)


@pytest.mark.parametrize("head_dim", [1, 15, 33])
def test_config_rejects_odd_head_dim(head_dim):
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        small(head_dim=head_dim)


@pytest.mark.parametrize(
    ("field", "value"),
    [("rope_theta", 0.0), ("rope_theta", -1.0), ("rope_theta", math.nan), ("norm_eps", -1e-6)],
)
def test_config_rejects_bad_rope_theta_and_norm_eps(field, value):
    with pytest.raises(InvalidArgumentError, match=field):
        small(**{field: value})


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1), (6, 3)])
def test_config_accepts_mha_gqa_and_mqa(heads, kv_heads):
    assert small(num_heads=heads, num_kv_heads=kv_heads).num_kv_heads == kv_heads


# -- weights -----------------------------------------------------------------------------------
def _weights(model: TinyLlama) -> list[torch.Tensor]:
    out = [model.embed, model.final_norm, model.lm_head]
    for layer in model.layers:
        out += [layer[k] for k in sorted(layer)]
    return out


def test_weights_are_deterministic_for_a_seed_and_differ_across_seeds(gen):
    a, b = TinyLlama(small(seed=7)), TinyLlama(small(seed=7))
    assert all(torch.equal(x, y) for x, y in zip(_weights(a), _weights(b), strict=True))
    c = TinyLlama(small(seed=8))
    assert not any(torch.equal(x, y) for x, y in zip(_weights(a), _weights(c), strict=True))
    tokens = random_tokens(gen, 20)
    la, lb, lc = (dense_forward(m, tokens, 8)[0] for m in (a, b, c))
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


def test_weight_and_output_shapes_for_gqa(gen):
    cfg = small(num_heads=4, num_kv_heads=2)
    model = TinyLlama(cfg)
    h, hd = cfg.hidden, cfg.head_dim
    p = model.layers[0]
    assert p["wq"].shape == (h, cfg.num_heads * hd)
    assert p["wk"].shape == p["wv"].shape == (h, cfg.num_kv_heads * hd)
    assert p["wo"].shape == (cfg.num_heads * hd, h)
    assert model.lm_head.shape == (h, cfg.vocab_size)
    tokens = random_tokens(gen, 21)
    logits, kv = dense_forward(model, tokens, 8)
    assert logits.shape == (21, cfg.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert len(kv.k) == len(kv.v) == cfg.num_layers
    assert kv.k[0].shape == kv.v[0].shape == (21, cfg.num_kv_heads, hd)


# -- an independent reference ------------------------------------------------------------------
def reference_logits(model: TinyLlama, tokens: torch.Tensor) -> torch.Tensor:
    """The same network written plainly in float64: complex-number RoPE on (even, odd) pairs,
    explicit per-head loop for grouped-query attention, a softmax with an upper-triangular
    mask, all positions at once."""
    cfg = model.cfg
    d = torch.float64
    n, hd = len(tokens), cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    freqs = cfg.rope_theta ** (-torch.arange(0, hd, 2, dtype=d) / hd)
    rot = torch.polar(torch.ones(n, hd // 2, dtype=d), torch.arange(n, dtype=d)[:, None] * freqs)

    def rope(t: torch.Tensor) -> torch.Tensor:  # (n, heads, hd)
        c = torch.view_as_complex(t.reshape(n, t.shape[1], hd // 2, 2).contiguous())
        return torch.view_as_real(c * rot[:, None, :]).reshape(t.shape)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w.to(d)

    causal = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
    x = model.embed.to(d)[tokens]
    for p in model.layers:
        w = {k: v.to(d) for k, v in p.items()}
        h = rms(x, w["attn_norm"])
        q = rope((h @ w["wq"]).view(n, cfg.num_heads, hd))
        k = rope((h @ w["wk"]).view(n, cfg.num_kv_heads, hd))
        v = (h @ w["wv"]).view(n, cfg.num_kv_heads, hd)
        heads = []
        for i in range(cfg.num_heads):
            j = i // group
            s = (q[:, i] @ k[:, j].T) / math.sqrt(hd)
            heads.append(torch.softmax(s.masked_fill(causal, -math.inf), -1) @ v[:, j])
        x = x + torch.cat(heads, dim=-1) @ w["wo"]
        h = rms(x, w["mlp_norm"])
        a = h @ w["w1"]
        x = x + (a * torch.sigmoid(a) * (h @ w["w3"])) @ w["w2"]
    return rms(x, model.final_norm) @ model.lm_head.to(d)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
def test_forward_matches_an_independent_float64_reference(gen, heads, kv_heads):
    model = TinyLlama(small(num_heads=heads, num_kv_heads=kv_heads, seed=3))
    tokens = random_tokens(gen, 37)
    logits, _ = dense_forward(model, tokens, 8)
    ref = reference_logits(model, tokens)
    scale = ref.abs().max()
    assert float((logits.to(torch.float64) - ref).abs().max() / scale) < 1e-5


# -- chunk-aligned determinism -----------------------------------------------------------------
@pytest.mark.parametrize(("chunk", "n"), [(4, 17), (8, 45), (8, 48), (16, 45), (16, 17)])
def test_one_call_equals_page_aligned_pieces_bitwise(gen, chunk, n):
    model = TinyLlama(small(seed=1))
    tokens = random_tokens(gen, n)
    whole, kv_whole = dense_forward(model, tokens, chunk)
    splits = [s for s in range(chunk, n, chunk)]
    assert splits, "the test needs at least one page boundary inside the prompt"
    # page-aligned splits into two pieces (first, middle, last boundary), one piece per page
    for cuts in [[splits[0]], [splits[len(splits) // 2]], [splits[-1]], splits]:
        kv = DenseKV(model.cfg, n)
        parts, start = [], 0
        for end in [*cuts, n]:
            parts.append(model.forward(tokens[start:end], start, kv, chunk))
            start = end
        assert torch.equal(torch.cat(parts), whole), cuts
        for layer in range(model.cfg.num_layers):
            assert torch.equal(kv.k[layer][:n], kv_whole.k[layer][:n])
            assert torch.equal(kv.v[layer][:n], kv_whole.v[layer][:n])


@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_any_split_and_decode_steps_equal_one_call_bitwise(gen, chunk):
    """Pieces cut anywhere (mid-chunk too) and one-token decode steps compute every token's KV
    and logits with the shapes and operands of the one-call prefill: the same bits. This is what
    makes a restored multi-turn history (decoded tokens included) match a no-cache run."""
    model = TinyLlama(small(seed=1))
    n = 45
    tokens = random_tokens(gen, n)
    whole, kv_whole = dense_forward(model, tokens, chunk)
    random_cuts = sorted(torch.randperm(n - 1, generator=gen)[:4].add(1).tolist())
    for cuts in ([13], [3, 5, 6, 29], random_cuts, list(range(30, n))):  # the last: decoding
        kv = DenseKV(model.cfg, n)
        parts, start = [], 0
        for end in [*cuts, n]:
            parts.append(model.forward(tokens[start:end], start, kv, chunk))
            start = end
        assert torch.equal(torch.cat(parts), whole), cuts
        for layer in range(model.cfg.num_layers):
            assert torch.equal(kv.k[layer][:n], kv_whole.k[layer][:n]), cuts
            assert torch.equal(kv.v[layer][:n], kv_whole.v[layer][:n]), cuts


class ChunkSpy(DenseKV):
    """DenseKV that records the (start, rows) of every chunk the model computes."""

    def __init__(self, cfg: ModelConfig, max_tokens: int) -> None:
        super().__init__(cfg, max_tokens)
        self.chunks: list[tuple[int, int]] = []

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == 0:
            self.chunks.append((self.start, len(k)))
        super().write(layer, k, v)


def test_chunks_are_aligned_to_absolute_positions_and_computed_whole(gen, monkeypatch):
    """A forward that starts mid-chunk (after decode steps) first finishes that chunk, then runs
    aligned chunks; attention always runs a whole chunk of queries over keys up to the chunk's
    end (padded), whatever part of the chunk is being computed."""
    model = TinyLlama(small())
    tokens = random_tokens(gen, 45)
    kv = ChunkSpy(model.cfg, 45)
    shapes = []
    attend = model._attend

    def spy(q, k, v, start, window=None):
        shapes.append((start, q.shape[0], k.shape[0]))
        return attend(q, k, v, start, window)

    monkeypatch.setattr(model, "_attend", spy)
    model.forward(tokens[:13], 0, kv, 8)
    model.forward(tokens[13:14], 13, kv, 8)  # a decode step
    model.forward(tokens[14:], 14, kv, 8)
    assert kv.chunks == [(0, 8), (8, 5), (13, 1), (14, 2), (16, 8), (24, 8), (32, 8), (40, 5)]
    bases = [0, 8, 8, 8, 16, 24, 32, 40]
    assert shapes == [(b, 8, b + 8) for b in bases for _ in range(model.cfg.num_layers)]


def test_chunk_size_changes_rounding_only(gen):
    """Different chunk sizes are different op shapes: equal up to float32 rounding (this is why
    serving must use the page size as the chunk, like the reference)."""
    model = TinyLlama(small(seed=2))
    tokens = random_tokens(gen, 40)
    a, _ = dense_forward(model, tokens, 8)
    b, _ = dense_forward(model, tokens, 40)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(a.abs().max()))


def test_decode_step_continues_a_prefill_bitwise(gen):
    model = TinyLlama(small(seed=4))
    tokens = random_tokens(gen, 30)
    kv = DenseKV(model.cfg, 31)
    model.forward(tokens[:29], 0, kv, 8)
    step = model.forward(tokens[29:], 29, kv, 8)
    assert step.shape == (1, model.cfg.vocab_size)
    whole, _ = dense_forward(model, tokens, 8)
    assert torch.equal(step[0], whole[29])


@pytest.mark.parametrize(
    ("tokens", "start", "chunk"),
    [([1, 2], 0, 0), ([1, 2], 0, -8), ([1, 2], -1, 8), ([], 0, 8)],
)
def test_forward_rejects_bad_arguments(tokens, start, chunk):
    model = TinyLlama(small())
    with pytest.raises(InvalidArgumentError):
        model.forward(torch.tensor(tokens, dtype=torch.int64), start, DenseKV(model.cfg, 4), chunk)


# -- causality ---------------------------------------------------------------------------------
@pytest.mark.parametrize("j", [0, 5, 16, 27, 39])
def test_changing_a_later_token_never_changes_earlier_logits(gen, j):
    model = TinyLlama(small(seed=5))
    tokens = random_tokens(gen, 40)
    other = tokens.clone()
    other[j] = (tokens[j] + 1 + int(torch.randint(0, 100, (1,), generator=gen))) % 128
    a, _ = dense_forward(model, tokens, 8)
    b, _ = dense_forward(model, other, 8)
    assert torch.equal(a[:j], b[:j])
    assert not torch.allclose(a[j], b[j])  # the changed position itself does change
    if j + 1 < len(tokens):
        assert not torch.allclose(a[j + 1 :], b[j + 1 :])


# -- RoPE --------------------------------------------------------------------------------------
def test_rope_depends_only_on_relative_position(gen):
    model = TinyLlama(small(head_dim=32))
    q = torch.randn(1, 4, 32, generator=gen)
    k = torch.randn(1, 4, 32, generator=gen)

    def score(m: int, n: int) -> torch.Tensor:
        qm = model._rope(q, torch.tensor([m]))
        kn = model._rope(k, torch.tensor([n]))
        return (qm * kn).sum(-1)  # per head

    for diff in (0, 1, 3, 17):
        base = score(diff, 0)
        for offset in (1, 10, 123, 1000):
            torch.testing.assert_close(
                score(offset + diff, offset), base, rtol=1e-5, atol=1e-5 * float(base.abs().max())
            )
    # not vacuous: the score does change with the distance
    assert not torch.allclose(score(3, 0), score(4, 0), rtol=1e-3, atol=1e-4)


def test_rope_is_a_rotation_and_identity_at_position_zero(gen):
    model = TinyLlama(small())
    x = torch.randn(5, 2, 16, generator=gen)
    assert torch.equal(model._rope(x, torch.zeros(5, dtype=torch.int64)), x)
    y = model._rope(x, torch.arange(100, 105))
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y, x)


# -- grouped-query attention -------------------------------------------------------------------
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_gqa_equals_mha_with_each_kv_head_shared_by_its_query_group(gen, kv_heads):
    """Query head i reads KV head i // group: an MHA model whose K/V projections repeat each KV
    head ``group`` times (consecutively) gives the same logits."""
    gqa = TinyLlama(small(num_heads=4, num_kv_heads=kv_heads, seed=6))
    mha = TinyLlama(dataclasses.replace(gqa.cfg, num_kv_heads=4))
    group, h, hd = 4 // kv_heads, gqa.cfg.hidden, gqa.cfg.head_dim
    mha.embed, mha.final_norm, mha.lm_head = gqa.embed, gqa.final_norm, gqa.lm_head
    for pg, pm in zip(gqa.layers, mha.layers, strict=True):
        pm.update(pg)
        for name in ("wk", "wv"):
            pm[name] = pg[name].view(h, kv_heads, hd).repeat_interleave(group, dim=1).reshape(h, -1)
    tokens = random_tokens(gen, 33)
    a, kv = dense_forward(gqa, tokens, 8)
    b, _ = dense_forward(mha, tokens, 8)
    assert kv.k[0].shape == (33, kv_heads, hd)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    # and a wrong grouping (head i reading KV head i % kv_heads) would not match
    if kv_heads > 1:
        for pg, pm in zip(gqa.layers, mha.layers, strict=True):
            for name in ("wk", "wv"):
                pm[name] = pg[name].view(h, kv_heads, hd).repeat(1, group, 1).reshape(h, -1)
        c, _ = dense_forward(mha, tokens, 8)
        assert not torch.allclose(a, c, rtol=1e-3, atol=1e-3)
