"""StorageConfig: the storage tier's section of ``TieredKVConfig`` (frozen, validated).

``storage_backend`` chooses the store: ``lmdb`` (the default: the embedded store under
``storage_path``, in the ``storage_layout``; ``local`` is the same), ``redis`` (``RedisStorage``
on a shared server), ``mooncake`` (``MooncakeStorage`` on a Mooncake Store), or any
``module.path:ClassName`` implementing the storage contract;
``storage_options`` are that backend's own keyword options (e.g. ``{"url":
"redis://10.0.0.5:6379/0"}``), and ``storage_local_copy`` keeps a local store in front of a
remote backend (``LayeredStorage``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tiered_kv._config_checks import _choice, _ints, _is_int, _need
from tiered_kv.names import StorageLayout

EMBEDDED = ("lmdb", "local")  # the embedded store: one backend, two names
BACKENDS = (*EMBEDDED, "redis", "mooncake")  # or "module.path:ClassName"
BACKEND_HINT = "lmdb (the embedded default), redis, mooncake or module.path:ClassName"


def is_embedded(name: str) -> bool:
    return name in EMBEDDED


def backend_ok(name: object) -> bool:
    if not isinstance(name, str):
        return False
    if name in BACKENDS:
        return True
    module, _, cls = name.partition(":")
    return (
        bool(module)
        and bool(cls)
        and all(p.isidentifier() for p in module.split("."))
        and (cls.isidentifier())
    )


@dataclass(frozen=True)
class StorageConfig:
    storage_bytes: int = 0  # 0: no storage tier
    storage_path: str | os.PathLike | None = None
    namespace_salt: str | None = None  # a tenant's salt: its keys never match another's
    model_id: str | None = None  # the model's name + weights fingerprint or revision (storage)
    rank: str | None = None  # the parallel rank, where ranks hold different bytes
    kv_scales_id: str | None = None  # identity of quantized KV's scales (float8 KV needs one)
    storage_batch_pages: int = 32
    storage_layout: str = "slab"  # StorageLayout: where page bytes live on disk (local)
    storage_backend: str = "lmdb"  # BACKEND_HINT
    storage_options: Mapping[str, object] | None = None  # the backend's own keyword options
    # a remote backend with a local store (under storage_path) in front: LayeredStorage
    storage_local_copy: bool = False
    io_threads: int | None = None  # None: the store's default
    durable: bool = False
    hugepages: bool = False

    def __post_init__(self) -> None:
        _ints(self, ("storage_bytes",), minimum=0)
        _ints(self, ("storage_batch_pages",))
        b = self.storage_backend
        _need(backend_ok(b), self, "storage_backend", BACKEND_HINT)
        o = self.storage_options
        ok = o is None or (isinstance(o, Mapping) and all(isinstance(k, str) for k in o))
        _need(ok, self, "storage_options", "None or a mapping of option names to values")
        lc = self.storage_local_copy
        _need(isinstance(lc, bool), self, "storage_local_copy", "True or False")
        _need(not lc or not is_embedded(b), self, "storage_local_copy", f"False with {b!r}")
        if self.storage_bytes and (is_embedded(b) or lc):
            ok = self.storage_path is not None
            _need(ok, self, "storage_path", "a directory for the local store (storage_bytes > 0)")
        _need(
            self.storage_path is None or isinstance(self.storage_path, (str, os.PathLike)),
            self,
            "storage_path",
            "None or a directory path (str or os.PathLike)",
        )
        _choice(self, "storage_layout", StorageLayout.values())
        s = self.namespace_salt
        _need(s is None or isinstance(s, str), self, "namespace_salt", "None or a str")
        for n in ("model_id", "rank", "kv_scales_id"):
            v = getattr(self, n)
            _need(v is None or (isinstance(v, str) and bool(v)), self, n, "None or a non-empty str")
        t = self.io_threads
        _need(t is None or (_is_int(t) and t >= 1), self, "io_threads", "None or an int >= 1")
        for n in ("durable", "hugepages"):
            _need(isinstance(getattr(self, n), bool), self, n, "True or False")
