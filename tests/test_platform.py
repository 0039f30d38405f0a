"""platform.py: the kernel path and device are chosen once, with overrides for tests."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tiered_kv import BackendUnavailableError, InvalidArgumentError, platform
from tiered_kv.device import PagedTokenToKVPoolAllocator
from tiered_kv.platform import KernelBackend

CPU = torch.device("cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_import_is_lazy_about_triton():
    code = "import sys, tiered_kv, tiered_kv.device; print('triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@no_cuda
def test_auto_picks_torch_on_cpu_and_triton_runs_interpreted(monkeypatch):
    monkeypatch.delenv(platform.ENV_KERNEL_BACKEND, raising=False)
    assert platform.kernel_backend(CPU) is KernelBackend.TORCH
    assert platform.triton_runs_on(CPU) and platform.triton_interpreted()
    assert platform.kernel_backend(CPU, "triton") is KernelBackend.TRITON


def test_override_and_environment(monkeypatch):
    with platform.use_kernel_backend("triton"):
        alloc = PagedTokenToKVPoolAllocator(64, 16, torch.float16, "cpu")
        assert alloc.kernel_backend is KernelBackend.TRITON
        # An explicit request beats the override.
        assert platform.kernel_backend(CPU, "torch") is KernelBackend.TORCH
    monkeypatch.setenv(platform.ENV_KERNEL_BACKEND, "torch")
    assert platform.kernel_backend(CPU) is KernelBackend.TORCH
    monkeypatch.setenv(platform.ENV_KERNEL_BACKEND, "tpu")
    with pytest.raises(InvalidArgumentError, match="TIERED_KV_KERNEL_BACKEND='tpu'"):
        platform.kernel_backend(CPU)


@no_cuda
def test_devices_this_process_lacks_are_refused(monkeypatch):
    with pytest.raises(BackendUnavailableError, match="CUDA is not available"):
        platform.resolve_device("cuda")
    with pytest.raises(InvalidArgumentError, match="'nonsense' is not a torch device"):
        platform.resolve_device("nonsense")
    monkeypatch.setenv(platform.ENV_DEVICE, "cpu")
    assert platform.default_device() == CPU
