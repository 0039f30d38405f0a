"""LayerRowLoader: one layer's host records into device rows, straight, in every mode.

Random bits in host and device (NaN payloads included, compared as integers), irregular sizes
(page 3, a pool starting at global layer 2, 0-13 rows a call), every host layout, one-part
(MLA) and two-part (MHA, V narrower than K) records, bf16 and fp8: after each call exactly the
chosen rows of the chosen layer hold the host records (the oracle reads the host buffer through
the documented layout shapes, not tiered_kv's layout code), every other byte of device and
host is unchanged.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.host._util import (
    FP8,
    LAYOUTS,
    assert_device_equal,
    assert_host_equal,
    device_snapshot,
    fill_bits,
    fill_device,
    host_snapshot,
    make_host,
    make_pool,
    part_columns,
)
from tiered_kv.errors import InvalidArgumentError, StateError
from tiered_kv.host.layer_rows import LayerRowLoader
from tiered_kv.kernels import native_available

PAGE, START = 3, 2
NATIVE = pytest.mark.skipif(not native_available(), reason="native copier not built")
MODES = [
    pytest.param(("blocks", "torch"), marks=NATIVE),
    ("numpy", "torch"),
    ("kernel", "torch"),
    pytest.param(("kernel", "native"), marks=NATIVE),
]


def _rig(kind: str, layout: str, dtype: torch.dtype, backend: str, seed: str):
    gen = torch.Generator().manual_seed(zlib.crc32(seed.encode()))
    pool, alloc = make_pool(kind, PAGE, dtype, pages=7, start_layer=START)
    host = make_host(pool, alloc, layout, host_pages=5, kernel_backend=backend)
    fill_device(pool, gen)
    fill_bits(host.buffer, gen)
    return pool, host, gen


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(m))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mla", "mha_v"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
def test_load_copies_exactly_the_chosen_rows_of_one_layer(mode, layout, kind, dtype):
    pool, host, gen = _rig(kind, layout, dtype, mode[1], f"{mode}{layout}{kind}{dtype}")
    loader = LayerRowLoader(host, mode[0])
    cols = part_columns(pool)
    for _ in range(8):
        n = int(torch.randint(0, 14, (1,), generator=gen))
        host_slots = torch.randperm(host.size, generator=gen)[:n]
        dev_rows = torch.randperm(pool.size, generator=gen)[:n] + PAGE  # never the padding
        layer = START + int(torch.randint(0, pool.layer_num, (1,), generator=gen))
        before, records = device_snapshot(pool), host_snapshot(host)
        loader.load(layer, host_slots.numpy(), dev_rows.numpy())
        want = {k: v.clone() for k, v in before.items()}
        for name, (a, b) in cols.items():
            want[name][layer - START, dev_rows] = records[layer - START, host_slots, a:b]
        assert_device_equal(pool, want)
        assert_host_equal(host, records)
        fill_device(pool, gen)  # fresh bits for the next call


def test_auto_mode_and_bad_input():
    pool, host, gen = _rig("mla", "page_first", torch.bfloat16, "torch", "bad")
    assert LayerRowLoader(host).mode == ("blocks" if native_available() else "numpy")
    with pytest.raises(InvalidArgumentError, match="mode"):
        LayerRowLoader(host, "fast")
    loaders = [LayerRowLoader(host, m) for m in ("numpy", "kernel")]
    if native_available():
        loaders.append(LayerRowLoader(host, "blocks"))
    before = device_snapshot(pool)
    one = torch.tensor([4]).numpy()
    for loader in loaders:
        for layer in (START - 1, START + pool.layer_num, True):
            with pytest.raises(InvalidArgumentError, match="layer_id"):
                loader.load(layer, one, one)
    if native_available():  # raw addresses: a wrong index raises before any byte moves
        blocks = loaders[-1]
        for h, d in (([5, host.size], [4, 5]), ([5, -1], [4, 5]), ([5, 6], [4, pool.num_slots])):
            with pytest.raises(InvalidArgumentError, match="must be in"):
                blocks.load(START, torch.tensor(h).numpy(), torch.tensor(d).numpy())
    assert_device_equal(pool, before)
    host.destroy()
    for loader in loaders:
        with pytest.raises(StateError):
            loader.load(START, one, one)
    assert_device_equal(pool, before)
