"""The device <-> host measurement: the baseline copy runs right before each transfer, on the
same draw, round after round; and the check catches a transfer that loses a row."""

from __future__ import annotations

import pytest
import torch

from tiered_kv.bench import transfer
from tiered_kv.bench.transfer_check import verify_transfer
from tiered_kv.bench.verify import fill_random
from tiered_kv.errors import TransferError

CPU = torch.device("cpu")


def _case(layout: str = "page_first", tokens: int = 16, page: int = 4):
    geom = transfer.Geometry(layers=2, heads=1, head_dim=8, dtype=torch.float16)
    pool = transfer.make_pool(geom, 4 * tokens, page, CPU)
    alloc = transfer.make_allocator(pool, 4 * tokens)
    fill_random(pool.buffers(), 0, CPU)
    decl = pool.host_pool_decls()[0]
    host = transfer.make_host(decl, alloc, layout, 2 * tokens)
    baseline = transfer.ContiguousBaseline(CPU, pool.store_dtype, 0)
    return transfer.TransferCase(pool, decl, alloc, host, "direct", tokens, baseline)


class RecordingBaseline(transfer.ContiguousBaseline):
    def __init__(self, inner: transfer.ContiguousBaseline, calls: list) -> None:
        super().__init__(inner.device, inner.dtype, inner.seed)
        self.calls = calls

    def copy_fn(self, nbytes, direction):
        copy = super().copy_fn(nbytes, direction)
        return lambda: (self.calls.append(("baseline", direction)), copy())


def test_baseline_runs_right_before_each_transfer_on_every_round():
    case = _case()
    calls: list = []
    case.baseline = RecordingBaseline(case.baseline, calls)
    host = case.host
    for name, label in (
        ("backup_from_device_all_layer", "backup"),
        ("load_to_device_per_layer", "load"),
        ("load_to_device_all_layer", "load_all"),
    ):
        real = getattr(host, name)

        def wrapped(*a, _real=real, _label=label, **k):
            calls.append((_label, int(a[1][0])))  # the draw's first host slot
            return _real(*a, **k)

        setattr(host, name, wrapped)
    try:
        res = transfer.measure_transfer(case, 2, torch.Generator().manual_seed(1), warmup=1)
    finally:
        host.destroy()
    # 3 rounds (1 warm-up); per round: baseline, backup, baseline, load x layers, baseline, all
    per_round = [
        ("baseline", "backup"), "backup", ("baseline", "load"), "load", "load",
        ("baseline", "load_all"), "load_all",
    ]  # fmt: skip
    assert [c if c[0] == "baseline" else c[0] for c in calls] == per_round * 3
    firsts = [c[1] for c in calls if c[0] != "baseline"]
    for r in range(3):  # every transfer of a round uses that round's draw
        assert len(set(firsts[4 * r : 4 * r + 4])) == 1
    assert len({firsts[0], firsts[4], firsts[8]}) > 1  # fresh draws per round
    for d in transfer.DIRECTIONS:
        assert len(res[d].seconds) == len(res[d].baseline) == 2
        assert res[d].ratio == pytest.approx(res[d].gbps / res[d].baseline_gbps)
        assert res[d].nbytes == 16 * 2 * 2 * 8 * 2  # tokens x layers x (K, V) x dim x fp16


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
def test_verify_transfer_passes_a_good_copy_and_catches_a_lost_row(layout, monkeypatch):
    case = _case(layout)
    try:
        assert verify_transfer("ok", case, torch.Generator().manual_seed(2)) == 16
        real = case.host.load_to_device_per_layer

        def lossy(pool, host_indices, device_indices, layer_id, io_backend="kernel"):
            real(pool, host_indices[:-1], device_indices[:-1], layer_id, io_backend)

        monkeypatch.setattr(case.host, "load_to_device_per_layer", lossy)
        with pytest.raises(TransferError, match=r"CORRECTNESS FAILURE \[bad\]: load"):
            verify_transfer("bad", case, torch.Generator().manual_seed(3))
    finally:
        case.host.destroy()


def test_draw_gives_disjoint_device_pages_and_whole_host_pages():
    case = _case()
    try:
        d = transfer.draw(torch.Generator().manual_seed(0), case.alloc, case.host, 16)
        assert not set(d.dev_src.tolist()) & set(d.dev_dst.tolist())
        pages = d.host.view(-1, 4)
        assert torch.equal(pages - pages[:, :1], torch.arange(4).expand(4, 4))
        assert (pages[:, 0] % 4 == 0).all()
    finally:
        case.host.destroy()
