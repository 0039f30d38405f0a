"""Host layouts: where the record of (token, layer) lives in a host pool's one buffer.

A record is every part of one token in one layer, concatenated (MHA: K then V; MLA: the latent),
``E`` elements of the store dtype. With ``T`` host tokens, ``L`` layers and pages of ``P``:

- ``layer_first``       ``(L, T, E)``: a layer's tokens are contiguous (like the device pool);
- ``page_first``        ``(T, L, E)``: a token's layers are contiguous, so a page is one block;
- ``page_first_direct`` ``(T/P, L, P, E)``: a page is one block and, inside it, each layer's
  page-worth of records is contiguous too.

Record (token h, layer l) starts at element ``(h // P) * s_page + (h % P) * s_token + l * s_layer``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import HostLayout  # the vocabulary lives in names; re-exported here


def parse_layout(value: str | HostLayout) -> HostLayout:
    try:
        return HostLayout(value)
    except ValueError:
        names = ", ".join(repr(x.value) for x in HostLayout)
        raise InvalidArgumentError(
            f"layout={value!r} is not a host layout; use one of {names}"
        ) from None


class RecordStrides(NamedTuple):
    page: int
    token: int
    layer: int


def buffer_shape(layout: HostLayout, layers: int, tokens: int, page: int, elems: int) -> tuple:
    if layout is HostLayout.LAYER_FIRST:
        return (layers, tokens, elems)
    if layout is HostLayout.PAGE_FIRST:
        return (tokens, layers, elems)
    return (tokens // page, layers, page, elems)


def record_strides(
    layout: HostLayout, layers: int, tokens: int, page: int, elems: int
) -> RecordStrides:
    if layout is HostLayout.LAYER_FIRST:
        return RecordStrides(page * elems, elems, tokens * elems)
    if layout is HostLayout.PAGE_FIRST:
        return RecordStrides(page * layers * elems, layers * elems, elems)
    return RecordStrides(layers * page * elems, elems, page * elems)


def token_offsets(strides: RecordStrides, page: int, host_tokens: torch.Tensor) -> torch.Tensor:
    """Element offsets of each token's record in layer 0; add ``layer * strides.layer``."""
    h = host_tokens.to(torch.int64)
    return (h // page) * strides.page + (h % page) * strides.token


def record_offsets(
    strides: RecordStrides, page: int, host_tokens: torch.Tensor, layers: list[int]
) -> torch.Tensor:
    """Element offsets of records (layer, token): shape ``(len(layers), n)``, int64."""
    # numpy, not torch: on a loaded 2-core machine torch's intra-op threads made this one
    # broadcast (32 layers x 4096 tokens) take 5-7 ms instead of well under one.
    h = host_tokens.numpy().astype(np.int64, copy=False)
    tokens = (h // page) * strides.page + (h % page) * strides.token
    layer_part = np.asarray(layers, dtype=np.int64) * strides.layer
    return torch.from_numpy(layer_part[:, None] + tokens[None, :])


def part_view(
    buffer: torch.Tensor, layout: HostLayout, offset: int, item_shape: tuple[int, ...]
) -> torch.Tensor:
    """A strided view of one part: ``(L, T, *item)``, or ``(L, T/P, P, *item)`` for
    ``page_first_direct`` (its pages cannot be merged into one token axis without a copy)."""
    elems = 1
    for s in item_shape:
        elems *= s
    part = buffer[..., offset : offset + elems].unflatten(-1, item_shape)
    if layout is HostLayout.LAYER_FIRST:
        return part
    if layout is HostLayout.PAGE_FIRST:
        return part.transpose(0, 1)
    return part.permute(1, 0, 2, *range(3, part.dim()))
