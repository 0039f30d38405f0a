"""The connector's host tier: a host buffer of whole pages, copied to and from vLLM's blocks by
tiered_kv's page-transfer launcher, and read and filled by the store as a ``PageSource``.

The buffer is ``[slots, layers, parts, row]`` in the KV dtype (a page's bytes are contiguous:
the store reads and fills them in place). A copy moves, for every chosen layer and part, one
row per block: ``rows[p][l][block]`` <-> slot ``s``'s record of layer ``l``, part ``p``. The
launcher is the one ``kernels.transfer_kernels`` picks for the device (the native block copier
on CPU, the Triton kernel on CUDA); it copies as integers, so every bit survives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.memory import HostBuffer, check_available, default_reserve_bytes
from tiered_kv.integrations.vllm.block_layout import BlockLayout
from tiered_kv.kernels import PlanCache, transfer_kernels
from tiered_kv.storage.contract import as_bytes_tensor


class HostPages:
    """``num_slots`` host pages shaped for ``layout``'s blocks."""

    page_bytes_zero_copy = True

    def __init__(self, layout: BlockLayout, num_slots: int) -> None:
        self.layout = layout
        self.page_nbytes = layout.page_nbytes
        check_available(num_slots * self.page_nbytes, default_reserve_bytes(), "host_bytes")
        shape = (num_slots, len(layout.layer_ids), layout.num_parts, layout.row_elems)
        self._buffer = HostBuffer(shape, layout.dtype, pin=None)
        self.buffer = self._buffer.live()
        self.num_pages = num_slots
        self.warm_seconds = self._buffer.warm_seconds  # faulted in when built (HostBuffer)
        device = layout.rows[0][0].device
        self._device, self._cuda = device, device.type == "cuda"
        self._launch = transfer_kernels(device).transfer_rows
        self._part_offsets = [p * layout.row_elems for p in range(layout.num_parts)]
        self._record = layout.num_parts * layout.row_elems  # elements per (slot, layer)

    # -- PageSource ------------------------------------------------------------------------
    def get_page_bytes(self, page: int) -> torch.Tensor:
        return self.buffer[page].view(-1).view(torch.uint8)

    def set_page_bytes(self, page: int, data: object) -> None:
        raw = as_bytes_tensor(data)
        if raw.numel() != self.page_nbytes:
            raise InvalidArgumentError(
                f"a page of {raw.numel()} bytes for host pages of {self.page_nbytes} bytes"
            )
        self.get_page_bytes(page).copy_(raw)

    def page_bytes_rows(self) -> np.ndarray:
        return self.buffer.view(self.num_pages, -1).view(torch.uint8).numpy()

    # -- copies ----------------------------------------------------------------------------
    def plan(self, blocks: Sequence[int], slots: Sequence[int]) -> tuple:
        """The index tensors of a copy between ``blocks`` and ``slots`` (pairs in order),
        checked; reuse the result (and one ``PlanCache``) for every layer of one copy."""
        if len(blocks) != len(slots):
            raise InvalidArgumentError(f"{len(blocks)} blocks but {len(slots)} host slots")
        num_blocks = self.layout.num_blocks
        bad = [b for b in blocks if not 0 <= b < num_blocks]
        if bad:
            raise InvalidArgumentError(f"blocks {bad[:8]} are outside 0..{num_blocks - 1}")
        bad = [s for s in slots if not 0 <= s < self.num_pages]
        if bad:
            raise InvalidArgumentError(f"host slots {bad[:8]} are outside 0..{self.num_pages - 1}")
        layers = len(self.layout.layer_ids)
        # Plain tensors even under vLLM's inference mode: the launcher's plan cache reads their
        # version counters, which inference tensors do not keep.
        with torch.inference_mode(False):
            dev = torch.tensor(list(blocks), dtype=torch.int64)
            slot = torch.tensor(list(slots), dtype=torch.int64)
            offsets = (slot[None, :] * layers + torch.arange(layers)[:, None]) * self._record
            return dev, offsets.contiguous(), PlanCache()

    def copy(self, plan: tuple, to_host: bool, layers: Sequence[int] | None = None) -> None:
        """Copy the planned blocks' ``layers`` (positions in the layout; None: all) to their
        host slots (``to_host``) or back. Synchronous: the bytes are in place on return."""
        dev, offsets, cache = plan
        if dev.numel() == 0:
            return
        self._launch(
            self.layout.rows,
            self.buffer,
            dev,
            offsets,
            self._part_offsets,
            to_host,
            layers=layers,
            plan_cache=cache,
        )
        if self._cuda:
            # Hazard: a kernel's copy is queued on the stream; the host slot (read by the store,
            # named for loads) or the block (read by attention) is used once this returns.
            torch.cuda.current_stream(self._device).synchronize()

    def destroy(self) -> None:
        self._buffer.destroy()
