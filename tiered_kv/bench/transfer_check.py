"""The untimed check of a device <-> host configuration: the bytes arrive, bit for bit.

``verify_transfer`` runs a backup and a layer-wise load on a draw of its own: after the backup a
sample of tokens read through ``host.part_view`` (every part and layer) must equal the device
rows; after loading the first layer the last layer's destination rows must be untouched; after
every layer the destination rows must equal the source rows (every token, part and layer).
A mismatch or an exception is a ``verify.fail`` with ``TransferError``.
"""

from __future__ import annotations

import traceback

import torch

from tiered_kv.bench.transfer import Draw, TransferCase, draw
from tiered_kv.bench.verify import CHECK_FAILED, fail, first_bad_rows, int_view, sentinel_for
from tiered_kv.device.pool_decl import HostPoolDecl
from tiered_kv.errors import TransferError
from tiered_kv.host import HostKVCache, HostLayout

VERIFY_SAMPLE_TOKENS = 256


def check_host_sample(
    where: str, host: HostKVCache, d: Draw, gen: torch.Generator, decl: HostPoolDecl
) -> int:
    """A sample of backed-up tokens, read through ``part_view``, equals the device rows.
    Returns the number of tokens compared."""
    page = host.page_size
    n = d.host.numel()
    pos = torch.randperm(n, generator=gen)[: min(n, VERIFY_SAMPLE_TOKENS)]
    h = d.host[pos]
    dev_rows = d.dev_src[pos]
    for part in decl.parts:
        view = int_view(host.part_view(part.name))
        got = (
            view[:, h // page, h % page]
            if host.layout is HostLayout.PAGE_FIRST_DIRECT
            else view[:, h]
        )
        for layer in range(decl.layer_num):
            want = int_view(part.buffer(layer))[dev_rows].cpu()
            bad = first_bad_rows(got[layer], want)
            if bad.numel():
                i = int(bad[0])
                fail(
                    where,
                    f"backup: part {part.name!r} layer {layer}: host slot {int(h[i])} does not "
                    f"hold device slot {int(dev_rows[i])} ({bad.numel()} of {pos.numel()} "
                    "sampled tokens differ)",
                    TransferError,
                )
    return int(pos.numel())


def check_device_rows(
    where: str, what: str, decl: HostPoolDecl, layers: range, d: Draw, sentinel: int | None
) -> None:
    """Destination rows equal the source rows (or, with ``sentinel``, still hold it)."""
    for part in decl.parts:
        for layer in layers:
            buf = int_view(part.buffer(layer))
            got = buf[d.dev_dst]
            want = torch.full_like(got, sentinel) if sentinel is not None else buf[d.dev_src]
            bad = first_bad_rows(got, want)
            if bad.numel():
                i = int(bad[0])
                expected = (
                    "the sentinel (it must be untouched)"
                    if sentinel is not None
                    else f"the bytes of device slot {int(d.dev_src[i])} (host slot "
                    f"{int(d.host[i])})"
                )
                fail(
                    where,
                    f"{what}: part {part.name!r} layer {layer}: device slot {int(d.dev_dst[i])} "
                    f"does not hold {expected}; {bad.numel()} of {d.dev_dst.numel()} tokens "
                    "differ",
                    TransferError,
                )


def verify_transfer(where: str, case: TransferCase, gen: torch.Generator) -> int:
    """Backup, then a layer-wise load into other device slots, on one draw; ``fail`` on a
    mismatch. Returns the number of host tokens compared after the backup. Overwrites the
    draw's destination rows of the device pool (with a sentinel, then the loaded bytes)."""
    pool, decl, host, io = case.pool, case.decl, case.host, case.io_backend
    d = draw(gen, case.alloc, host, case.tokens)
    sentinel = sentinel_for(decl.dtype)
    for part in decl.parts:
        for layer in range(decl.layer_num):
            int_view(part.buffer(layer))[d.dev_dst] = sentinel
    try:
        host.backup_from_device_all_layer(pool, d.host, d.dev_src, io)
        sampled = check_host_sample(where, host, d, gen, decl)
        layer_ids = decl.layer_ids
        host.load_to_device_per_layer(pool, d.host, d.dev_dst, layer_ids[0], io)
        if decl.layer_num > 1:
            last = range(decl.layer_num - 1, decl.layer_num)
            check_device_rows(where, "load of layer 0 only", decl, last, d, sentinel)
        for layer_id in layer_ids[1:]:
            host.load_to_device_per_layer(pool, d.host, d.dev_dst, layer_id, io)
    except SystemExit:
        raise
    except Exception as exc:
        if str(exc).startswith(CHECK_FAILED):
            raise
        traceback.print_exc()
        fail(where, f"the transfer raised {type(exc).__name__}: {exc}", TransferError)
    check_device_rows(where, "load", decl, range(decl.layer_num), d, None)
    return sampled
