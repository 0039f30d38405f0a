"""Page keys: namespace fingerprint + chained SHA-256 digests over full pages of tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage import StorageNamespace, page_digests, page_keys
from tiered_kv.storage.keys import DIGEST_BYTES, FINGERPRINT_BYTES, KEY_BYTES, digest_of

from ._util import P, make_host


@pytest.fixture(scope="module")
def ns() -> StorageNamespace:
    return StorageNamespace.for_host_pool(make_host(), model="test-model")


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2**32, size=n, dtype=np.uint64).tolist()


def test_keys_only_for_full_pages(ns):
    toks = _tokens(5 * P + 3)
    assert len(page_keys(ns, toks, P)) == 5
    assert len(page_keys(ns, toks[: 5 * P], P)) == 5
    assert len(page_keys(ns, toks[: P - 1], P)) == 0
    assert page_keys(ns, [], P) == []
    # The partial tail does not influence the full pages' keys.
    assert page_keys(ns, toks, P) == page_keys(ns, toks[: 5 * P], P)


def test_same_tokens_same_namespace_same_keys(ns):
    toks = _tokens(6 * P)
    again = StorageNamespace.for_host_pool(make_host(), model="test-model")
    assert again == ns
    assert page_keys(ns, toks, P) == page_keys(again, list(toks), P)


@pytest.mark.parametrize("i", [0, 2, 5])
def test_changing_a_token_changes_its_key_and_all_later(ns, i):
    toks = _tokens(6 * P, seed=1)
    base = page_keys(ns, toks, P)
    for offset in (0, P - 1):
        changed = list(toks)
        changed[i * P + offset] ^= 1
        keys = page_keys(ns, changed, P)
        assert keys[:i] == base[:i]
        for j in range(i, 6):
            assert keys[j] != base[j], (i, offset, j)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_chain_continues_from_prior_digest(ns, k):
    toks = _tokens(6 * P + 2, seed=2)
    keys = page_keys(ns, toks, P)
    assert page_keys(ns, toks[k * P :], P, prior=digest_of(keys[k - 1])) == keys[k:]
    digests = page_digests(toks, P)
    assert digests[k:] == page_digests(toks[k * P :], P, prior=digests[k - 1])
    assert [digest_of(key) for key in keys] == digests


def test_key_shape(ns):
    keys = page_keys(ns, _tokens(3 * P), P)
    assert KEY_BYTES == FINGERPRINT_BYTES + DIGEST_BYTES
    for key in keys:
        assert isinstance(key, bytes)
        assert len(key) == KEY_BYTES
        assert key.startswith(ns.fingerprint)
        assert len(ns.fingerprint) == FINGERPRINT_BYTES
        assert ns.owns(key)


def test_different_namespaces_give_different_keys(ns):
    variants = {
        "layout": StorageNamespace.for_host_pool(
            make_host(layout="layer_first"), model="test-model"
        ),
        "dtype": StorageNamespace.for_host_pool(make_host(dtype=torch.float16), model="test-model"),
        "heads": StorageNamespace.for_host_pool(make_host(heads=3), model="test-model"),
        "page_size": StorageNamespace.for_host_pool(make_host(page_size=2 * P), model="test-model"),
        "tenant": StorageNamespace.for_host_pool(
            make_host(), tenant="tenant-a", model="test-model"
        ),
        "tenant2": StorageNamespace.for_host_pool(
            make_host(), tenant="tenant-b", model="test-model"
        ),
    }
    toks = _tokens(4 * P, seed=3)
    base = page_keys(ns, toks, P)
    fps = {ns.fingerprint} | {v.fingerprint for v in variants.values()}
    assert len(fps) == len(variants) + 1
    for name, other in variants.items():
        keys = page_keys(other, toks, P)
        assert len(keys) == len(base)
        for a, b in zip(keys, base, strict=True):
            assert a != b, name
            assert not ns.owns(a), name
            assert not other.owns(b), name


def test_list_numpy_torch_tokens_agree(ns):
    toks = _tokens(5 * P + 1, seed=4)
    small = [t % 2**31 for t in toks]
    ref = page_keys(ns, toks, P)
    assert page_keys(ns, np.array(toks, dtype=np.uint32), P) == ref
    assert page_keys(ns, np.array(toks, dtype=np.int64), P) == ref
    assert page_keys(ns, tuple(toks), P) == ref
    assert page_keys(ns, torch.tensor(toks, dtype=torch.int64), P) == ref
    ref_small = page_keys(ns, small, P)
    assert page_keys(ns, torch.tensor(small, dtype=torch.int32), P) == ref_small
    assert page_keys(ns, np.array(small, dtype=np.int32), P) == ref_small
    assert page_keys(ns, torch.tensor(small, dtype=torch.int32)[None, :][0], P) == ref_small


def test_token_bounds(ns):
    assert len(page_keys(ns, [0] * P, P)) == 1
    assert len(page_keys(ns, [2**32 - 1] * P, P)) == 1
    assert page_keys(ns, [2**32 - 1] * P, P) != page_keys(ns, [0] * P, P)


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, -1, 4],
        [1, 2, 2**32, 4],
        np.array([1, 2, -5, 4]),
        torch.tensor([1, 2, 3, 2**32]),
        [[1, 2, 3, 4]],
        np.zeros((2, P), dtype=np.int64),
        torch.zeros((2, P), dtype=torch.int64),
        [0.5, 1.0, 2.0, 3.0],
    ],
    ids=["neg", "too-big", "np-neg", "torch-too-big", "2d-list", "2d-np", "2d-torch", "floats"],
)
def test_bad_tokens_raise(ns, tokens):
    with pytest.raises(InvalidArgumentError):
        page_keys(ns, tokens, P)
    with pytest.raises(InvalidArgumentError):
        page_digests(tokens, P)


@pytest.mark.parametrize("page_size", [0, -1, 1.0, True, "4"])
def test_bad_page_size_raises(ns, page_size):
    with pytest.raises(InvalidArgumentError):
        page_keys(ns, _tokens(2 * P), page_size)


@pytest.mark.parametrize("n", [1, 16, 31, 33, 48])
def test_prior_of_wrong_length_raises(ns, n):
    with pytest.raises(InvalidArgumentError):
        page_keys(ns, _tokens(2 * P), P, prior=b"\x01" * n)


def test_full_key_as_prior_raises(ns):
    keys = page_keys(ns, _tokens(2 * P), P)
    with pytest.raises(InvalidArgumentError):
        page_keys(ns, _tokens(2 * P), P, prior=keys[0])  # a key, not its digest


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.integers(1, 5),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=30),
    data=st.data(),
)
def test_digest_depends_exactly_on_its_prefix(page_size, tokens, data):
    digests = page_digests(tokens, page_size)
    assert len(digests) == len(tokens) // page_size
    # Digest i is a function of tokens[: (i+1)*P] alone ...
    for i, d in enumerate(digests):
        assert page_digests(tokens[: (i + 1) * page_size], page_size)[i] == d
    # ... and of every one of them: changing token j changes exactly the digests i with
    # j < (i+1)*P.
    j = data.draw(st.integers(0, len(tokens) - 1), label="j")
    new = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != tokens[j]), label="new")
    changed = list(tokens)
    changed[j] = new
    after = page_digests(changed, page_size)
    for i in range(len(digests)):
        assert (after[i] != digests[i]) == (j < (i + 1) * page_size), (i, j)
