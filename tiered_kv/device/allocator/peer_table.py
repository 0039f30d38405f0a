"""What the composite allocators share: sub-allocators of one kind per side, and a table that
pairs one side's slots with the other's.

A composite (sliding-window: full and window slots; HiSparse: logical and device slots) builds
each side with ``sub_allocator`` (the token allocator at page size 1, the paged one above) and
keeps ``table[slot of side A] = slot of side B`` (0: no peer) in a tensor of ``n + 1`` entries
whose last is a -1 sentinel, so a ``last_loc`` of -1 translates to -1.
"""

from __future__ import annotations

import torch

from tiered_kv.device.allocator.paged import PagedTokenToKVPoolAllocator
from tiered_kv.device.allocator.token import TokenToKVPoolAllocator
from tiered_kv.device.kv_cache import KVCache
from tiered_kv.platform import KernelBackend


def sub_allocator(
    size: int,
    page_size: int,
    dtype: torch.dtype | None,
    device: torch.device,
    pool: KVCache | None,
    need_sort: bool,
    debug: bool,
    kernel_backend: str | KernelBackend | None,
) -> TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator:
    if page_size == 1:
        return TokenToKVPoolAllocator(size, dtype, device, pool, need_sort, debug_mode=debug)
    return PagedTokenToKVPoolAllocator(
        size, page_size, dtype, device, pool, need_sort,
        debug_mode=debug, kernel_backend=kernel_backend,
    )  # fmt: skip


def new_peer_table(entries: int, device: torch.device) -> torch.Tensor:
    """``entries`` zeros (no peer) and the -1 sentinel."""
    return torch.cat(
        [
            torch.zeros(entries, dtype=torch.int64, device=device),
            torch.full((1,), -1, dtype=torch.int64, device=device),
        ]
    )


def release_peers(table: torch.Tensor, entries: torch.Tensor, peers_allocator) -> None:
    """Clear ``entries`` of ``table`` and give the peers they named back to their allocator
    (entries without a peer are skipped)."""
    peers = table[entries]
    table[entries] = 0
    peers = peers[peers > 0]
    if peers.numel():
        peers_allocator.free(peers)
