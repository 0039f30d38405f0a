"""The manager's collaborators are typed by protocols that the real classes and the
simulator's fakes both implement (checked structurally, at runtime)."""

from __future__ import annotations

import pytest

from tiered_kv.cache import interfaces
from tiered_kv.cache.build import build_cache_parts
from tiered_kv.config import TieredKVConfig
from tiered_kv.sim.simulator import CountingSlots, InstantTransfer, KeyStore


@pytest.fixture
def parts(tmp_path):
    cfg = TieredKVConfig.flat(
        num_layers=2,
        head_num=2,
        head_dim=8,
        page_size=4,
        device_tokens=64,
        host_tokens=64,
        storage_bytes=64 << 20,
        storage_path=str(tmp_path / "store"),
        model_id="test-model@1",
    )
    p = build_cache_parts(cfg)
    yield p
    p.device_host.close()
    p.host_storage.close()
    p.storage.close()


def test_real_classes_implement_the_protocols(parts):
    assert isinstance(parts.allocator, interfaces.DeviceSlots)
    assert isinstance(parts.host_pool, interfaces.HostSlots)
    assert isinstance(parts.storage, interfaces.PageProbe)
    assert isinstance(parts.device_host, interfaces.LoadWorker)
    assert isinstance(parts.host_storage, interfaces.TransferWorker)
    assert isinstance(parts.manager, interfaces.JobBook)


def test_simulator_fakes_implement_the_protocols():
    assert isinstance(CountingSlots(4), interfaces.DeviceSlots)
    assert isinstance(KeyStore(None), interfaces.PageProbe)
    fake = InstantTransfer(KeyStore(None))
    assert isinstance(fake, interfaces.LoadWorker) and isinstance(fake, interfaces.TransferWorker)


def test_something_else_does_not():
    assert not isinstance(object(), interfaces.TransferWorker)
    assert not isinstance(KeyStore(None), interfaces.SlotPool)
