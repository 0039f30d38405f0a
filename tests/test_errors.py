"""The TieredKVError family lives in one module: the tiers' error classes are defined in
``tiered_kv.errors``, exported from ``tiered_kv``, and the tiers re-export the same classes."""

from __future__ import annotations

import ast
from pathlib import Path

import tiered_kv
from tiered_kv import errors, host, storage
from tiered_kv.host import memory
from tiered_kv.storage import lmdb_env, lmdb_store

PACKAGE = Path(tiered_kv.__file__).parent


def test_the_tiers_define_no_error_class_of_their_own():
    elsewhere = []
    tiers = ("host", "kernels", "storage")
    for path in sorted(p for tier in tiers for p in (PACKAGE / tier).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                elsewhere.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert elsewhere == []


def test_moved_classes_are_the_same_everywhere():
    assert host.HostMemoryError is memory.HostMemoryError is errors.HostMemoryError
    assert storage.StorageOpenError is lmdb_store.StorageOpenError is errors.StorageOpenError
    assert lmdb_env.StorageOpenError is errors.StorageOpenError
    for name in ("HostMemoryError", "StorageOpenError", "TransferError"):
        cls = getattr(errors, name)
        assert getattr(tiered_kv, name) is cls and name in tiered_kv.__all__
        assert issubclass(cls, errors.TieredKVError) and cls.__bases__ == (errors.TieredKVError,)
