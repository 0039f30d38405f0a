"""HostPoolGroup: every host pool a device pool declares, moved and stored as one.

A device pool that owns several kinds of bytes per token (DSA: the latent and the indexer's
keys) declares one host pool per kind. The group builds them all with one shared slot allocator,
so a host slot (and page) is the same slot of every member: backing a page up copies every
member's part of it, loading a layer copies every member that holds that layer, and a page's
bytes, as the storage tier reads and writes them, are every member's part of the page one after
the other. One storage value per page therefore holds every declared part under one checksum: a
page whose parts cannot all be read and verified is a miss as a whole, never a page with one
part stale.

``decl`` summarizes the group for the transfer worker and the storage namespace: the owner, the
union of the members' layer ids, and every member's parts named ``member.part`` with their
dtypes and layers written into the namespace, so a group's pages never share a namespace with a
single pool's (or another group's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tiered_kv.device.allocator.base import BaseTokenToKVPoolAllocator
from tiered_kv.device.pool_decl import HostPart, HostPoolDecl
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.host_kv_cache import HostKVCache, host_pool_for


class HostPoolGroup:
    def __init__(
        self,
        decls: Sequence[HostPoolDecl],
        device_allocator: BaseTokenToKVPoolAllocator,
        *,
        size_tokens: int,
        **kwargs: Any,
    ) -> None:
        decls = tuple(decls)
        if len(decls) < 2:
            raise InvalidArgumentError(
                f"a host pool group needs 2 or more declarations, got {len(decls)}; use "
                "host_pool_for for one"
            )
        owner = device_allocator.get_kvcache()
        page = decls[0].page_size
        # A composite pool's allocator routes each declaration to the sub-allocator of its
        # sub-pool and to the translation of the job's device slots into that sub-pool's.
        route = getattr(device_allocator, "host_part_route", None)
        routes = [route(d) if route is not None else (device_allocator, None) for d in decls]
        for d in decls:
            if d.page_size != page or (route is None and d.device_pool is not owner):
                raise InvalidArgumentError(
                    f"declaration {d.name!r} belongs to another device pool or page size; a "
                    "group holds one owner's declarations"
                )
        if len({d.name for d in decls}) != len(decls):
            raise InvalidArgumentError(f"declaration names {[d.name for d in decls]} repeat")
        self.members: tuple[HostKVCache, ...] = ()
        built: list[HostKVCache] = []
        try:
            for d, (sub, _) in zip(decls, routes, strict=True):
                built.append(host_pool_for(d, sub, size_tokens=size_tokens, **kwargs))
        except BaseException:
            for m in built:
                m.destroy()
            raise
        self.members = tuple(built)
        self._translate = tuple(t for _, t in routes)
        self._memo: tuple | None = None
        # What the routes read (a table) changes with this; without it nothing is kept.
        self._route_version = getattr(device_allocator, "host_route_version", None)
        self.allocator = built[0].allocator
        for m in built[1:]:
            m.allocator = self.allocator  # one slot space: a slot is the same in every member
        self.page_size, self.size = page, built[0].size
        self.num_pages, self.layout = built[0].num_pages, built[0].layout
        self.decl = _group_decl(decls, owner, page)

    def _parts(self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor):
        """(member, its device pool, host slots, device slots in that pool) for every member
        holding part of the job. A member whose route translates a token to no slot (<= 0: a
        sliding-window token whose window KV was freed) skips that token: its host part of the
        token is neither written nor read (the tree marks such pages windowless). The result is
        kept while the same, unmodified index tensors come again and the routes' table has not
        changed (every layer of one load, while nothing is allocated or freed meanwhile)."""
        if device_pool is not self.decl.device_pool:
            raise InvalidArgumentError("device_pool is not the pool this group mirrors")
        memo, route = self._memo, self._route_version
        versions = (
            host_indices._version,
            device_indices._version,
            route() if route is not None else None,
        )
        if (
            memo is not None
            and route is not None
            and memo[0] is host_indices
            and memo[1] is device_indices
            and memo[2] == versions
        ):
            return memo[3]
        parts = []
        for m, translate in zip(self.members, self._translate, strict=True):
            host, idx = host_indices, device_indices
            if translate is not None:
                idx = translate(device_indices)
                keep = idx > 0
                if not bool(keep.all()):
                    host, idx = host_indices[keep.to(host_indices.device)], idx[keep]
            parts.append((m, m.decl.device_pool, host, idx))
        self._memo = (host_indices, device_indices, versions, parts)
        return parts

    # -- slots ----------------------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        return self.allocator.alloc(need_size)

    def free(self, indices: torch.Tensor) -> None:
        self.allocator.free(indices)

    def available_size(self) -> int:
        return self.allocator.available_size()

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    def destroy(self) -> None:
        for m in self.members:
            m.destroy()

    # -- transfers ------------------------------------------------------------------------------
    def backup_from_device_all_layer(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None:  # fmt: skip
        """Every member's part of ``device_indices`` into ``host_indices``."""
        for m, pool, host, idx in self._parts(device_pool, host_indices, device_indices):
            if idx.numel():
                m.backup_from_device_all_layer(pool, host, idx, io_backend)

    def load_to_device_per_layer(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
        layer_id: int, io_backend: str = "kernel",
    ) -> None:  # fmt: skip
        """Layer ``layer_id`` of every member that holds it."""
        parts = self._parts(device_pool, host_indices, device_indices)
        held = [p for p in parts if layer_id in p[0].decl.layer_ids]
        if not held:
            raise InvalidArgumentError(
                f"layer_id={layer_id!r} is held by no member; layers are "
                f"{list(self.decl.layer_ids)}"
            )
        for m, pool, host, idx in held:
            if idx.numel():
                m.load_to_device_per_layer(pool, host, idx, layer_id, io_backend)

    def load_to_device_all_layer(
        self, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
        io_backend: str = "kernel",
    ) -> None:  # fmt: skip
        for m, pool, host, idx in self._parts(device_pool, host_indices, device_indices):
            if idx.numel():
                m.load_to_device_all_layer(pool, host, idx, io_backend)

    # -- pages as bytes -------------------------------------------------------------------------
    @property
    def page_nbytes(self) -> int:
        return sum(m.page_nbytes for m in self.members)

    page_bytes_zero_copy = False

    def page_bytes_rows(self) -> None:
        """No zero-copy rows: a group's page is spread over its members' buffers."""
        return None

    def get_page_bytes(self, page: int) -> torch.Tensor:
        """Host page ``page`` as one flat uint8 copy: every member's part, in member order."""
        return torch.cat([m.get_page_bytes(page).reshape(-1) for m in self.members])

    def set_page_bytes(self, page: int, data: Any) -> None:
        """Fill host page ``page`` of every member from ``page_nbytes`` bytes (the format of
        ``get_page_bytes``); nothing changes when the size is wrong."""
        if isinstance(data, torch.Tensor):
            flat = data.reshape(-1).view(torch.uint8)
        else:
            flat = memoryview(data).cast("B")
        n = flat.numel() if isinstance(flat, torch.Tensor) else flat.nbytes
        if n != self.page_nbytes:
            raise InvalidArgumentError(
                f"page data has {n} bytes; a page of this group has {self.page_nbytes}"
            )
        off = 0
        for m in self.members:
            m.set_page_bytes(page, flat[off : off + m.page_nbytes])
            off += m.page_nbytes


def _group_decl(decls: tuple[HostPoolDecl, ...], owner: Any, page: int) -> HostPoolDecl:
    parts = tuple(
        HostPart(
            f"{d.name}.{p.name}.{d.kind}.{d.dtype}.L{list(d.layer_ids)}", p.item_shape, p.buffer
        )
        for d in decls
        for p in d.parts
    )
    return HostPoolDecl(
        name="+".join(d.name for d in decls),
        kind="group",
        device_pool=owner,
        parts=parts,
        dtype=torch.uint8,
        layer_ids=tuple(sorted({i for d in decls for i in d.layer_ids})),
        page_size=page,
        num_slots=max(d.num_slots for d in decls),
    )
