"""What a prefix match hands its callers: ``PrefixMatch`` (a request's cached prefix on every
tier) and ``StorageHit`` (the pages storage holds after the tree's part)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tiered_kv.tree.node import TreeNode


class StorageHit(NamedTuple):
    """Pages found in storage after the tree's match: their keys, the first ``windowless`` of
    them full-KV-only values."""

    keys: list[bytes]
    windowless: int = 0

    @property
    def pages(self) -> int:
        return len(self.keys)


class PrefixMatch(NamedTuple):
    """A request's cached prefix on every tier (whole nodes; the tree was split to them)."""

    device_indices: torch.Tensor  # device slots of the device-resident prefix
    last_device_node: TreeNode
    last_node: TreeNode  # deepest matched node (on device or host)
    device_hit_length: int
    host_hit_length: int  # tokens after the device part, on host
    storage_hit_length: int  # tokens after the host part, in storage
    storage_keys: list[bytes]
    storage_windowless: int = 0  # leading storage pages that are full-KV-only values
    prior: bytes = b""  # the request identity it was matched under (extra_key_prior)
