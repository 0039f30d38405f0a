"""open_backend: the page store a ``StorageConfig`` names, opened for one namespace.

``lmdb`` (or ``local``) is the embedded store under the storage directory
(``layouts.open_store``, in the configured layout); ``redis`` is ``RedisStorage`` on the server
its options name, ``mooncake`` ``MooncakeStorage`` on the Mooncake master they name (both
imported only when chosen); any other ``module.path:ClassName`` is imported and must be a
``PageStorage`` subclass taking ``(namespace, page_nbytes, *, budget_bytes=...,
**storage_options)``. With
``storage_local_copy`` the remote store gets a local one in front (``LayeredStorage``). A
backend that cannot be imported or built is a ``StorageOpenError`` naming it, raised before the
cache is built.
"""

from __future__ import annotations

import importlib
import os

from tiered_kv.errors import StorageOpenError
from tiered_kv.storage.contract import PageStorage
from tiered_kv.storage.keys import StorageNamespace
from tiered_kv.storage.layered_store import LayeredStorage
from tiered_kv.storage.layouts import open_store
from tiered_kv.storage_config import BACKEND_HINT, StorageConfig, is_embedded


def backend_class(name: str) -> type[PageStorage]:
    """The class of a ``module.path:ClassName`` backend (or ``redis``, ``mooncake``)."""
    if name == "redis":
        from tiered_kv.storage.redis_store import RedisStorage

        return RedisStorage
    if name == "mooncake":
        from tiered_kv.storage.mooncake_store import MooncakeStorage

        return MooncakeStorage
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise StorageOpenError(
            f"storage_backend={name!r} cannot be loaded ({type(exc).__name__}: {exc}); give "
            f"{BACKEND_HINT} (importable)"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, PageStorage)):
        raise StorageOpenError(
            f"storage_backend={name!r} is not a PageStorage subclass (the storage contract)"
        )
    return cls


def open_backend(
    s: StorageConfig,
    path: str | os.PathLike[str] | None,
    namespace: StorageNamespace,
    page_nbytes: int,
) -> PageStorage:
    """The store ``s`` configures, for ``namespace``'s pages of ``page_nbytes``. A namespace
    missing a field (``StorageNamespace.check_complete``) is refused first: fail closed."""
    namespace.check_complete()
    if is_embedded(s.storage_backend):
        return _local(s, path, namespace, page_nbytes)
    cls = backend_class(s.storage_backend)
    options = dict(s.storage_options or {})
    local = _local(s, path, namespace, page_nbytes) if s.storage_local_copy else None
    try:
        remote = cls(namespace, page_nbytes, budget_bytes=s.storage_bytes, **options)
    except TypeError as exc:  # an option the backend does not take
        if local is not None:
            local.close()
        raise StorageOpenError(
            f"storage_backend={s.storage_backend!r} refused storage_options={options!r}: {exc}"
        ) from None
    except BaseException:
        if local is not None:
            local.close()
        raise
    return remote if local is None else LayeredStorage(local, remote)


def _local(s: StorageConfig, path, namespace: StorageNamespace, page_nbytes: int) -> PageStorage:
    return open_store(
        s.storage_layout,
        path,
        namespace,
        page_nbytes,
        budget_bytes=s.storage_bytes,
        durable=s.durable,
        hugepages=s.hugepages,
        io_threads=s.io_threads,
    )
