"""What the tree's reads and changes hand back: ``TreeMatch`` (a prefix's place on the tiers,
from a pure read) and ``Released`` (slots a change took from its nodes, for the manager to
free)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tiered_kv.tree.node import TreeNode


class TreeMatch(NamedTuple):
    """Where the longest cached page-aligned prefix of a key lives (a read; nothing changed).
    ``steps`` are (node, tokens matched in it) from the root; only the last may be partial."""

    key: tuple  # the page-aligned key that was matched
    steps: tuple[tuple[TreeNode, int], ...]
    device_indices: torch.Tensor  # device slots of the device-resident prefix
    device_len: int
    host_len: int  # tokens after the device part, on the host
    probe_digests: tuple  # chain digests of the pages after the match (to look up in storage)
    root: TreeNode  # the root of the request's identity (a new one, unlinked, if none yet)
    prior: bytes = b""  # that identity's chain prior (b"": no extra key)

    @property
    def length(self) -> int:
        return self.device_len + self.host_len


class Released(NamedTuple):
    """Slots a tree change took from its nodes, for the manager to free."""

    device: list[torch.Tensor]
    host: list[torch.Tensor]
    tokens: int  # tokens of the nodes that left the tree
