"""Trace-driven hit-rate experiments: no KV bytes, the cache's own tree and policies.

Input: a Mooncake or Qwen/Bailian JSONL trace (--trace; the format told from the first line, or
--trace-format) or a generated one (multi-round QA, long-document QA, a Mooncake-style
conversation trace, or a Bailian-style one). For each device capacity (a fraction of the trace's
unique blocks, or a block count) and each eviction policy, the trace is replayed through the same
TieredRadixCache the serving cache runs (rows in parallel processes, ``--jobs``), and the hit
rate per tier and overall is printed next to two offline bounds (Belady's MIN over the block
accesses): at the configuration's effective capacity (what "of optimum" divides by) and at
device + host + storage, which no policy may exceed (the run fails if one does). The default
host is 2 x the device (SGLang's default ``--hicache-ratio``) under write_through, so a default
run shows host hits.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from tiered_kv.cli import preflight
from tiered_kv.cli.args import (
    capacity_list,
    name_list,
    non_negative_float,
    non_negative_int,
    positive_int,
)
from tiered_kv.cli.report import table, write_json
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import EvictionPolicyName, WritePolicy
from tiered_kv.sim.bailian import bailian, is_bailian, load_bailian, to_requests
from tiered_kv.sim.traces import (
    REPEAT_MODES,
    conversation,
    load_mooncake,
    long_doc_qa,
    multi_round_qa,
)

POLICIES = EvictionPolicyName.values()  # tree.policies.POLICIES, without importing the tree

__all__ = ["add_arguments", "load_trace", "main", "sweep", "validate"]

TRACE_FORMATS = ("auto", "mooncake", "bailian")
GENERATORS = ("multi-round", "long-doc", "conversation", "bailian")
HELP = "replay a trace against tier capacities and policies; compare with the offline optimum"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace", metavar="JSONL", help="Mooncake or Qwen/Bailian trace (else --generator)"
    )
    p.add_argument(
        "--trace-format",
        choices=TRACE_FORMATS,
        default="auto",
        help="auto: Bailian if the first line has a chat_id, else Mooncake",
    )
    p.add_argument("--generator", choices=GENERATORS, default="multi-round")
    p.add_argument("--max-requests", type=non_negative_int, default=0, help="0: all")
    p.add_argument(
        "--capacities",
        type=capacity_list,
        default="0.05,0.1,0.25,0.5",
        help="device capacities: fractions of the unique blocks, or block counts",
    )
    p.add_argument(
        "--host-ratio", type=non_negative_float, default=2.0, help="host capacity / device"
    )
    p.add_argument(
        "--storage",
        type=float,
        default=0.0,
        help="storage capacity: 0 none, a fraction of the unique blocks, or blocks",
    )
    p.add_argument(
        "--policies",
        type=name_list(POLICIES),
        default=",".join(POLICIES),
        help="device eviction policies to compare (each is one line of the table)",
    )
    p.add_argument(
        "--host-policy",
        choices=("same", *POLICIES),
        default="same",
        help="host eviction policy; 'same': the device's",
    )
    p.add_argument("--write-policy", choices=WritePolicy.values(), default="write_through")
    p.add_argument("--plot", metavar="PATH.png", help="hit rate against capacity, per-tier split")
    p.add_argument("--log-capacity", action="store_true", help="the plot's capacity axis in log")
    p.add_argument(
        "--jobs", type=positive_int, default=os.cpu_count() or 1, help="worker processes"
    )
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("generators")
    g.add_argument(
        "--block-size",
        type=positive_int,
        default=16,
        help="tokens per block (multi-round, long-doc, bailian; conversation uses 512)",
    )
    g.add_argument("--users", type=positive_int, default=16)
    g.add_argument("--rounds", type=positive_int, default=4)
    g.add_argument("--shared-prompt", type=positive_int, default=1024, help="tokens")
    g.add_argument("--num-shared-prompts", type=positive_int, default=2)
    g.add_argument("--history", type=non_negative_int, default=256, help="tokens")
    g.add_argument("--answer", type=positive_int, default=128, help="tokens")
    g.add_argument("--documents", type=positive_int, default=16)
    g.add_argument("--document-length", type=positive_int, default=4096, help="tokens")
    g.add_argument("--questions", type=positive_int, default=3)
    g.add_argument("--repeat", choices=REPEAT_MODES, default="random")
    g.add_argument("--requests", type=positive_int, default=12031, help="conversation, bailian")
    g.add_argument("--seed", type=int, default=0)


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    s = args.storage
    if not math.isfinite(s) or s < 0 or (s > 1 and s != int(s)):
        parser.error(f"--storage {args.storage}: 0, a fraction in (0, 1], or a block count")
    if args.storage and not args.host_ratio:
        parser.error("--storage needs a host tier (--host-ratio > 0)")
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot} must be a .png path")
    if args.plot:
        # Refused before the run: a sweep can take minutes, and its plot is written last.
        parent = os.path.dirname(os.path.abspath(args.plot))
        if os.path.isdir(args.plot) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            parser.error(f"--plot {args.plot}: cannot write there (is {parent} a writable folder?)")
        if os.path.exists(args.plot) and not os.access(args.plot, os.W_OK):
            parser.error(f"--plot {args.plot}: the file exists and is not writable")
    if args.trace:  # readable, and text (not binary, not compressed)
        preflight.check_trace_file("sim", "--trace", args.trace)


def sweep(*args, **kwargs):
    """``tiered_kv.sim.sweep.sweep``, imported when a sweep runs (it imports torch)."""
    from tiered_kv.sim.sweep import sweep as run_sweep

    return run_sweep(*args, **kwargs)


def load_trace(args):
    if args.trace:
        fmt = args.trace_format
        if fmt == "auto":
            fmt = "bailian" if is_bailian(args.trace) else "mooncake"
        trace = load_bailian(args.trace) if fmt == "bailian" else load_mooncake(args.trace)
    elif args.generator == "multi-round":
        trace = multi_round_qa(
            users=args.users,
            rounds=args.rounds,
            shared_prompt=args.shared_prompt,
            history=args.history,
            answer=args.answer,
            num_shared_prompts=args.num_shared_prompts,
            block_size=args.block_size,
            seed=args.seed,
        )
    elif args.generator == "conversation":
        trace = conversation(requests=args.requests, seed=args.seed)
    elif args.generator == "bailian":
        records = bailian(requests=args.requests, block_size=args.block_size, seed=args.seed)
        trace = to_requests(records)
    else:
        trace = long_doc_qa(
            documents=args.documents,
            document_length=args.document_length,
            questions=args.questions,
            repeat=args.repeat,
            block_size=args.block_size,
            seed=args.seed,
        )
    return trace[: args.max_requests] if args.max_requests else trace


def main(args: argparse.Namespace) -> int:
    try:
        trace = load_trace(args)
    except (OSError, InvalidArgumentError) as exc:
        if not args.trace:
            raise
        # A malformed (or vanished) trace is a bad argument: exit 2 like argparse, no traceback.
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"tiered-kv sim: error: --trace {args.trace}: {detail}", file=sys.stderr)
        raise SystemExit(2) from None
    result = sweep(
        trace,
        args.capacities,
        args.policies,
        args.host_ratio,
        args.storage,
        args.write_policy,
        progress=not args.no_progress,
        host_policy=args.host_policy,
        jobs=args.jobs,
    )
    result.update(
        {
            "command": "sim",
            "source": args.trace or args.generator,
            "write_policy": args.write_policy,
            "host_ratio": args.host_ratio,
            "inclusive_tiers": args.write_policy == WritePolicy.WRITE_THROUGH,
        }
    )
    print(
        f"\n{result['source']}: {result['requests']} requests, {result['accesses']} block "
        f"accesses, {result['unique_blocks']} unique blocks; write policy "
        f"{args.write_policy}, host = {args.host_ratio:g} x device"
    )
    print(table(HEADERS, [table_row(r) for r in result["rows"]]))
    print(
        "effective: Belady at the blocks this configuration can hold (write_through: "
        "max(device, host, storage); write_through_selective: device + max(host, storage); "
        "write_back: the sum), what 'of optimum' divides by; total: Belady at device + host + "
        "storage, which no row exceeds"
    )
    # The JSON first: a plot that fails (no matplotlib, a full disk) must not lose the sweep.
    write_json(args.json, result)
    if args.plot:
        from tiered_kv.sim.plot import plot

        plot(result, args.plot, log_capacity=args.log_capacity)
        print(f"plot: {args.plot}")
    return 0


HEADERS = [
    "capacity",
    "policy",
    "device",
    "host",
    "storage",
    "hit rate",
    "effective (blk)",
    "total (blk)",
    "of optimum",
]


def table_row(r: dict) -> list[str]:
    policy = r["policy"]
    if r["host_policy"] != policy:
        policy = f"{policy} / host {r['host_policy']}"
    return [
        f"{r['capacity']:g} ({r['device_blocks']} blk)",
        policy,
        *(f"{100 * r[k]:.1f}%" for k in ("device_rate", "host_rate", "storage_rate", "hit_rate")),
        f"{100 * r['effective_rate']:.1f}% ({r['effective_blocks']})",
        f"{100 * r['total_rate']:.1f}% ({r['total_blocks']})",
        "-" if r["of_optimum"] is None else f"{r['of_optimum']:.2f}",
    ]
