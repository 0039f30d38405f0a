"""What a run shows an operator: its log records (``--log-level``), its progress on stderr
(:mod:`~tiered_kv.cli.progress`), and its Prometheus metrics
(:mod:`~tiered_kv.cli.run_metrics`) on an optional endpoint (``tiered-kv run --metrics-port``)
and in an optional file written at the end (``--metrics-file``).

The library only names its loggers (``tiered_kv.*``, a ``NullHandler`` on the top one); this is
where an application decides where records go. The endpoint is prometheus_client's own HTTP
server on a daemon thread, bound to loopback unless told otherwise. It serves from the start of
the run to its end, the final values after the report is printed, and ``--metrics-linger``
seconds more if asked (a scraper's interval: 15 s is Prometheus' usual), then shuts down.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from tiered_kv.cli.progress import RunProgress
from tiered_kv.cli.run_metrics import RunMetrics
from tiered_kv.errors import InvalidArgumentError

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
        help="serve the run's Prometheus metrics (every mode's, labelled mode=...) over HTTP "
        "on this port until the run ends (0: no endpoint)",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="the address the metrics endpoint binds (0.0.0.0: every interface)",
    )
    p.add_argument(
        "--metrics-linger",
        type=seconds,
        default=0.0,
        metavar="S",
        help="after the report, keep the endpoint serving the final values S seconds more, for "
        "a last scrape (Ctrl-C ends the wait)",
    )
    p.add_argument(
        "--metrics-file",
        metavar="PATH",
        help="at the end, write the run's final metrics there in the Prometheus text format "
        "(atomically: written beside it, then renamed)",
    )


def check_metrics_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse, before the run, what would fail or do nothing at its end."""
    if args.metrics_linger and not args.metrics_port:
        parser.error(f"--metrics-linger {args.metrics_linger:g} needs --metrics-port")
    if args.metrics_file:
        path = os.path.abspath(args.metrics_file)
        parent = os.path.dirname(path)
        if os.path.isdir(path):
            parser.error(f"--metrics-file {args.metrics_file}: is a directory; name a file")
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
            parser.error(
                f"--metrics-file {args.metrics_file}: cannot write in {parent}; name a file in "
                "an existing writable directory"
            )


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{value} must be >= 0 seconds")
    return value


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
    """Whatever the endpoint shows now (nothing before the first ``show``)."""

    def __init__(self) -> None:
        self.source: Collector | None = None

    def collect(self) -> Iterator[Metric]:
        source = self.source
        if source is not None:
            yield from source.collect()


class MetricsEndpoint:
    """An HTTP server on ``host:port`` (port 0: one the system picks, see ``port``) answering
    every path with the text exposition of what ``show`` named last."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._shown = _Shown()
        registry = CollectorRegistry()
        registry.register(self._shown)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.host = host
        self.port: int = self._server.server_port

    def show(self, source: Collector) -> None:
        """Serve ``source`` from now on (a registry, or a collector: a run's ``RunMetrics``)."""
        self._shown.source = source

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


def write_metrics_file(path: str, source: Collector) -> None:
    """``source``'s text exposition in ``path``, whole or not at all (written beside it, then
    renamed over it)."""
    try:
        write_to_textfile(path, source)
    except OSError as exc:
        raise InvalidArgumentError(
            f"--metrics-file {path}: cannot write it ({exc.strerror or exc}); name a file in a "
            "writable directory"
        ) from None


class RunObservers:
    """A run's progress and metrics behind ``run_scale``'s hooks (``hooks``): the progress
    unless ``--no-progress``, the metrics when an endpoint or a file wants them."""

    def __init__(self, args: argparse.Namespace, modes: tuple[str, ...], turns: int) -> None:
        self.args = args
        self.progress = None if args.no_progress else RunProgress(modes, turns)
        want = args.metrics_port or args.metrics_file
        self.metrics = RunMetrics() if want else None
        self.endpoint: MetricsEndpoint | None = None

    @property
    def hooks(self) -> dict:
        return {
            "on_cache": self._on_cache,
            "on_progress": self.progress.update if self.progress else None,
            "on_mode_done": self._on_mode_done,
        }

    def _on_cache(self, mode: str, cache) -> None:
        if self.metrics is not None:
            self.metrics.on_cache(mode, cache)
        if self.progress is not None:
            self.progress.start(mode)

    def _on_mode_done(self, mode: str, report: dict) -> None:
        if self.metrics is not None:
            self.metrics.on_mode_done(mode, report)
        if self.progress is not None:
            self.progress.mode_done(mode, report)

    def finish(self) -> None:
        """After the report: the metrics are final; write ``--metrics-file``; keep the
        endpoint up ``--metrics-linger`` seconds (Ctrl-C ends the wait, not the run's
        status)."""
        if self.metrics is None:
            return
        self.metrics.finish()
        if self.args.metrics_file:
            write_metrics_file(self.args.metrics_file, self.metrics)
        linger, endpoint = self.args.metrics_linger, self.endpoint
        if linger and endpoint is not None:
            sys.stdout.flush()  # the report is out before the wait, even into a pipe
            url = f"http://{endpoint.host}:{endpoint.port}/metrics"
            print(f"final metrics at {url} for {linger:g} s (Ctrl-C ends)", file=sys.stderr)
            try:
                time.sleep(linger)
            except KeyboardInterrupt:
                pass


@contextlib.contextmanager
def observed_run(
    args: argparse.Namespace, modes: tuple[str, ...], turns: int
) -> Iterator[RunObservers]:
    """The run's observers for the ``with`` block, its endpoint (``--metrics-port``) up for
    all of it; the progress bar and the endpoint taken down at its end, however it ends."""
    run = RunObservers(args, modes, turns)
    with metrics_endpoint(args.metrics_port, args.metrics_host) as endpoint:
        if endpoint is not None:
            endpoint.show(run.metrics)
            run.endpoint = endpoint
        try:
            if run.progress is not None and run.progress.bar:
                from tqdm.contrib.logging import logging_redirect_tqdm

                # Log records printed above the bar instead of through it.
                with logging_redirect_tqdm():
                    yield run
            else:
                yield run
        finally:
            if run.progress is not None:
                run.progress.close()
