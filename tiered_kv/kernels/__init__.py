"""Kernels: each Triton kernel with a launcher and a torch reference of the same signature.

Callers take a backend's launchers here and call them without knowing which backend they got:
every backend of a launcher has the same signature. State a backend keeps between calls (the
native copier's block addresses) lives in a :class:`PlanCache` the caller passes and owns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from tiered_kv import platform
from tiered_kv.kernels import native_build
from tiered_kv.kernels.transfer_reference import PlanCache
from tiered_kv.platform import KernelBackend

__all__ = ["AllocKernels", "PlanCache", "TransferKernels", "alloc_kernels", "transfer_kernels"]


class AllocKernels(NamedTuple):
    """The two allocation launchers of one backend (same signatures for every backend)."""

    backend: KernelBackend
    alloc_extend: Callable[..., None]
    alloc_decode: Callable[..., None]


class TransferKernels(NamedTuple):
    """The page-transfer launcher of one backend (same signature for every backend;
    ``transfer_reference.transfer_rows`` states the contract)."""

    backend: KernelBackend
    transfer_rows: Callable[..., None]


def native_available() -> bool:
    """Whether the native block copier builds and loads in this process."""
    return native_build.error() is None


def transfer_kernels(
    device: torch.device, backend: str | KernelBackend | None = None
) -> TransferKernels:
    """The page-transfer launcher for device tensors on ``device``; chosen once here."""
    chosen = platform.kernel_backend(device, backend, native=native_build.error)
    if chosen is KernelBackend.TRITON:
        platform.import_triton()
        from tiered_kv.kernels import transfer_triton as impl
    elif chosen is KernelBackend.NATIVE:
        from tiered_kv.kernels import transfer_native as impl
    else:
        from tiered_kv.kernels import transfer_reference as impl
    return TransferKernels(chosen, impl.transfer_rows)


def alloc_kernels(device: torch.device, backend: str | KernelBackend | None = None) -> AllocKernels:
    """The allocation launchers for tensors on ``device``; the backend is chosen once here."""
    chosen = platform.kernel_backend(device, backend)
    if chosen is KernelBackend.TRITON:
        platform.import_triton()
        from tiered_kv.kernels import alloc_triton as impl
    else:
        from tiered_kv.kernels import alloc_reference as impl
    return AllocKernels(chosen, impl.alloc_extend, impl.alloc_decode)
