"""SGLang's own code as the peer a side-by-side benchmark measures against.

``find_sglang`` imports SGLang's allocator module if this process can (``make sglang-venv``
installs SGLang 0.5.23's KV-memory code on a CPU-only machine in ``.venv-sglang``) and says why
not otherwise; nothing here imports SGLang at module level, so ``import tiered_kv`` never needs
it. Each peer part a benchmark uses (the allocators, the file storage backend) is one field of
``SGLangPeer`` and one adapter here, so the measuring modules never touch SGLang's modules.

The adapters call SGLang exactly as its scheduler does (``mem_cache/allocation.py``): at page
size 1 its ``TokenToKVPoolAllocator`` has no ``alloc_extend`` / ``alloc_decode`` (they raise), and
the scheduler calls ``alloc(extend_num_tokens)`` and ``alloc(batch_size)`` instead; the paged
allocator gets the same six arguments as ours.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

SGLANG_ALLOCATOR_MODULE = "sglang.srt.mem_cache.allocator"
SGLANG_STORAGE_MODULE = "sglang.srt.mem_cache.hicache_storage"
INSTALL_HINT = (
    "install it with `make sglang-venv` and run with "
    "PYTHONPATH=tools/sglang_peer/stubs .venv-sglang/bin/python"
)


@dataclass(frozen=True)
class SGLangPeer:
    """The SGLang classes a benchmark measures against, and the version they came from."""

    version: str
    token_allocator: type
    paged_allocator: type
    storage: Any = None  # mem_cache/hicache_storage.py (HiCacheFile), None where it fails to import


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
    try:
        storage = importlib.import_module(SGLANG_STORAGE_MODULE)
    except Exception:  # noqa: BLE001 - the allocators still run without it
        storage = None
    return SGLangPeer(version, mod.TokenToKVPoolAllocator, mod.PagedTokenToKVPoolAllocator, storage)


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


class SGLangFileStore:
    """SGLang's ``HiCacheFile`` in ``path`` (one rank of one model; its evictor off, as by
    default) behind the calls the storage benchmark makes of a store. ``HiCacheFile`` keeps one
    file per page named by the key: ``set`` skips a key whose file exists, writes the tensor into
    a temporary file (``numpy.tofile``) and renames it into place (no fsync, no checksum); ``get``
    opens the file and ``readinto``-s the target. Both get the host page itself (a uint8 view):
    the cheapest use of it (SGLang's own v2 read path reads into a scratch page and copies that
    into the host pool)."""

    def __init__(self, peer: SGLangPeer, path: str) -> None:
        mod = peer.storage
        if mod is None:
            raise ImportError(f"{SGLANG_STORAGE_MODULE} did not import in this process")
        os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # would override path
        config = mod.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="bench", extra_config={"file_storage_path": path},
        )  # fmt: skip
        self.impl = mod.HiCacheFile(config, file_path=path)

    def batch_set(self, keys: Sequence[bytes], source, pages: Sequence[int]) -> list[bool]:
        # HiCacheFile.batch_set is this loop, stopping at the first failure with one bool
        return [
            self.impl.set(k.hex(), source.get_page_bytes(p))
            for k, p in zip(keys, pages, strict=True)
        ]

    def batch_get(self, keys: Sequence[bytes], source, pages: Sequence[int]) -> list[bool]:
        return [
            self.impl.get(k.hex(), source.get_page_bytes(p)) is not None
            for k, p in zip(keys, pages, strict=True)
        ]

    def close(self) -> None:  # HiCacheFile holds no file open between calls
        return None
