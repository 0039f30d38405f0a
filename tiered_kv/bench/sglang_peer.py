"""SGLang's own code as the peer a side-by-side benchmark measures against.

``find_sglang`` imports SGLang's allocator module if this process can (the recipe in
``../shared/peer/`` installs SGLang 0.5.23's KV-memory code on a CPU-only machine) and says why
not otherwise; nothing here imports SGLang at module level, so ``import tiered_kv`` never needs
it. Each peer part a benchmark uses (the allocators now; a storage backend later) is one field of
``SGLangPeer`` and one adapter here, so the measuring modules never touch SGLang's modules.

The adapters call SGLang exactly as its scheduler does (``mem_cache/allocation.py``): at page
size 1 its ``TokenToKVPoolAllocator`` has no ``alloc_extend`` / ``alloc_decode`` (they raise), and
the scheduler calls ``alloc(extend_num_tokens)`` and ``alloc(batch_size)`` instead; the paged
allocator gets the same six arguments as ours.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_ALLOCATOR_MODULE = "sglang.srt.mem_cache.allocator"
INSTALL_HINT = (
    "install it with ../shared/peer/setup.sh and run with "
    "PYTHONPATH=/tmp/peer/stubs:<this checkout> /tmp/peer/venv/bin/python"
)


@dataclass(frozen=True)
class SGLangPeer:
    """The SGLang classes a benchmark measures against, and the version they came from."""

    version: str
    token_allocator: type
    paged_allocator: type


def find_sglang() -> SGLangPeer | str:
    """The peer, or why it cannot be imported in this process (a sentence)."""
    try:
        mod = importlib.import_module(SGLANG_ALLOCATOR_MODULE)
    except Exception as exc:  # ImportError, or a stand-in that raises while SGLang imports
        return f"SGLang is not installed here (import {SGLANG_ALLOCATOR_MODULE}: {exc!r})"
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return SGLangPeer(version, mod.TokenToKVPoolAllocator, mod.PagedTokenToKVPoolAllocator)


class SGLangAllocator:
    """One SGLang allocator behind the calls the allocator comparison makes."""

    def __init__(
        self, peer: SGLangPeer, size: int, page_size: int, device: torch.device, *, paged: bool
    ) -> None:
        """``paged=False`` (page size 1 only): the token allocator; else the paged one."""
        dev = str(device)
        self.paged = paged
        if paged:
            self.impl: Any = peer.paged_allocator(size, page_size, None, dev, None, False)
        else:
            self.impl = peer.token_allocator(size, None, dev, None, False)
        self.page_size = page_size

    # -- state (untimed) -------------------------------------------------------------------
    def clear(self) -> None:
        self.impl.clear()

    def free_list(self) -> torch.Tensor:
        return self.impl.get_all_free_pages()

    # -- the timed calls -------------------------------------------------------------------
    def alloc_extend(self, args: tuple[Any, ...]) -> torch.Tensor | None:
        if not self.paged:
            return self.impl.alloc(args[5])
        return self.impl.alloc_extend(*args)

    def alloc_decode(self, args: tuple[Any, ...]) -> torch.Tensor | None:
        if not self.paged:
            return self.impl.alloc(int(args[0].shape[0]))
        return self.impl.alloc_decode(*args)

    def free(self, slots: torch.Tensor) -> None:
        self.impl.free(slots)
