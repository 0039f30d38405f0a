"""MooncakeClient: a process's connection to a Mooncake Store (``MooncakeDistributedStore``),
shared by every store opened on the same master, with the memory it has registered and the
segments it lends to the store.

One client per (master, metadata server, hostname, protocol, devices) in a process: a client
takes ~2 s to close and holds the transfer engine's threads and ports, and a node's page and
state stores are two namespaces on one store, not two nodes. Clients close at interpreter exit
(or by ``close``). ``mooncake`` is imported here only, when the first client is made.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import socket
import threading
from typing import NamedTuple

import numpy as np

from tiered_kv.errors import ClientClosedError, StorageOpenError

# The codes the store answers with that these stores tell apart (Mooncake's ErrorCode).
OBJECT_NOT_FOUND = -704
BUFFER_OVERFLOW = -600  # the stored value is larger than the buffers given
TRANSFER_FAIL = -800  # also what a value shorter than the buffers given gets
CODE_NAMES = {
    -200: "NO_SPACE",
    -600: "BUFFER_OVERFLOW",
    -704: "OBJECT_NOT_FOUND",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
}


def code_name(code: int) -> str:
    return CODE_NAMES.get(code, f"code {code}")


class Connection(NamedTuple):
    """What identifies a client; the defaults are MooncakeStorage's."""

    master: str  # host:port of mooncake_master
    metadata_server: str = "P2PHANDSHAKE"  # no metadata server: clients handshake directly
    local_hostname: str = "127.0.0.1"  # the address other nodes reach this one's segments on
    protocol: str = "tcp"  # or rdma
    device_name: str = ""  # RDMA devices ("" for tcp)
    local_buffer_bytes: int = 16 << 20


class MooncakeClient:
    """Use ``shared`` rather than the constructor: one client per connection in a process."""

    _registry: dict[Connection, MooncakeClient] = {}
    _registry_lock = threading.Lock()

    def __init__(self, conn: Connection) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise StorageOpenError(
                f"the mooncake backend needs mooncake-transfer-engine-non-cuda ({exc}); "
                "`make install` installs it (and Debian's libibverbs1)"
            ) from None
        if _is_ip(conn.local_hostname):  # the TCP transport binds 0.0.0.0 unless told
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", conn.local_hostname)
        _reachable(conn.master)
        self.conn = conn
        self.raw = MooncakeDistributedStore()
        # No segment of its own here: each store lends what its budget says (``mount``).
        rc = self.raw.setup(
            conn.local_hostname,
            conn.metadata_server,
            0,
            conn.local_buffer_bytes,
            conn.protocol,
            conn.device_name,
            conn.master,
        )
        if rc != 0:
            self.raw.close()
            raise StorageOpenError(
                f"Mooncake Store client setup failed ({code_name(rc)}) for master={conn.master!r} "
                f"metadata_server={conn.metadata_server!r}: is mooncake_master running there "
                "(MooncakeMaster, or `mooncake_master --rpc_port=...`)?"
            )
        self._cond = threading.Condition()  # _closed, _busy and _regions
        self._register_lock = threading.Lock()
        self._regions: dict[tuple[int, int], np.ndarray] = {}
        self._busy = 0  # raw calls in flight: close waits for them
        self._closed = False

    @classmethod
    def shared(cls, conn: Connection) -> MooncakeClient:
        with cls._registry_lock:
            client = cls._registry.get(conn)
            if client is None:
                client = cls._registry[conn] = cls(conn)
            return client

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, method: str, *args: object) -> object:
        """``raw.<method>(*args)``; raises ``ClientClosedError`` once the client is closing
        (a closed ``MooncakeDistributedStore`` crashes the process on any call)."""
        with self._cond:
            if self._closed:
                raise ClientClosedError(f"the Mooncake client of {self.conn.master} is closed")
            self._busy += 1
        try:
            return getattr(self.raw, method)(*args)
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def register(self, region: np.ndarray) -> bool:
        """Register ``region`` (C-contiguous) for transfers once; it is kept alive, and so
        stays valid, until the client closes. False if the store refused (TCP transfers work
        unregistered; RDMA ones then fail, counted by the calls)."""
        key = (region.ctypes.data, region.nbytes)
        with self._register_lock:  # one registration of a region, not two racing
            with self._cond:
                if key in self._regions:
                    return True
            if self.call("register_buffer", *key) != 0:
                return False
            with self._cond:
                self._regions[key] = region
            return True

    def unregister(self, region: np.ndarray) -> None:
        """Forget a region ``register`` took (a transfer must not be using it)."""
        key = (region.ctypes.data, region.nbytes)
        with self._cond:
            known = self._regions.pop(key, None) is not None
        if known and not self._closed:
            self.call("unregister_buffer", key[0])

    def mount(self, nbytes: int) -> list[str]:
        """Lend ``nbytes`` of this process's memory to the store; the segment ids."""
        out = self.call("allocate_and_mount_segment", nbytes, self.conn.protocol)
        if out.get("ret", -1) != 0:
            raise StorageOpenError(
                f"Mooncake Store could not mount a segment of {nbytes} bytes "
                f"({code_name(out.get('ret', -1))}); is the master reachable?"
            )
        return list(out["segment_ids"])

    def unmount(self, segment_ids: list[str]) -> None:
        if segment_ids and not self._closed:
            self.call("unmount_and_free_segment", segment_ids)

    def close(self, wait_s: float = 30.0) -> None:
        """Close the connection (~2 s) and forget it, after the calls in flight (at most
        ``wait_s``); later calls raise ``ClientClosedError`` (stores count them as misses)."""
        with MooncakeClient._registry_lock:
            if MooncakeClient._registry.get(self.conn) is self:
                del MooncakeClient._registry[self.conn]
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.wait_for(lambda: self._busy == 0, timeout=wait_s)
            self._regions.clear()
        self.raw.close()


def _reachable(master: str, timeout_s: float = 2.0) -> None:
    """Refuse a master nobody listens on at once: the client's own setup retries for ~90 s."""
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return
    except OSError as exc:
        raise StorageOpenError(
            f"no Mooncake master answers at master={master!r} ({exc}); start mooncake_master "
            "there (`mooncake_master --rpc_port=PORT`) or give the master's host:port"
        ) from None


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@atexit.register
def _close_all() -> None:
    for client in list(MooncakeClient._registry.values()):
        client.close()
