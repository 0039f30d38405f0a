"""``tiered-kv``: the command line (``run``, ``run-reference``, ``sim``, ``bench``).

``run`` is the main job: the long-context multi-turn workload at a real model's KV size, served
by the batched scheduler three ways (tiered, device only, recompute). ``run-reference`` serves a
smaller workload with the tiny reference models (real compute, logits verified bitwise, the
store reused across runs).

Every subcommand shows its defaults in ``--help``, validates its arguments (a bad value exits
with status 2 and a message naming the flag), writes ``--json PATH`` next to the printed table,
and accepts ``--config FILE.toml`` whose keys mirror the flags (``users = 8``, ``device-tokens =
2048`` or ``device_tokens = 2048``) at the top level or in the command's own table (``[run]``,
``[run-reference]``, ``[sim]``, ``[bench]``; ``[run_reference]`` is the same table), whose keys
win over the top level's; flags given on the command line win over the file. What would fail
later (the ``--json`` path, a store directory or server, a port, the memory a run needs) is
refused before any work (``cli.preflight``), and Ctrl-C ends any of them with one line on stderr
and status 130 after its cleanup.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from tiered_kv.cli import bench_cmd, omp_wait, run_cmd, scale_cmd, sim_cmd
from tiered_kv.cli.args import json_object
from tiered_kv.cli.observe import add_log_argument, setup_logging
from tiered_kv.cli.preflight import check_output_file

COMMANDS = {"run": scale_cmd, "run-reference": run_cmd, "sim": sim_cmd, "bench": bench_cmd}


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="tiered-kv",
        description="Tiered KV-cache store: serve with offload, benchmark host memory, "
        "replay hit-rate experiments.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__)
        p.add_argument("--config", metavar="FILE.toml", help="TOML file of flag values")
        p.add_argument("--json", metavar="PATH", help="also write the result as JSON")
        add_log_argument(p)
        module.add_arguments(p)
        for action in p._actions:  # noqa: SLF001
            # ArgumentDefaultsHelpFormatter only annotates options that have help text.
            if action.help is None and action.default is not argparse.SUPPRESS:
                action.help = "(default: %(default)s)"
    return parser


def _config_defaults(
    parser: argparse.ArgumentParser, sub: argparse.ArgumentParser, command: str, path: str
) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        parser.exit(2, f"tiered-kv {command}: error: --config {path}: {exc.strerror}\n")
    except tomllib.TOMLDecodeError as exc:
        parser.exit(2, f"tiered-kv {command}: error: --config {path}: not TOML ({exc})\n")
    except UnicodeDecodeError as exc:
        parser.exit(
            2,
            f"tiered-kv {command}: error: --config {path}: not UTF-8 text (byte {exc.start}); "
            "give a TOML file\n",
        )

    def fail(message: str) -> None:
        parser.exit(2, f"tiered-kv {command}: error: --config {path}: {message}\n")

    known = {a.dest: a for a in sub._actions if a.dest not in ("help", "config")}  # noqa: SLF001
    # A table is a command's section, unless it is named like an option (storage-options).
    tables = [
        k for k, v in data.items() if isinstance(v, dict) and k.replace("-", "_") not in known
    ]
    # A table is named like its command, with `-` or `_` (as the keys are): one per command.
    by_command: dict[str, str] = {}
    for name in tables:
        table_command = name.replace("_", "-")
        if table_command not in COMMANDS:
            fail(f"unknown table [{name}]; tables: {', '.join(f'[{c}]' for c in COMMANDS)}")
        if table_command in by_command:
            fail(f"tables [{by_command[table_command]}] and [{name}] are the same; keep one")
        by_command[table_command] = name
    section = {k: v for k, v in data.items() if k not in tables}
    if command in by_command:
        section.update(data[by_command[command]])
    out = {}
    for key, value in section.items():
        dest = key.replace("-", "_")
        if dest not in known:
            valid = ", ".join(sorted(d.replace("_", "-") for d in known))
            fail(f"unknown key {key!r}; valid keys: {valid}")
        action = known[dest]
        if isinstance(action, argparse._StoreConstAction):  # noqa: SLF001 - store_true flags
            if not isinstance(value, bool):
                fail(f"{key}={value!r}: must be true or false")
            out[dest] = action.const if value else action.default
            continue
        if isinstance(value, dict) and action.type is json_object:  # a backend's options table
            out[dest] = value
            continue
        if isinstance(value, list):  # comma-separated flags: ["lru", "lfu"] or [0.1, 0.5]
            value = ",".join(map(str, value))
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            fail(f"{key}={value!r}: expected a value like the flag's, not {type(value).__name__}")
        if action.type is not None:
            try:
                value = action.type(value if isinstance(value, str) else str(value))
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                fail(f"{key}={value!r}: {exc}")
        else:
            value = str(value)  # paths, and --page-sizes = 16
        if action.choices is not None and value not in action.choices:
            fail(f"{key}={value!r} is not one of {', '.join(map(str, action.choices))}")
        out[dest] = value
    return out


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        sub = parser._subparsers._group_actions[0].choices[args.command]  # noqa: SLF001
        sub.set_defaults(**_config_defaults(parser, sub, args.command, args.config))
        args = parser.parse_args(argv)
    check_output_file(args.command, "--json", args.json)  # a run's result is written last
    COMMANDS[args.command].validate(
        args, parser._subparsers._group_actions[0].choices[args.command]
    )  # noqa: SLF001
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Ctrl-C (SIGINT) ends it with one line on stderr and
    status 130 (128 + SIGINT, as a shell reports a command the signal ended), after the
    command's own cleanup (its caches and stores closed, its temporary folders removed); a
    second Ctrl-C during that cleanup ends the process at once (one within ``DOUBLE_TAP_S`` of
    the first is taken for the same), and one after it, while the process exits, is ignored:
    main ends the process, and after a Ctrl-C leaves SIGINT ignored (``_interruptible``). A
    stdout whose reader went away (``| head``) ends it quietly with status 141."""
    # Before anything imports torch: libgomp reads its environment when it is loaded.
    omp_wait.apply(sys.argv[1:] if argv is None else argv)
    with _interruptible():
        try:
            args = parse(argv)
            setup_logging(args.log_level)
            return COMMANDS[args.command].main(args)
        except KeyboardInterrupt:
            print("tiered-kv: interrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:  # stdout's reader went away (`| head`): stop quietly
            # Python's flush at exit would fail on the closed pipe again: point stdout at null.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # 128 + SIGPIPE, as a shell reports a writer the pipe ended


# A second Ctrl-C this soon after the first is the same one pressed twice (a double tap), not a
# request to skip the clean-up: ignored.
DOUBLE_TAP_S = 1.0


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt once; another while the first unwinds (the command's
    clean-up) exits at once (status 130, no traceback), unless it comes within
    ``DOUBLE_TAP_S`` of the first. Once the command has returned after a SIGINT, SIGINT is
    ignored: the process is ending, and its exit-time clean-up (``atexit`` hooks, ``weakref``
    finalizers, which close what is still open) runs to its end; a Ctrl-C there raised a
    KeyboardInterrupt traceback from it. Only from the main thread (a signal handler is set
    there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first_at: float | None = None

    def again(signum, frame) -> None:
        if time.monotonic() - first_at < DOUBLE_TAP_S:
            return
        print("tiered-kv: interrupted again; exiting without cleanup", file=sys.stderr)
        os._exit(130)

    def first(signum, frame) -> None:
        nonlocal first_at
        first_at = time.monotonic()
        signal.signal(signal.SIGINT, again)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        if first_at is not None:
            # Ignored, not handled: SIG_IGN outlives the interpreter's finalization, which puts
            # a Python handler back to SIG_DFL (a late Ctrl-C then killed the process by the
            # signal instead of status 130).
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:  # None: the handler before was not set from Python; the default one it was.
            signal.signal(
                signal.SIGINT, signal.default_int_handler if previous is None else previous
            )


if __name__ == "__main__":
    sys.exit(main())
