"""The hybrid reference model (full attention mixed with a gated linear recurrence): config and
layer lists; logits and recurrent state bit for bit the same for any split of a sequence into
calls; state snapshotted at a chunk boundary and restored into a fresh request continues bit for
bit; negative controls (a flipped state element changes the logits, another seed other weights);
padding rows never touch the state."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from tiered_kv.engine.hybrid import DenseHybridKV, HybridModelConfig, TinyHybrid
from tiered_kv.engine.model import DenseKV, ModelConfig
from tiered_kv.errors import InvalidArgumentError

SMALL = dict(
    vocab_size=256, hidden=64, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate=96, full_layer_every=3, conv_kernel=4, linear_heads=2, linear_key_dim=8,
    linear_value_dim=12,
)  # fmt: skip


def small(**changes) -> HybridModelConfig:
    return HybridModelConfig(**{**SMALL, **changes})


MODELS = {seed: TinyHybrid(small(seed=seed)) for seed in (0, 1, 2)}


def random_tokens(seed: int, n: int) -> torch.Tensor:
    # Never token 0: the model pads with it, and test_padding_rows_never_touch_the_state
    # tells real rows from padding by changing its embedding.
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(1, SMALL["vocab_size"], (n,), generator=gen)


def states(kv: DenseHybridKV) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {i: tuple(t.clone() for t in kv.read_state(i)) for i in kv.cfg.linear_layer_ids()}


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for i in a:
        assert torch.equal(a[i][0], b[i][0]), f"conv state of layer {i} differs"
        assert torch.equal(a[i][1], b[i][1]), f"temporal state of layer {i} differs"


def run_split(model, tokens, sizes, chunk, kv=None, start=0, on_boundary=None):
    kv = kv if kv is not None else DenseHybridKV(model.cfg, start + len(tokens))
    out, pos = [], 0
    for n in sizes:
        out.append(
            model.forward(tokens[pos : pos + n], start + pos, kv, chunk, on_boundary=on_boundary)
        )
        pos += n
    assert pos == len(tokens)
    return torch.cat(out), kv


def snapshots(kv: DenseHybridKV) -> tuple[list[tuple[int, dict]], Callable[[int], None]]:
    """An on_boundary callback cloning ``kv``'s state at each boundary, and what it recorded
    (every call, in order: a boundary reported twice shows)."""
    seen: list[tuple[int, dict]] = []
    return seen, lambda p: seen.append((p, states(kv)))


def random_sizes(rng: random.Random, total: int, chunk: int) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        kind = rng.random()
        n = (
            1
            if kind < 0.4
            else rng.randint(2, chunk - 1)
            if kind < 0.7
            else rng.randint(chunk, 3 * chunk)
        )
        sizes.append(min(n, total - sum(sizes)))
    return sizes


# -- config ------------------------------------------------------------------------------------
def test_default_layer_pattern_and_state_shapes():
    cfg = HybridModelConfig()
    assert cfg.full_layer_ids() == [3] and cfg.linear_layer_ids() == [0, 1, 2]
    assert cfg.conv_dim == 2 * (2 * 16 + 32) == 128
    assert cfg.conv_state_shape() == (128, 3)
    assert cfg.temporal_state_shape() == (2, 16, 32)
    eight = HybridModelConfig(num_layers=8)
    assert eight.full_layer_ids() == [3, 7] and eight.linear_layer_ids() == [0, 1, 2, 4, 5, 6]
    assert [eight.is_full_layer(i) for i in range(8)] == [False] * 3 + [True] + [False] * 3 + [True]
    every = HybridModelConfig(full_layer_every=1)
    assert every.full_layer_ids() == [0, 1, 2, 3] and every.linear_layer_ids() == []
    s = small()
    assert s.full_layer_ids() == [2, 5] and s.conv_dim == 2 * (16 + 12)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("full_layer_every", 0),
        ("full_layer_every", True),
        ("full_layer_every", 2.0),
        ("full_layer_every", 7),  # num_layers=6: no full layer
        ("conv_kernel", 1),
        ("conv_kernel", None),
        ("linear_heads", 0),
        ("linear_key_dim", -1),
        ("linear_value_dim", 1.5),
    ],
)
def test_config_rejects_invalid_fields_naming_them(field, value):
    with pytest.raises(InvalidArgumentError, match=field) as err:
        small(**{field: value})
    assert repr(value) in str(err.value) or str(value) in str(err.value)


@pytest.mark.parametrize("layer", [-1, 6, True, 1.0])
def test_is_full_layer_rejects_ids_outside_the_model(layer):
    with pytest.raises(InvalidArgumentError, match=r"layer=.*\[0, 6\)"):
        small().is_full_layer(layer)


def test_model_and_forward_reject_the_wrong_config_or_kv():
    with pytest.raises(InvalidArgumentError, match="HybridModelConfig"):
        TinyHybrid(ModelConfig())
    model = MODELS[0]
    with pytest.raises(InvalidArgumentError, match="read_state"):
        model.forward(random_tokens(0, 5), 0, DenseKV(model.cfg, 5), 4)


def test_dense_state_rejects_wrong_layer_or_shape_and_changes_nothing():
    kv = DenseHybridKV(small(), 8)
    with pytest.raises(InvalidArgumentError, match=r"layer=2 .*\[0, 1, 3, 4\]"):
        kv.read_state(2)
    before = states(kv)
    with pytest.raises(InvalidArgumentError, match=r"temporal .*\(2, 8, 12\)"):
        kv.write_state(0, torch.ones(56, 3), torch.ones(2, 8, 13))
    with pytest.raises(InvalidArgumentError, match="float32"):
        kv.write_state(0, torch.ones(56, 3, dtype=torch.float64), torch.ones(2, 8, 12))
    assert_states_equal(states(kv), before)


# -- determinism -------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_any_split_gives_the_same_logits_and_state_bit_for_bit(seed, chunk):
    model, rng = MODELS[seed], random.Random(seed * 100 + chunk)
    total = 3 * chunk + rng.randint(1, chunk - 1)  # not a multiple of chunk
    tokens = random_tokens(seed + chunk, total)
    ref, ref_kv = run_split(model, tokens, [total], chunk)
    prompt = rng.randint(1, total - 1)
    splits = [random_sizes(rng, total, chunk) for _ in range(5)]
    splits += [[1] * total, [prompt] + [1] * (total - prompt)]  # all decode; prefill + decode
    for sizes in splits:
        logits, kv = run_split(model, tokens, sizes, chunk)
        assert torch.equal(logits, ref), f"logits differ for split {sizes}"
        assert_states_equal(states(kv), states(ref_kv))
    assert ref.abs().max() > 0 and torch.isfinite(ref).all()


@pytest.mark.parametrize("chunk", [4, 8])
def test_greedy_decode_matches_one_call_over_the_whole_sequence(chunk):
    model = MODELS[1]
    tokens = random_tokens(7, 2 * chunk + 3)
    kv = DenseHybridKV(model.cfg, len(tokens) + 2 * chunk + 1)
    logits = [model.forward(tokens, 0, kv, chunk)]
    for _ in range(2 * chunk + 1):
        # argmax can pick token 0 here: fine, padding rows are not told apart in this test
        nxt = logits[-1][-1].argmax().reshape(1)
        logits.append(model.forward(nxt, len(tokens), kv, chunk))
        tokens = torch.cat([tokens, nxt])
    ref, ref_kv = run_split(model, tokens, [len(tokens)], chunk)
    assert torch.equal(torch.cat(logits), ref)
    assert_states_equal(states(kv), states(ref_kv))


# -- boundaries and restore --------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_on_boundary_reports_every_boundary_once_with_the_prefix_state(chunk):
    model, rng = MODELS[2], random.Random(chunk)
    total = 4 * chunk  # the last call's end is a boundary too
    tokens = random_tokens(chunk, total)
    for sizes in [[total], random_sizes(rng, total, chunk), [1] * total]:
        kv = DenseHybridKV(model.cfg, total)
        seen, record = snapshots(kv)
        run_split(model, tokens, sizes, chunk, kv=kv, on_boundary=record)
        assert [p for p, _ in seen] == [chunk, 2 * chunk, 3 * chunk, 4 * chunk], sizes
        for p, snap in seen:  # the state at P is the prefix 0..P-1's
            _, prefix_kv = run_split(model, tokens[:p], [p], chunk)
            assert_states_equal(snap, states(prefix_kv))


@pytest.mark.parametrize("chunk", [4, 8, 16])
def test_state_restored_at_a_boundary_continues_bit_for_bit(chunk):
    model, rng = MODELS[0], random.Random(chunk + 5)
    total = 3 * chunk + chunk // 2 + 1
    tokens = random_tokens(chunk + 3, total)
    ref_kv = DenseHybridKV(model.cfg, total)
    snaps, record = snapshots(ref_kv)
    ref, _ = run_split(model, tokens, [total], chunk, kv=ref_kv, on_boundary=record)
    assert [p for p, _ in snaps] == [chunk, 2 * chunk, 3 * chunk]
    for p, snap in snaps:
        fresh = DenseHybridKV(model.cfg, total)
        for i in model.cfg.full_layer_ids():
            fresh.k[i][:p] = ref_kv.k[i][:p]
            fresh.v[i][:p] = ref_kv.v[i][:p]
        for i, (conv, temporal) in snap.items():
            fresh.write_state(i, conv, temporal)
        logits, kv = run_split(
            model, tokens[p:], random_sizes(rng, total - p, chunk), chunk, kv=fresh, start=p
        )
        assert torch.equal(logits, ref[p:]), f"continuation from P={p} differs"
        assert_states_equal(states(kv), states(ref_kv))


# -- negative controls -------------------------------------------------------------------------
@pytest.mark.parametrize("part", ["conv", "temporal"])
def test_a_flipped_state_element_changes_the_later_logits(part):
    model, chunk = MODELS[0], 8
    tokens = random_tokens(11, 21)
    ref, ref_kv = run_split(model, tokens, [13, 8], chunk)
    kv = DenseHybridKV(model.cfg, 21)
    head = model.forward(tokens[:13], 0, kv, chunk)
    layer = model.cfg.linear_layer_ids()[1]
    conv, temporal = (t.clone() for t in kv.read_state(layer))
    if part == "conv":  # a k channel: the next token's k, so its output and the temporal state
        conv[model.cfg.linear_heads * model.cfg.linear_key_dim + 1, -1] += 0.5
    else:
        temporal[1, -1, 2] += 0.5
    kv.write_state(layer, conv, temporal)
    tail = model.forward(tokens[13:], 13, kv, chunk)
    assert torch.equal(head, ref[:13])
    assert not torch.equal(tail, ref[13:]), "the state was not read"
    assert not torch.equal(kv.read_state(layer)[1], ref_kv.read_state(layer)[1])


def test_state_decays_but_is_not_forgotten():
    # Layer 0's inputs do not depend on its state, so a perturbation D of its temporal state
    # comes out after n tokens as prod(g) * D: smaller, and not zero.
    model, chunk, n = MODELS[1], 8, 48
    tokens = random_tokens(5, n)
    _, ref_kv = run_split(model, tokens, [n], chunk)
    kv = DenseHybridKV(model.cfg, n)
    conv, temporal = kv.read_state(0)
    kv.write_state(0, conv, temporal + 1.0)
    run_split(model, tokens, [n], chunk, kv=kv)
    delta = (kv.read_state(0)[1] - ref_kv.read_state(0)[1]).abs().max()
    assert 0 < delta < 0.5
    assert all(torch.isfinite(t).all() for s in states(ref_kv).values() for t in s)


def test_padding_rows_never_touch_the_state():
    model, chunk = MODELS[2], 8
    p = model.layers[0]
    h = torch.randn(chunk, model.cfg.hidden, generator=torch.Generator().manual_seed(3))
    other = h.clone()
    rows = slice(3, 6)
    other[:3] += 1.0
    other[6:] -= 2.0
    gen = torch.Generator().manual_seed(5)
    shapes = (model.cfg.conv_state_shape(), model.cfg.temporal_state_shape())
    start_state = [torch.randn(s, generator=gen) for s in shapes]
    results = []
    for x in (h, other):
        kv = DenseHybridKV(model.cfg, chunk)
        kv.write_state(0, *start_state)
        results.append((model._linear_mixer(0, p, x, rows, chunk, kv), states(kv)))
    (out_a, state_a), (out_b, state_b) = results
    assert torch.equal(out_a[rows], out_b[rows])
    assert not out_a[rows].eq(0).all()
    assert out_a[:3].eq(0).all() and out_a[6:].eq(0).all()
    assert_states_equal(state_a, state_b)
    # Through the whole model: a different padding token embedding changes nothing real.
    tokens = random_tokens(9, 19)
    ref, ref_kv = run_split(model, tokens, [5, 1, 7, 6], chunk)
    changed = TinyHybrid(model.cfg)
    changed.embed = model.embed.clone()
    changed.embed[0] = torch.randn(model.cfg.hidden, generator=torch.Generator().manual_seed(4))
    logits, kv = run_split(changed, tokens, [5, 1, 7, 6], chunk)
    assert torch.equal(logits, ref)
    assert_states_equal(states(kv), states(ref_kv))


def test_layers_see_their_global_ids():
    model, calls = MODELS[0], []

    class Recording(DenseHybridKV):
        def write(self, layer, k, v):
            calls.append(("kv", layer))
            super().write(layer, k, v)

        def read_state(self, layer):
            calls.append(("state", layer))
            return super().read_state(layer)

    model.forward(random_tokens(1, 10), 0, Recording(model.cfg, 10), 8)
    assert (
        calls == [("state", 0), ("state", 1), ("kv", 2), ("state", 3), ("state", 4), ("kv", 5)] * 2
    )


def test_weights_are_seeded():
    a, b, other = TinyHybrid(small(seed=0)), TinyHybrid(small(seed=0)), MODELS[1]
    for la, lb, lo in zip(a.layers, b.layers, other.layers, strict=True):
        assert la.keys() == lb.keys()
        assert all(torch.equal(la[n], lb[n]) for n in la)
        assert not torch.equal(la["mlp_norm"], lo["mlp_norm"])
    assert "w_in" in a.layers[0] and "wq" in a.layers[2] and "w_in" not in a.layers[2]
    tokens = random_tokens(2, 12)
    same = [run_split(m, tokens, [12], 4)[0] for m in (a, b)]
    assert torch.equal(same[0], same[1])
    assert not torch.equal(same[0], run_split(other, tokens, [12], 4)[0])
