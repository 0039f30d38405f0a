"""What a run shows an operator while it serves: its log records (``--log-level``) and an
optional Prometheus endpoint (``tiered-kv run --metrics-port``) serving the registry of the
cache in use.

The library only names its loggers (``tiered_kv.*``, a ``NullHandler`` on the top one); this is
where an application decides where records go. The endpoint is prometheus_client's own HTTP
server on a daemon thread, bound to loopback unless told otherwise, shut down when the run ends.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_log_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="warning",
        help="tiered_kv log records at this level and above go to stderr",
    )


def add_metrics_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=0,
        help="serve the cache's Prometheus metrics over HTTP on this port while the run lasts "
        "(0: no endpoint)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address the metrics endpoint binds (0.0.0.0: every interface)",
    )


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0 to 65535)")
    return port


def setup_logging(level: str) -> None:
    """Records of ``tiered_kv`` loggers at ``level`` and above go to stderr (through the root
    logger's handler: one is added only where the process has none, so an embedding
    application's own handlers are kept)."""
    logging.getLogger("tiered_kv").setLevel(level.upper())
    if not logging.getLogger().handlers:
        logging.basicConfig(format=LOG_FORMAT)


class _Shown(Collector):
    """Whatever registry the endpoint shows now (nothing before the first)."""

    def __init__(self) -> None:
        self.registry: CollectorRegistry | None = None
        self.mode: str | None = None

    def collect(self) -> Iterator[Metric]:
        registry, mode = self.registry, self.mode
        if registry is None:
            return
        if mode is not None:
            shown = GaugeMetricFamily(
                "tiered_kv_run_mode",
                "1 for the mode of the run whose cache these metrics are (counters restart "
                "with each mode's cache).",
                labels=["mode"],
            )
            shown.add_metric([mode], 1)
            yield shown
        yield from registry.collect()


class MetricsEndpoint:
    """An HTTP server on ``host:port`` (port 0: one the system picks, see ``port``) answering
    every path with the text exposition of the registry ``show`` named last."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._shown = _Shown()
        registry = CollectorRegistry()
        registry.register(self._shown)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._server.server_port

    def show(self, registry: CollectorRegistry, mode: str | None = None) -> None:
        """Serve ``registry`` from now on (a cache's ``registry``), labelled with ``mode``."""
        self._shown.registry, self._shown.mode = registry, mode

    def close(self) -> None:
        """Stop serving and free the port (the thread ends). Safe twice."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)


@contextlib.contextmanager
def metrics_endpoint(port: int, host: str = "127.0.0.1") -> Iterator[MetricsEndpoint | None]:
    """A :class:`MetricsEndpoint` for the ``with`` block (None when ``port`` is 0: no endpoint),
    closed at its end, however it ends."""
    if not port:
        yield None
        return
    endpoint = MetricsEndpoint(port, host)
    logging.getLogger(__name__).info("metrics at http://%s:%d/metrics", host, endpoint.port)
    try:
        yield endpoint
    finally:
        endpoint.close()
