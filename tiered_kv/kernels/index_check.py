"""Index checks of copy-engine jobs in C (``native/index_check.c``): ranges and repeats of a
transfer's index pair in one pass each, and each host token's record offset."""

from __future__ import annotations

import threading

import numpy as np
import torch

from tiered_kv.kernels.engine_lib import lib


class IndexCheck:
    """Validates a transfer's index pairs in C (ranges and repeats, one pass each) and computes
    the host tokens' record offsets; keeps the two zeroed bitmaps it needs. Thread-safe."""

    def __init__(self, host_size: int, dev_high: int) -> None:
        self._lib = lib()
        self._host_seen = np.zeros((host_size + 7) // 8, dtype=np.uint8)
        self._dev_seen = np.zeros((dev_high + 7) // 8, dtype=np.uint8)
        self.host_size, self.dev_high = host_size, dev_high
        self._seen_addr = (self._host_seen.ctypes.data, self._dev_seen.ctypes.data)
        self._lock = threading.Lock()

    def offsets(
        self,
        host: torch.Tensor,
        dev: torch.Tensor,
        dev_low: int,
        page: int,
        s_page: int,
        s_token: int,
        elt: int,
    ) -> tuple[torch.Tensor, int]:
        """(byte offset of each host token's layer-0 record, -1), or (anything, 0) when a host
        value is out of range or repeated, (anything, 1) for a device value. ``host`` and
        ``dev``: contiguous int64 CPU tensors of one length."""
        tok = torch.empty(host.shape[0], dtype=torch.int64)
        with self._lock:
            bad = self._lib.tkv_rows_prepare(
                host.data_ptr(),
                dev.data_ptr(),
                host.shape[0],
                self.host_size,
                dev_low,
                self.dev_high,
                self._seen_addr[0],
                self._seen_addr[1],
                page,
                s_page,
                s_token,
                elt,
                tok.data_ptr(),
            )
        return tok, int(bad)
