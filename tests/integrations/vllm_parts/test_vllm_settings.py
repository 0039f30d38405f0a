"""The connector's settings: a full extra config is read into one frozen ConnectorSettings; every
bad key or value is refused before anything opens, naming ``kv_connector_extra_config.<key>``."""

from __future__ import annotations

import dataclasses

import pytest

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.settings import FLAG, read_settings


def _valid(tmp_path) -> dict:
    return {
        "model_id": "org/tiny-model@3f9a1c",
        "storage_bytes": 48 << 20,
        "storage_path": str(tmp_path),
        "host_bytes": 3 << 20,
        "load_mode": "layerwise",
    }


def test_a_full_config_is_read(tmp_path):
    s = read_settings({**_valid(tmp_path), "namespace_salt": "tenant-7"})
    assert s.model_id == "org/tiny-model@3f9a1c"
    assert s.host_bytes == 3 << 20
    assert s.load_mode == "layerwise" and not s.load_async
    assert s.storage.storage_bytes == 48 << 20
    assert s.storage.storage_path == str(tmp_path)
    assert s.storage.model_id == s.model_id
    assert s.storage.namespace_salt == "tenant-7"
    assert s.storage.rank is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.host_bytes = 1  # type: ignore[misc]


def test_defaults(tmp_path):
    extra = _valid(tmp_path)
    del extra["host_bytes"], extra["load_mode"]
    s = read_settings(extra)
    assert s.load_mode == "async" and s.load_async
    assert s.host_bytes == 1 << 30
    assert s.gil_switch_us == 200


@pytest.mark.parametrize("us", [0, 1, 5000])
def test_the_gil_switch_interval_is_read(tmp_path, us):
    assert read_settings({**_valid(tmp_path), "gil_switch_us": us}).gil_switch_us == us


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("no_such_key", 1),
        ("rank", "0"),  # ours to set, never the user's
        ("model_id", "org/tiny-model"),
        ("model_id", "org/tiny-model@"),
        ("model_id", "@3f9a1c"),
        ("model_id", 17),
        ("storage_bytes", 0),
        ("storage_bytes", -5),
        ("storage_bytes", True),
        ("storage_bytes", 1.5),
        ("storage_bytes", "64M"),
        ("host_bytes", 0),
        ("host_bytes", False),
        ("host_bytes", 2.0),
        ("load_mode", "sync"),
        ("load_mode", None),
        ("storage_backend", "nope"),
        ("storage_local_copy", "yes"),
        ("storage_batch_pages", 0),
        ("gil_switch_us", -1),
        ("gil_switch_us", 5001),
        ("gil_switch_us", 0.5),
        ("gil_switch_us", "200"),
        ("gil_switch_us", True),
    ],
)
def test_a_bad_key_or_value_is_refused_by_name(tmp_path, key, value):
    with pytest.raises(InvalidArgumentError) as info:
        read_settings({**_valid(tmp_path), key: value})
    assert FLAG in str(info.value)
    assert key in str(info.value)


@pytest.mark.parametrize("key", ["model_id", "storage_bytes"])
def test_a_required_key_missing_is_refused_by_name(tmp_path, key):
    extra = _valid(tmp_path)
    del extra[key]
    with pytest.raises(InvalidArgumentError, match=f"{FLAG}.{key}="):
        read_settings(extra)


def test_none_is_an_empty_config_and_refused_for_its_model_id():
    with pytest.raises(InvalidArgumentError, match=f"{FLAG}.model_id="):
        read_settings(None)


@pytest.mark.parametrize("extra", [["model_id", "m@r"], "model_id=m@r", 7])
def test_a_non_mapping_is_refused(extra):
    with pytest.raises(InvalidArgumentError, match="a JSON object"):
        read_settings(extra)


def test_storage_path_is_needed_for_the_embedded_store(tmp_path):
    extra = _valid(tmp_path)
    del extra["storage_path"]
    with pytest.raises(InvalidArgumentError, match="storage_path"):
        read_settings(extra)
