"""A failed check is a typed error with its place in the message, and scripts exit with it."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.bench import verify
from tiered_kv.errors import StateError, TransferError


def test_fail_raises_a_typed_error_naming_where():
    with pytest.raises(StateError, match=r"^CORRECTNESS FAILURE \[here\]: bytes differ$"):
        verify.fail("here", "bytes differ")
    with pytest.raises(TransferError):
        verify.fail("copy", "lost a row", TransferError)


def test_exit_on_failure_turns_only_check_failures_into_exits():
    with pytest.raises(SystemExit, match=r"CORRECTNESS FAILURE \[x\]"):
        with verify.exit_on_failure():
            verify.fail("x", "y")
    with pytest.raises(StateError, match="wrong order"):
        with verify.exit_on_failure():
            raise StateError("wrong order")


def test_int_view_and_first_bad_rows_compare_bits():
    a = torch.tensor([[1.0, float("nan")], [2.0, 3.0], [4.0, 5.0]])
    b = a.clone()
    assert verify.first_bad_rows(verify.int_view(a), verify.int_view(b)).tolist() == []
    b[2, 1] = 6.0
    assert verify.first_bad_rows(verify.int_view(a), verify.int_view(b)).tolist() == [2]
    assert verify.sentinel_for(torch.float16) == -1 and verify.sentinel_for(torch.uint8) == 255
