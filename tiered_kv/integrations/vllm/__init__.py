"""tiered_kv as a vLLM v1 KV connector (``TieredKVConnector``; docs/vllm_connector.md).

vLLM loads the class by name from this package (``kv_connector_module_path``). Importing the
package does not import vLLM: the connector class is imported on first access.
"""

from __future__ import annotations

__all__ = ["TieredKVConnector"]


def __getattr__(name: str):
    if name == "TieredKVConnector":
        from tiered_kv.integrations.vllm.connector import TieredKVConnector

        return TieredKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
