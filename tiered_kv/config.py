"""TieredKVConfig: everything a :class:`TieredKVCache` is built from, frozen and validated.

Every check names the field and what would be valid; nothing is built from a config that fails.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.eviction import POLICIES
from tiered_kv.tiered_radix_cache import WRITE_POLICIES

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
MODEL_KINDS = ("mha", "mla")
HOST_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
IO_BACKENDS = ("kernel", "direct")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TieredKVConfig:
    # model geometry
    num_layers: int = 4
    model: str = "mha"  # "mha" or "mla"
    head_num: int = 2  # MHA: KV heads
    head_dim: int = 64  # MHA: K head dim (V the same unless v_head_dim)
    v_head_dim: int | None = None
    kv_lora_rank: int = 64  # MLA
    qk_rope_head_dim: int = 16  # MLA
    dtype: str = "float32"
    # paging and capacities (tokens)
    page_size: int = 16
    device_tokens: int = 4096
    host_tokens: int = 16384  # 0: no host tier (and then no storage tier)
    storage_bytes: int = 0  # 0: no storage tier
    storage_path: str | None = None
    namespace_salt: str | None = None
    max_requests: int = 64
    max_context_len: int = 8192
    # data path
    host_layout: str = "page_first"
    io_backend: str = "kernel"
    device: str = "cpu"
    storage_batch_pages: int = 32
    # policies
    device_policy: str = "lru"
    host_policy: str = "lru"
    write_policy: str = "write_through"
    selective_hits: int = 2
    prefetch_policy: str = "best_effort"
    prefetch_threshold: int = 256  # tokens: smaller storage hits are recomputed
    prefetch_timeout_base_s: float = 0.5
    prefetch_timeout_per_1k_s: float = 0.25
    prefetch_timeout_max_s: float = 5.0

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, valid: str) -> None:
            if not ok:
                raise InvalidArgumentError(
                    f"TieredKVConfig.{field}={getattr(self, field)!r} is invalid: {valid}"
                )

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def choice(field: str, options) -> None:
            need(getattr(self, field) in options, field, f"use one of {', '.join(options)}")

        for f in (
            "num_layers",
            "head_num",
            "head_dim",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "page_size",
            "device_tokens",
            "max_requests",
            "max_context_len",
            "storage_batch_pages",
            "selective_hits",
        ):
            need(is_int(getattr(self, f)) and getattr(self, f) >= 1, f, "an int >= 1")
        need(
            self.v_head_dim is None or (is_int(self.v_head_dim) and self.v_head_dim >= 1),
            "v_head_dim",
            "None or an int >= 1",
        )
        ps = self.page_size
        need(ps & (ps - 1) == 0, "page_size", "a power of two (1, 2, 4, ..., 16, 32, 64, ...)")
        need(
            self.device_tokens % ps == 0 and self.device_tokens >= 2 * ps,
            "device_tokens",
            f"a multiple of page_size={ps}, at least two pages",
        )
        need(is_int(self.host_tokens) and self.host_tokens >= 0, "host_tokens", "an int >= 0")
        if self.host_tokens:
            need(
                self.host_tokens >= ps,
                "host_tokens",
                f"0 (no host tier) or at least one page ({ps} tokens)",
            )
            need(self.host_tokens % ps == 0, "host_tokens", f"a multiple of page_size={ps}")
        need(is_int(self.storage_bytes) and self.storage_bytes >= 0, "storage_bytes", "an int >= 0")
        if self.storage_bytes:
            need(
                self.host_tokens > 0,
                "storage_bytes",
                "0 when host_tokens is 0 (storage pages move through the host tier)",
            )
            need(
                self.storage_path is not None, "storage_path", "a directory when storage_bytes > 0"
            )
        need(
            self.storage_path is None or isinstance(self.storage_path, (str, os.PathLike)),
            "storage_path",
            "None or a directory path (str or os.PathLike)",
        )
        need(
            self.namespace_salt is None or isinstance(self.namespace_salt, str),
            "namespace_salt",
            "None or a str",
        )
        need(
            is_int(self.prefetch_threshold) and self.prefetch_threshold >= 0,
            "prefetch_threshold",
            "an int >= 0 (tokens)",
        )
        for f in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_s", "prefetch_timeout_max_s"):
            v = getattr(self, f)
            need(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                f,
                "a number of seconds >= 0",
            )
        choice("model", MODEL_KINDS)
        choice("dtype", tuple(DTYPES))
        choice("host_layout", HOST_LAYOUTS)
        choice("io_backend", IO_BACKENDS)
        choice("device", ("cpu", "cuda"))
        choice("device_policy", POLICIES)
        choice("host_policy", POLICIES)
        choice("write_policy", WRITE_POLICIES)
        choice("prefetch_policy", PREFETCH_POLICIES)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def storage_dir(self) -> Path | None:
        return Path(self.storage_path) if self.storage_bytes else None

    def prefetch_timeout_s(self, tokens: int) -> float:
        """``timeout`` policy: base + per-1K-token term, capped."""
        t = self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * tokens / 1000
        return min(t, self.prefetch_timeout_max_s)

    def replace(self, **changes) -> TieredKVConfig:
        return dataclasses.replace(self, **changes)
