"""The vLLM connector's settings: ``kv_connector_extra_config`` read once, at startup.

vLLM hands a connector its ``KVTransferConfig``; the extra config takes our ``StorageConfig``
fields by name (``storage_bytes``, ``storage_path``, ``storage_backend``, ``storage_options``,
``storage_local_copy``, ``namespace_salt``, ``kv_scales_id``, ...), the model identity
``model_id`` ('<name>@<weights revision>'), the host tier's size ``host_bytes``, the load mode
``load_mode`` and ``gil_switch_us``, the GIL switch interval the worker holds while its tiers are
open (``tiered_kv.gil_switch``; 0 leaves the interpreter's). An unknown key, a wrong type or a
value out of range is an ``InvalidArgumentError`` naming ``kv_connector_extra_config.<key>=<value>``
and what is valid, before anything is allocated or opened. Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage_config import StorageConfig

FLAG = "kv_connector_extra_config"
# rank is ours to set (from vLLM's parallel config); model_id is read on its own
STORAGE_KEYS = frozenset(f.name for f in fields(StorageConfig) if f.name not in ("rank",))
LOAD_MODES = ("async", "layerwise")
CONNECTOR_KEYS = frozenset({"host_bytes", "load_mode", "gil_switch_us"})
OUR_KEYS = STORAGE_KEYS | CONNECTOR_KEYS
DEFAULT_HOST_BYTES = 1 << 30
# The switch interval the worker's process keeps while its tiers are open. vLLM's main thread
# runs Python most of a step and keeps the GIL for the interpreter's 5 ms at each of the load and
# save threads' releases (issue 40, bench_vllm --quick, 2 cores: a store read 6.0 ms per block at
# 5 ms, 0.64 at 0.5 ms, 0.14 at 0.2 ms; outside the engine 0.05).
DEFAULT_GIL_SWITCH_US = 200
MAX_GIL_SWITCH_US = 5000  # the interpreter's default: a hold only ever shortens the interval


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector opens: the store's config (with the model identity), the host tier's
    byte budget, and how loads run (``async``: between scheduler steps, reported through
    ``get_finished``; ``layerwise``: inside the forward that reads them, one wait per layer)."""

    storage: StorageConfig
    model_id: str
    host_bytes: int
    load_mode: str
    gil_switch_us: int = DEFAULT_GIL_SWITCH_US

    @property
    def load_async(self) -> bool:
        return self.load_mode == "async"


def bad(key: str, value: object, valid: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{FLAG}.{key}={value!r} is invalid: {valid}")


def _model_id(extra: Mapping[str, object]) -> str:
    # vLLM's model name is a path or a hub name without a weights revision: a fine-tune saved
    # over its base would share pages, so the identity is never defaulted from it.
    model_id = extra.get("model_id")
    name, at, revision = model_id.rpartition("@") if isinstance(model_id, str) else ("", "", "")
    if not (name and at and revision):
        raise bad(
            "model_id",
            model_id,
            "'<name>@<weights revision>' (a commit or checkpoint digest): pages of two models, "
            "or of a fine-tune and its base, must never meet",
        )
    return model_id


def read_settings(extra: object) -> ConnectorSettings:
    """Settings from vLLM's ``kv_connector_extra_config`` (None or a mapping)."""
    extra = {} if extra is None else extra
    if not isinstance(extra, Mapping):
        raise bad("", extra, "a JSON object")
    unknown = sorted(str(k) for k in extra if k not in OUR_KEYS)
    if unknown:
        raise bad(
            unknown[0],
            extra[unknown[0]],
            f"unknown key; valid keys are {', '.join(sorted(OUR_KEYS))}",
        )
    model_id = _model_id(extra)
    size = extra.get("storage_bytes")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise bad("storage_bytes", size, "an int >= 1: the store's budget in bytes")
    host = extra.get("host_bytes", DEFAULT_HOST_BYTES)
    if isinstance(host, bool) or not isinstance(host, int) or host < 1:
        raise bad("host_bytes", host, "an int >= 1: the host tier's budget in bytes")
    mode = extra.get("load_mode", "async")
    if mode not in LOAD_MODES:
        raise bad("load_mode", mode, f"one of {', '.join(LOAD_MODES)}")
    switch = extra.get("gil_switch_us", DEFAULT_GIL_SWITCH_US)
    if (
        isinstance(switch, bool)
        or not isinstance(switch, int)
        or not (0 <= switch <= MAX_GIL_SWITCH_US)
    ):
        raise bad(
            "gil_switch_us",
            switch,
            f"an int 0..{MAX_GIL_SWITCH_US}: the GIL switch interval in microseconds the worker "
            "keeps while the connector's threads work (0 leaves the interpreter's)",
        )
    options = {k: extra[k] for k in STORAGE_KEYS if k in extra and k != "model_id"}
    try:
        storage = StorageConfig(**options, model_id=model_id)
    except (InvalidArgumentError, TypeError) as exc:
        raise InvalidArgumentError(f"{FLAG}: {exc}") from None
    return ConnectorSettings(
        storage=storage, model_id=model_id, host_bytes=host, load_mode=mode, gil_switch_us=switch
    )
