"""Moving bytes between two tiers behind one contract (submit / poll / wait / cancel), with
per-layer readiness for host -> device loads and byte and time counts per direction."""

from tiered_kv.transfer.base import TransferJob, TransferResult, TransferWorker
from tiered_kv.transfer.device_host import DeviceHostTransfer
from tiered_kv.transfer.host_storage import HostStorageTransfer
from tiered_kv.transfer.layer_done import LayerDoneCounter
from tiered_kv.transfer.stats import TransferStats

__all__ = [
    "DeviceHostTransfer",
    "HostStorageTransfer",
    "LayerDoneCounter",
    "TransferJob",
    "TransferResult",
    "TransferStats",
    "TransferWorker",
]
