"""HostStatePool: host snapshots of per-request recurrent state, built from StatePoolDecls.

A host *state slot* holds one device slot of every declared pool at once (every part of every
declaration), so a snapshot restored later never mixes parts taken at different moments. Bytes
are kept as uint8, whatever the part's dtype, and copied bit-exactly:

- ``page_first`` / ``page_first_direct``: one ``(num_slots, slot_nbytes)`` buffer; a slot's
  bytes are contiguous, parts in declaration order (so storage reads and writes are views);
- ``layer_first``: one ``(num_slots, part_nbytes)`` buffer per part (a slot's bytes are
  gathered into one copy for storage).

To the storage tier a slot is a page (``page_size`` 1): the pool is a
:class:`~tiered_kv.storage.contract.PageSource`, with its own :meth:`namespace`, keyed by
``storage.keys.state_keys_of``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from tiered_kv._checks import check_index_tensor, check_positive_int, check_range
from tiered_kv.device.state_decl import StatePart, StatePoolDecl
from tiered_kv.errors import InvalidArgumentError, OwnershipError
from tiered_kv.host.allocator import HostSlotAllocator
from tiered_kv.host.layout import parse_layout
from tiered_kv.host.memory import HostBuffer, check_available, default_reserve_bytes
from tiered_kv.names import HostLayout
from tiered_kv.storage.keys import StorageNamespace


class HostStatePool:
    """Host state slots ``0 .. num_slots - 1`` for the declarations ``decls`` (taken together).

    Not locked: slot bookkeeping (``alloc`` / ``free``) is thread-safe, but two transfers that
    touch the same slots must not run at once; the caller orders them."""

    def __init__(
        self,
        decls: Sequence[StatePoolDecl],
        num_slots: int,
        *,
        layout: HostLayout | str = "page_first",
        pin: bool | None = False,
        reserve_bytes: int | None = None,
    ) -> None:
        decls = tuple(decls)
        if not decls or not all(isinstance(d, StatePoolDecl) for d in decls):
            raise InvalidArgumentError(
                "decls must be a non-empty sequence of StatePoolDecl (from the state owners)"
            )
        names = [d.name for d in decls]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"declaration names {names} repeat; each must be unique")
        for d in decls:
            _check_decl(d)
        self.decls = decls
        self.num_slots = check_positive_int("num_slots", num_slots)
        self.layout = parse_layout(layout)
        self.parts: tuple[StatePart, ...] = tuple(p for d in decls for p in d.parts)
        self.slot_nbytes = sum(p.nbytes for p in self.parts)
        # Device rows every declaration has; row 0 is padding in each.
        self.num_device_rows = min(d.num_rows for d in decls)
        reserve = default_reserve_bytes() if reserve_bytes is None else reserve_bytes
        check_positive_int("reserve_bytes", reserve, minimum=0)
        check_available(self.num_slots * self.slot_nbytes, reserve, "num_slots")
        if self.layout.token_major:
            self._buffers = [HostBuffer((self.num_slots, self.slot_nbytes), torch.uint8, pin)]
        else:
            self._buffers = []
            for p in self.parts:
                try:
                    self._buffers.append(HostBuffer((self.num_slots, p.nbytes), torch.uint8, pin))
                except Exception:
                    self.destroy()  # the buffers made so far: no half-pinned pool left behind
                    raise
        self.allocator = HostSlotAllocator(self.num_slots, 1)

    # -- state ------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Host bytes held (0 once destroyed)."""
        return sum(b.nbytes for b in self._buffers)

    @property
    def pinned(self) -> bool:
        return bool(self._buffers) and all(b.pinned for b in self._buffers)

    def destroy(self) -> None:
        """Unregister and drop the buffers. Later transfers and page reads raise StateError."""
        for b in self._buffers:
            b.destroy()

    def _part_views(self) -> list[torch.Tensor]:
        """Per part, its ``(num_slots, part_nbytes)`` uint8 host view (strided in page_first)."""
        if not self.layout.token_major:
            return [b.live() for b in self._buffers]
        buf, out, off = self._buffers[0].live(), [], 0
        for p in self.parts:
            out.append(buf[:, off : off + p.nbytes])
            off += p.nbytes
        return out

    # -- slots ------------------------------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` free host slots (int64), or None when fewer are free. Thread-safe."""
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        """Return host slots; OwnershipError (nothing freed) on a repeat or a slot not held."""
        self.allocator.free(slots)

    def available_size(self) -> int:
        return self.allocator.available_size()

    # -- transfers --------------------------------------------------------------------------
    def backup_from_device(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Snapshot device slot ``device_slots[i]`` of every declared part into host slot
        ``host_slots[i]``. Mutates those host slots only; synchronous (on CUDA it runs on the
        current stream and returns after the copies landed). Validates everything first."""
        dev, host = self._check_pair(device_slots, host_slots, to_host=True)
        if not dev.numel():
            return
        # One plain copy per slot and part: a row of a part view is contiguous, where an
        # index_put of whole rows into the (strided) view goes byte by byte, ~10x slower for a
        # state of tens of MiB (a hybrid snapshot per finished request).
        pairs = list(zip(dev.tolist(), host.tolist(), strict=True))
        for part, view in zip(self.parts, self._part_views(), strict=True):
            buf = part.buffer()
            for d, h in pairs:
                view[h].copy_(_row_bytes(buf[d]))

    def load_to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Restore host slot ``host_slots[i]`` into device slot ``device_slots[i]`` of every
        declared part. Mutates those device rows only. The host reads are done on return (the
        slots may be freed); on CUDA the device writes are queued on the current stream. A host
        slot may be loaded into several device slots (two requests resuming from one snapshot)."""
        dev, host = self._check_pair(device_slots, host_slots, to_host=False)
        if not dev.numel():
            return
        pairs = list(zip(dev.tolist(), host.tolist(), strict=True))
        for part, view in zip(self.parts, self._part_views(), strict=True):
            buf = part.buffer()
            for d, h in pairs:  # per slot, as in ``backup_from_device``
                row = buf[d]
                if row.is_contiguous():
                    row.view(-1).view(torch.uint8).copy_(view[h])
                else:
                    src = view[h].to(buf.device, copy=True)  # a fresh copy: offset 0
                    row.copy_(src.view(part.dtype).view(part.slot_shape))

    def _check_pair(
        self, device_slots: torch.Tensor, host_slots: torch.Tensor, *, to_host: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both index tensors as CPU int64 once every check passed: equal lengths, host slots
        in range and allocated, device slots in ``1 .. num_device_rows - 1``, no repeated
        destination, and every owner buffer still ``(num_rows, *slot_shape)`` of its dtype."""
        check_index_tensor("device_slots", device_slots, None)
        check_index_tensor("host_slots", host_slots, None)
        if device_slots.numel() != host_slots.numel():
            raise InvalidArgumentError(
                f"{device_slots.numel()} device slots but {host_slots.numel()} host slots; "
                "they pair up one to one"
            )
        dev = device_slots.detach().to("cpu", torch.int64)
        host = host_slots.detach().to("cpu", torch.int64)
        check_range("host_slots", host, 0, self.num_slots)
        check_range("device_slots", dev, 0, self.num_device_rows)
        if (dev == 0).any():
            raise OwnershipError(
                "device_slots include row 0, the padding row of every state pool; use slots "
                f"1..{self.num_device_rows - 1}"
            )
        dst_name, dst = ("host_slots", host) if to_host else ("device_slots", dev)
        uniq, counts = torch.unique(dst, return_counts=True)
        if (counts > 1).any():
            raise InvalidArgumentError(
                f"{dst_name} repeat {uniq[counts > 1][:8].tolist()}; each destination slot "
                "may be written once per call"
            )
        held = self.allocator.is_allocated(host)
        if not held.all():
            raise OwnershipError(
                f"host slots {host[~held][:8].tolist()} are not allocated (never allocated, or "
                "freed already); alloc() them first"
            )
        for d in self.decls:
            for p in d.parts:
                _check_buffer(d, p)
        self._part_views()  # raises StateError once destroyed
        return dev, host

    # -- slots as pages (storage tier) ------------------------------------------------------
    @property
    def page_nbytes(self) -> int:
        """Bytes of one stored value: one slot, every part in declaration order."""
        return self.slot_nbytes

    @property
    def num_pages(self) -> int:
        return self.num_slots

    @property
    def page_bytes_zero_copy(self) -> bool:
        """Whether ``get_page_bytes`` returns a view (page_first layouts) rather than a copy."""
        return self.layout.token_major

    def page_bytes_rows(self) -> np.ndarray | None:
        """Every slot's bytes as a ``(num_slots, slot_nbytes)`` uint8 numpy view (page_first
        layouts), None in layer_first. Valid until the pool is destroyed: take it per batch."""
        if not self.layout.token_major:
            return None
        return self._buffers[0].live().numpy()

    def get_page_bytes(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s bytes as a flat uint8 tensor: a view in the page_first layouts (valid
        until the slot is overwritten or the pool destroyed), a copy in layer_first."""
        slot = self._check_slot(slot)
        if self.layout.token_major:
            return self._buffers[0].live()[slot]
        return torch.cat([v[slot] for v in self._part_views()])

    def set_page_bytes(
        self, slot: int, data: bytes | bytearray | memoryview | torch.Tensor
    ) -> None:
        """Fill slot ``slot`` from exactly ``page_nbytes`` bytes (the format ``get_page_bytes``
        returns); nothing changes on error."""
        slot = self._check_slot(slot)
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8:
                raise InvalidArgumentError(f"slot data tensor has dtype {data.dtype}; want uint8")
            src = data.reshape(-1)
        else:
            view = memoryview(data).cast("B")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer is only read
                src = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else None
        n = 0 if src is None else src.numel()
        if n != self.slot_nbytes:
            raise InvalidArgumentError(
                f"slot data has {n} bytes; a slot of this pool has exactly {self.slot_nbytes}"
            )
        if self.layout.token_major:
            self._buffers[0].live()[slot].copy_(src)
            return
        off = 0
        for p, v in zip(self.parts, self._part_views(), strict=True):
            v[slot].copy_(src[off : off + p.nbytes])
            off += p.nbytes

    def _check_slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise InvalidArgumentError(f"slot={slot!r} must be an int")
        if not 0 <= slot < self.num_slots:
            raise InvalidArgumentError(
                f"slot={slot} is not a host state slot; valid slots are 0..{self.num_slots - 1}"
            )
        return int(slot)

    def namespace(
        self, *, model: str, tenant: str | None = None, rank: str | None = None
    ) -> StorageNamespace:
        """The storage namespace of these snapshots: every part's declaration, name, dtype and
        shape, the host layout and ``model`` (see ``StorageNamespace.create``). Its own kind
        (``state``), so state values never share a namespace with KV pages."""
        return StorageNamespace.create(
            kind="state",
            parts=[
                (f"{d.name}.{p.name}.{p.dtype}", p.slot_shape) for d in self.decls for p in d.parts
            ],
            dtype=torch.uint8,
            layer_ids=[],
            page_size=1,
            layout=self.layout.value,
            tenant=tenant,
            model=model,
            rank=rank,
        )


def _check_decl(d: StatePoolDecl) -> None:
    if not d.parts:
        raise InvalidArgumentError(f"state pool {d.name!r} declares no parts")
    names = [p.name for p in d.parts]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"state pool {d.name!r} has repeated part names {names}")
    if isinstance(d.num_rows, bool) or not isinstance(d.num_rows, int) or d.num_rows < 2:
        raise InvalidArgumentError(
            f"state pool {d.name!r} has num_rows={d.num_rows!r}; it needs >= 2 (row 0 is padding)"
        )
    for p in d.parts:
        if p.nbytes < 1:
            raise InvalidArgumentError(
                f"part {d.name}.{p.name} has slot_shape {p.slot_shape}: 0 bytes; drop it"
            )
        _check_buffer(d, p)


def _check_buffer(d: StatePoolDecl, p: StatePart) -> None:
    buf = p.buffer()
    want = (d.num_rows, *p.slot_shape)
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != want or buf.dtype != p.dtype:
        got = (tuple(buf.shape), buf.dtype) if isinstance(buf, torch.Tensor) else type(buf)
        raise InvalidArgumentError(
            f"part {d.name}.{p.name}: the owner's buffer is {got}; its declaration says "
            f"{want}, {p.dtype}"
        )


def _row_bytes(row: torch.Tensor) -> torch.Tensor:
    """One device slot's bytes as a flat uint8 tensor (a copy only where not contiguous)."""
    return row.contiguous().view(-1).view(torch.uint8)
