"""Issue 27: request identities in the tree. Each extra key's prefixes live below a root of
its own whose chain prior starts their digests; a match under another identity finds nothing;
a root that loses its last child goes; ``check_tree`` checks the roots."""

from __future__ import annotations

import random

import pytest
import torch

from tiered_kv.errors import IntegrityError, InvalidArgumentError
from tiered_kv.names import Tier
from tiered_kv.storage.keys import extra_key_prior, page_digests
from tiered_kv.tree import TieredTree, check_tree, victims

P = 3


def slots(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64)


def test_extra_key_prior_is_empty_for_none_and_wide_otherwise():
    assert extra_key_prior(None) == b""
    a, b = extra_key_prior("lora=a"), extra_key_prior("lora=b")
    assert len(a) == 32 and a != b
    assert extra_key_prior("lora=a") == extra_key_prior(b"lora=a")  # a str is its UTF-8
    long = bytes(range(256)) * 64
    assert extra_key_prior(long + b"\x00") != extra_key_prior(long + b"\x01")
    for bad in ("", b"", 3, 1.5, ["x"], None.__class__):
        with pytest.raises(InvalidArgumentError, match="extra_key="):
            extra_key_prior(bad)


def test_prefixes_of_one_identity_are_invisible_to_another():
    rng = random.Random(7)
    tree = TieredTree(P, digests=True)
    tokens = [rng.randrange(1000) for _ in range(4 * P)]
    pa, pb = extra_key_prior("a"), extra_key_prior("b")
    _, new, _ = tree.insert(tokens, slots(1, len(tokens)), prior=pa)
    assert len(new) == 1 and new[0].parent is tree.roots[pa]
    assert new[0].digests == page_digests(tokens, P, pa)
    assert tree.match(tokens, prior=pa).length == len(tokens)
    for other in (b"", pb):
        m = tree.match(tokens, prior=other)
        assert m.length == 0
        assert m.probe_digests == tuple(page_digests(tokens, P, other))
    assert pb not in tree.roots  # a match is a read: no root was made
    dup, new_b, kept = tree.insert(tokens, slots(100, len(tokens)), prior=pb)
    assert dup == 0 and kept == len(tokens) and len(new_b) == 1
    assert set(new_b[0].digests).isdisjoint(new[0].digests)
    check_tree(tree)


def test_an_identity_root_without_children_goes():
    tree = TieredTree(P, digests=True)
    pa = extra_key_prior("a")
    tokens = list(range(2 * P))
    tree.insert(tokens, slots(1, 2 * P), prior=pa)
    assert pa in tree.roots
    freed = []
    for n in victims(tree, Tier.DEVICE):
        freed.append(tree.detach(n))
        break
    assert freed and pa not in tree.roots and b"" in tree.roots
    check_tree(tree)
    assert tree.match(tokens, prior=pa).length == 0


def test_node_at_adopts_the_identity_root_for_callers_that_add_below_it():
    tree = TieredTree(P, digests=True)
    pa = extra_key_prior("a")
    m = tree.match(list(range(P)), prior=pa)
    last_dev, last = tree.node_at(m)
    assert last is tree.roots[pa] and last_dev is last
    node = tree.add_child(last, tuple(range(P)))
    tree.set_host(node, slots(1, P))
    assert tree.match(list(range(P)), prior=pa).host_len == P
    check_tree(tree)


def test_a_bad_prior_is_refused():
    tree = TieredTree(P, digests=True)
    with pytest.raises(InvalidArgumentError, match="prior="):
        tree.match([1, 2, 3], prior=b"short")
    with pytest.raises(InvalidArgumentError, match="prior="):
        tree.insert([1, 2, 3], slots(1, 3), prior=b"x" * 31)
    assert list(tree.roots) == [b""]


def test_check_tree_catches_a_root_without_its_prior():
    tree = TieredTree(P, digests=True)
    pa = extra_key_prior("a")
    tree.insert(list(range(P)), slots(1, P), prior=pa)
    tree.roots[pa].digests = [extra_key_prior("b")]
    with pytest.raises(IntegrityError, match="chain prior"):
        check_tree(tree)
