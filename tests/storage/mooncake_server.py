"""A real Mooncake Store for the tests: ``mooncake_master`` on 127.0.0.1 and memory lent to it by
this process's client (so stores opened without a budget, and child processes, have room).

Mooncake's clients listen on every address whatever they are told, so these tests run only in a
loopback-only network namespace: ``make test`` runs pytest under ``unshare -n``. Elsewhere they
skip, or fail where ``TIERED_KV_REQUIRE_MOONCAKE=1`` says they must run."""

from __future__ import annotations

import os

import pytest

from tiered_kv.errors import StorageOpenError
from tiered_kv.storage.mooncake_master import MooncakeMaster, loopback_only

LENT_BYTES = 256 << 20


def require_mooncake() -> None:
    """Skip (or fail, under TIERED_KV_REQUIRE_MOONCAKE=1) unless Mooncake can run here."""
    why = None
    if not loopback_only():
        why = (
            "the Mooncake tests run in a loopback-only network namespace (Mooncake listens on "
            "every address): run them via `make test`"
        )
    else:
        try:
            import mooncake.store  # noqa: F401
        except ImportError as exc:
            why = f"mooncake-transfer-engine-non-cuda is not installed ({exc}); `make install`"
    if why is None:
        return
    if os.environ.get("TIERED_KV_REQUIRE_MOONCAKE") == "1":
        pytest.fail(why)
    pytest.skip(why)


class MooncakeServer:
    """A master plus ``lent_bytes`` of this process's memory in the store; ``options`` are the
    storage options of a store on it."""

    def __init__(self, lent_bytes: int = LENT_BYTES, lease_ms: int = 10_000) -> None:
        require_mooncake()
        from tiered_kv.storage.mooncake_client import Connection, MooncakeClient

        try:
            self.master = MooncakeMaster(lease_ms=lease_ms)
        except StorageOpenError as exc:
            pytest.fail(str(exc))
        self.address = self.master.address
        self.options = {"master": self.address}
        self.client = MooncakeClient.shared(Connection(self.address))
        self.segments = self.client.mount(lent_bytes) if lent_bytes else []

    def flush(self) -> None:
        self.client.raw.remove_all(True)

    def close(self) -> None:
        """Stop the master and close this process's client on it (~2 s)."""
        self.master.stop()
        self.client.close()
