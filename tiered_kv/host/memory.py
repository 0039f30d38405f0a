"""Host memory for a host pool: sizing, the availability check, faulting in, pinning and
release."""

from __future__ import annotations

import logging
import time

import psutil
import torch

from tiered_kv import platform
from tiered_kv.errors import (
    BackendUnavailableError,
    HostMemoryError,
    InvalidArgumentError,
    StateError,
)
from tiered_kv.hugepages import advise_huge_pages
from tiered_kv.prefault import prefault

GIB = 1 << 30
logger = logging.getLogger(__name__)


def default_reserve_bytes() -> int:
    """Memory left to everything else: 10% of RAM, at most 4 GiB."""
    return min(4 * GIB, psutil.virtual_memory().total // 10)


def host_tokens(
    *,
    page_size: int,
    bytes_per_token: int,
    device_tokens: int,
    size_tokens: int | None,
    size_bytes: int | None,
    ratio: float | None,
) -> tuple[int, str]:
    """Host tokens for exactly one of the three settings, in whole pages, and the setting's
    name. Tokens round up to a page; bytes and ratio round down (never above the budget)."""
    given = {
        k: v
        for k, v in (("size_tokens", size_tokens), ("size_bytes", size_bytes), ("ratio", ratio))
        if v is not None
    }
    if len(given) != 1:
        raise InvalidArgumentError(
            f"give exactly one of size_tokens, size_bytes, ratio; got {sorted(given) or 'none'}"
        )
    ((name, value),) = given.items()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidArgumentError(f"{name}={value!r} must be a positive number")
    if name == "size_tokens":
        if not isinstance(value, int):
            raise InvalidArgumentError(f"size_tokens={value!r} must be an int")
        tokens = -(-value // page_size) * page_size
    elif name == "size_bytes":
        tokens = int(value) // bytes_per_token // page_size * page_size
    else:
        tokens = int(device_tokens * float(value)) // page_size * page_size
    if tokens < page_size:
        raise InvalidArgumentError(
            f"{name}={value!r} gives {tokens} host tokens, less than one page of {page_size}; "
            f"raise {name}"
        )
    return tokens, name


def check_available(nbytes: int, reserve_bytes: int, setting: str) -> None:
    """Refuse an allocation that would eat into the reserve, saying how much and what to lower."""
    available = psutil.virtual_memory().available
    if nbytes > available - reserve_bytes:
        usable = max(0, available - reserve_bytes)
        raise HostMemoryError(
            f"host pool asks {nbytes / GIB:.2f} GiB but only {usable / GIB:.2f} GiB is available "
            f"({available / GIB:.2f} GiB free minus a {reserve_bytes / GIB:.2f} GiB reserve); "
            f"lower {setting} (or reserve_bytes)"
        )


class HostBuffer:
    """One host tensor, pinned by registration where CUDA exists (pageable otherwise).

    Allocate-then-register (rather than ``pin_memory=True``) so that ``destroy()`` returns the
    memory to the OS: the caching pinned allocator would keep it. Every page is faulted in when
    the buffer is built (``prefault``: ``warm_how``, ``warm_seconds``), so no copy on the serving
    path pays a first touch; the cost is logged at INFO."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool | None) -> None:
        want_pin = platform.cuda_available() if pin is None else bool(pin)
        if want_pin and not platform.cuda_available():
            raise BackendUnavailableError(
                "pin=True needs CUDA; this process has none (use pin=None)"
            )
        self.tensor: torch.Tensor | None = torch.empty(shape, dtype=dtype)
        self.huge_pages = advise_huge_pages(self.tensor)
        # Registering pins (and so faults in) every page: fault in here only where it will not.
        self.warm_how, self.warm_seconds = ("register", 0.0) if want_pin else prefault(self.tensor)
        if self.warm_how not in ("none", "register"):
            logger.info(
                "host buffer of %.1f MiB faulted in (%s) in %.1f ms",
                self.nbytes / (1 << 20), self.warm_how, self.warm_seconds * 1e3,
            )  # fmt: skip
        self.pinned = False
        if want_pin:
            cudart = torch.cuda.cudart()
            t = self.tensor
            began = time.perf_counter()
            rc = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            self.warm_seconds = time.perf_counter() - began
            if int(rc) != 0:
                self.tensor = None
                raise HostMemoryError(f"cudaHostRegister failed with code {int(rc)}")
            self.pinned = True

    def live(self) -> torch.Tensor:
        """The tensor; raises StateError once the buffer is destroyed."""
        if self.tensor is None:
            raise StateError("this host pool was destroyed")
        return self.tensor

    @property
    def nbytes(self) -> int:
        t = self.tensor
        return 0 if t is None else t.numel() * t.element_size()

    def destroy(self) -> None:
        """Unregister and drop the buffer. Views handed out before keep their memory alive."""
        if self.tensor is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
