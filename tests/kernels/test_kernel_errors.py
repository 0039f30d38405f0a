"""Kernel errors come from the TieredKVError family and name the value and what would work."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.kernels._transfer_util import make_transfer
from tiered_kv import platform
from tiered_kv.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    TieredKVError,
    TransferError,
)
from tiered_kv.kernels import alloc_kernels, native_build, transfer_kernels, transfer_native

CPU = torch.device("cpu")
KERNELS = Path(native_build.__file__).parent


def test_no_bare_value_or_runtime_error_is_raised_in_kernels():
    bare = []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in ("ValueError", "RuntimeError"):
                    bare.append(f"{path.name}:{node.lineno}")
    assert bare == []


class _RefusingLib:
    """Stands in for the compiled copier: refuses every call as bad arguments do (rc -1)."""

    @staticmethod
    def tkv_copy_blocks(*args):
        return -1


def test_a_refused_native_copy_raises_transfer_error(gen, monkeypatch):
    monkeypatch.setattr(native_build, "load", lambda: _RefusingLib())
    t = make_transfer(gen, n=7)
    with pytest.raises(TransferError) as info:
        t.run(transfer_native.transfer_rows, True, layers=[1])
    msg = str(info.value)
    # 7 tokens x 2 parts in one layer; blocks of 3*10 and 3*6 fp16 elements.
    assert "rc=-1" in msg and "14 blocks" in msg and "[60, 36]" in msg, msg
    assert "at least 1 thread" in msg, msg
    assert isinstance(info.value, TieredKVError)


def test_native_copier_missing_raises_backend_unavailable(gen, monkeypatch):
    monkeypatch.setattr(native_build, "load", lambda: None)
    monkeypatch.setattr(native_build, "error", lambda: "native block copier unavailable: x")
    t = make_transfer(gen, n=3)
    with pytest.raises(BackendUnavailableError, match="unavailable: x; use kernel_backend='torch'"):
        t.run(transfer_native.transfer_rows, False)


def test_no_compiler_raises_backend_unavailable(tmp_path, monkeypatch):
    monkeypatch.setattr(native_build, "_compiler", lambda: None)
    with pytest.raises(BackendUnavailableError, match="no C compiler found.*set CC"):
        native_build._build(tmp_path / "copy_blocks.so")


def test_a_failing_compiler_is_named_with_its_exit_code(tmp_path, monkeypatch):
    monkeypatch.setattr(native_build, "_compiler", lambda: "false")
    with pytest.raises(BackendUnavailableError) as info:
        native_build._build(tmp_path / "copy_blocks.so")
    msg = str(info.value)
    assert msg.startswith("false -O3") and "exit code 1" in msg and "set CC" in msg, msg
    assert not (tmp_path / "copy_blocks.so").exists()


def test_copy_rows_with_unequal_offsets_raises_invalid_argument():
    transfer_kernels(CPU, "triton")  # imports Triton (interpreted here) the supported way
    from tiered_kv.kernels import transfer_triton

    src, dst = torch.zeros(40, dtype=torch.int16), torch.zeros(40, dtype=torch.int16)
    five, three = torch.arange(5) * 4, torch.arange(3) * 4
    with pytest.raises(InvalidArgumentError, match="5 torch.int64 entries and dst_off 3"):
        transfer_triton.copy_rows(src, five, dst, three, 4)
    with pytest.raises(InvalidArgumentError, match="src_off has 5 torch.int32"):
        transfer_triton.copy_rows(src, five.to(torch.int32), dst, five, 4)
    assert torch.count_nonzero(dst) == 0


def test_alloc_launchers_name_the_bad_vector():
    kernels = alloc_kernels(CPU, "triton")
    assert kernels.backend is platform.KernelBackend.TRITON
    seq = torch.tensor([5, 9, 2])
    last = torch.tensor([4, 8, 1])
    pages = torch.arange(1, 9)
    bad_last = r"last_loc must be .* length 3, got shape \(2,\)"
    with pytest.raises(InvalidArgumentError, match=bad_last):
        kernels.alloc_decode(seq, last[:2], pages, torch.empty(3, dtype=torch.int64), 4)
    out = torch.empty(7, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match="out_indices must be contiguous int64, got "):
        kernels.alloc_extend(torch.zeros(3, dtype=torch.int64), seq, last, pages, out, 4)
