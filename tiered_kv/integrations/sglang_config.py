"""The SGLang HiCache backend's settings: SGLang's storage config and extra config read once.

SGLang hands a dynamic backend its ``HiCacheStorageConfig`` (ranks, MLA or not, the model name)
with ``--hicache-storage-backend-extra-config`` as ``extra_config``. Besides SGLang's own keys
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``) the extra config takes
our ``StorageConfig`` fields by name (``storage_backend``, ``storage_options``, ``storage_path``,
``storage_bytes``, ...), ``model_id`` and ``namespace_salt``. Nothing here imports SGLang: the
config is read by attribute.

Rank identity: tensor-parallel ranks of an MHA model hold different heads, so each rank's pages
live under its own namespace; MLA KV is the same on every tensor-parallel rank, so those ranks
share one namespace and only SGLang's storage writer (``is_storage_writer``: TP rank 0) writes,
as SGLang's ``HiCacheFile`` does. Pipeline stages and context-parallel ranks hold different
bytes under both, so they are always part of the rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Protocol

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage_config import StorageConfig

EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
# Keys SGLang itself reads from the extra config of a dynamic backend (tp_lcm_size is popped
# by its controller before we see the dict, when given).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
# model_id and rank are ours to set; SGLang batches the calls itself (STORAGE_BATCH_SIZE pages)
STORAGE_KEYS = frozenset(
    f.name
    for f in fields(StorageConfig)
    if f.name not in ("model_id", "rank", "storage_batch_pages")
)
OUR_KEYS = STORAGE_KEYS | {"model_id"}


class SGLangStorageConfig(Protocol):
    """What we read of SGLang's ``HiCacheStorageConfig`` (mem_cache/hicache_storage.py)."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    attn_cp_rank: int
    attn_cp_size: int
    is_mla_model: bool
    enable_storage_metrics: bool
    model_name: str | None
    extra_config: dict | None


@dataclass(frozen=True)
class HiCacheSettings:
    """What the backend opens: the store's config, whose pages (model, rank) and whether this
    rank writes."""

    storage: StorageConfig
    model_id: str
    rank: str | None  # None: the ranks share one copy (MLA across tensor-parallel ranks)
    writer: bool
    metrics: bool


def _bad(key: str, value: object, valid: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{EXTRA_CONFIG_FLAG} {key}={value!r} is invalid: {valid}")


def _int_field(config: SGLangStorageConfig, name: str, default: int) -> int:
    value = getattr(config, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"HiCacheStorageConfig.{name}={value!r}: expected an int >= 0")
    return value


def rank_identity(config: SGLangStorageConfig) -> str | None:
    """The namespace's rank part: which slice of the model's KV this rank's pages hold."""
    tp_rank, tp_size = _int_field(config, "tp_rank", 0), _int_field(config, "tp_size", 1)
    pp_rank, pp_size = _int_field(config, "pp_rank", 0), _int_field(config, "pp_size", 1)
    cp_rank, cp_size = _int_field(config, "attn_cp_rank", 0), _int_field(config, "attn_cp_size", 1)
    if _int_field(config, "dcp_size", 1) > 1:
        raise InvalidArgumentError(
            "HiCacheStorageConfig.dcp_size > 1: decode context parallelism shards MLA pages "
            "across ranks, which this backend does not store; run without DCP or use SGLang's "
            "file or mooncake backend"
        )
    if bool(getattr(config, "should_split_heads", False)):
        raise InvalidArgumentError(
            f"{EXTRA_CONFIG_FLAG} tp_lcm_size: pages split by heads across ranks of different "
            "tensor-parallel sizes are not stored by this backend; drop tp_lcm_size"
        )
    parts = [] if bool(config.is_mla_model) else [f"tp{tp_rank}of{tp_size}"]
    if pp_size > 1:
        parts.append(f"pp{pp_rank}of{pp_size}")
    if cp_size > 1:
        parts.append(f"cp{cp_rank}of{cp_size}")
    return "-".join(parts) or None


def read_settings(config: SGLangStorageConfig) -> HiCacheSettings:
    """Settings from SGLang's storage config; a bad or unknown extra-config key is an
    ``InvalidArgumentError`` naming it, the value and what is valid."""
    extra = config.extra_config if config.extra_config is not None else {}
    if not isinstance(extra, Mapping):
        raise _bad("extra_config", extra, "a JSON object")
    unknown = sorted(k for k in extra if k not in SGLANG_KEYS | OUR_KEYS)
    if unknown:
        raise _bad(
            unknown[0],
            extra[unknown[0]],
            f"unknown key; valid keys are {', '.join(sorted(SGLANG_KEYS | OUR_KEYS))}",
        )
    # SGLang's model name stands in only where it names a weights revision itself: a path or
    # served name without one would let a fine-tune saved over its base share its pages.
    model_id = extra.get("model_id", config.model_name)
    name, at, revision = model_id.rpartition("@") if isinstance(model_id, str) else ("", "", "")
    if not (name and at and revision):
        raise _bad(
            "model_id",
            model_id,
            "'<name>@<weights revision>' (a commit or checkpoint digest) in the extra config; "
            "SGLang's model name stands in only when it has that form",
        )
    size = extra.get("storage_bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise _bad("storage_bytes", size, "an int >= 1: the store's budget in bytes")
    options = {k: extra[k] for k in STORAGE_KEYS if k in extra}
    try:
        storage = StorageConfig(**options, model_id=model_id)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{EXTRA_CONFIG_FLAG}: {exc}") from None
    writer = bool(getattr(config, "is_storage_writer", True))
    return HiCacheSettings(
        storage=storage,
        model_id=model_id,
        rank=rank_identity(config),
        writer=writer,
        metrics=bool(getattr(config, "enable_storage_metrics", False)),
    )
