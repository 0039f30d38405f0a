"""Trace-driven hit-rate experiments: no KV bytes, the cache's own tree and policies.

Input: a Mooncake-format JSONL trace (--trace) or a generated one (multi-round QA or long-document
QA). For each device capacity (a fraction of the trace's unique blocks, or a block count) and each
eviction policy (used on both tiers), the trace is replayed through the same TieredRadixCache
the serving cache runs, and the hit rate per tier and overall is printed next to the offline
bound at the same total capacity (Belady's MIN over the block accesses: no policy can hit more
blocks). Tiers are inclusive under write_through (the host keeps a copy of what the device
holds), so a host no larger than the device adds little there; hits are counted at the fastest
tier holding a block.
"""

from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from tiered_kv.cli.args import capacity_list, name_list, non_negative_int, positive_int
from tiered_kv.cli.report import table, write_json
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import WritePolicy
from tiered_kv.sim.belady import access_sequence, belady_hits
from tiered_kv.sim.simulator import SimCache
from tiered_kv.sim.traces import (
    REPEAT_MODES,
    load_mooncake,
    long_doc_qa,
    multi_round_qa,
    unique_blocks,
)
from tiered_kv.tree.policies import POLICIES

HELP = "replay a trace against tier capacities and policies; compare with the offline optimum"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", metavar="JSONL", help="Mooncake trace (else --generator)")
    p.add_argument("--generator", choices=("multi-round", "long-doc"), default="multi-round")
    p.add_argument("--max-requests", type=non_negative_int, default=0, help="0: all")
    p.add_argument(
        "--capacities",
        type=capacity_list,
        default="0.05,0.1,0.25,0.5",
        help="device capacities: fractions of the unique blocks, or block counts",
    )
    p.add_argument("--host-ratio", type=float, default=1.0, help="host capacity / device")
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
    p.add_argument("--plot", metavar="PATH.png", help="hit rate against capacity")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("generators")
    g.add_argument("--block-size", type=positive_int, default=16, help="tokens per block")
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
    g.add_argument("--seed", type=int, default=0)


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.host_ratio < 0:
        parser.error(f"--host-ratio {args.host_ratio} must be >= 0")
    if args.storage < 0 or (args.storage > 1 and args.storage != int(args.storage)):
        parser.error(f"--storage {args.storage}: 0, a fraction in (0, 1], or a block count")
    if args.storage and not args.host_ratio:
        parser.error("--storage needs a host tier (--host-ratio > 0)")
    if args.plot and not args.plot.lower().endswith(".png"):
        parser.error(f"--plot {args.plot} must be a .png path")
    if args.trace:
        try:
            with open(args.trace, "rb"):
                pass
        except OSError as exc:
            parser.error(f"--trace {args.trace}: {exc.strerror or exc}")


def load_trace(args):
    if args.trace:
        trace = load_mooncake(args.trace)
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


def _blocks(value: float, unique: int) -> int:
    return max(1, int(value) if value > 1 else int(round(value * unique)))


def sweep(
    trace,
    capacities,
    policies,
    host_ratio,
    storage,
    write_policy,
    progress=True,
    host_policy: str = "same",
) -> dict:
    unique = unique_blocks(trace)
    accesses = access_sequence(trace)
    storage_blocks = _blocks(storage, unique) if storage else 0
    rows, bounds = [], {}
    steps = [(c, p) for c in capacities for p in policies]
    for cap, policy in tqdm(steps, desc="simulating", unit="run", disable=not progress):
        device = _blocks(cap, unique)
        host = int(device * host_ratio)
        total = device + host + storage_blocks
        if total not in bounds:
            bounds[total] = belady_hits(accesses, total)
        t = time.perf_counter()
        sim = SimCache(
            device,
            host,
            storage_blocks,
            device_policy=policy,
            host_policy=policy if host_policy == "same" else host_policy,
            write_policy=write_policy,
        )
        res = sim.run(trace)
        hits = res.device + res.host + res.storage
        if hits > bounds[total]:
            raise InvalidArgumentError(
                f"policy {policy} at {total} blocks hit {hits} blocks, above Belady's "
                f"{bounds[total]}: the bound or the simulator is wrong"
            )
        rows.append(
            {
                "capacity": cap,
                "device_blocks": device,
                "host_blocks": host,
                "storage_blocks": storage_blocks,
                "policy": policy,
                "host_policy": policy if host_policy == "same" else host_policy,
                "device_rate": res.rate("device"),
                "host_rate": res.rate("host"),
                "storage_rate": res.rate("storage"),
                "hit_rate": res.hit_rate,
                "optimal_rate": bounds[total] / len(accesses) if accesses else 0.0,
                "seconds": time.perf_counter() - t,
            }
        )
    return {
        "unique_blocks": unique,
        "accesses": len(accesses),
        "requests": len(trace),
        "rows": rows,
    }


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
    print(
        table(
            [
                "capacity",
                "policy",
                "device",
                "host",
                "storage",
                "hit rate",
                "optimum",
                "of optimum",
            ],
            [
                [
                    f"{r['capacity']:g} ({r['device_blocks']} blk)",
                    r["policy"]
                    if r["host_policy"] == r["policy"]
                    else f"{r['policy']} / host {r['host_policy']}",
                    f"{100 * r['device_rate']:.1f}%",
                    f"{100 * r['host_rate']:.1f}%",
                    f"{100 * r['storage_rate']:.1f}%",
                    f"{100 * r['hit_rate']:.1f}%",
                    f"{100 * r['optimal_rate']:.1f}%",
                    f"{r['hit_rate'] / r['optimal_rate']:.2f}" if r["optimal_rate"] else "-",
                ]
                for r in result["rows"]
            ],
        )
    )
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    write_json(args.json, result)
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = result["rows"]
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        ax.plot(
            [r["device_blocks"] for r in mine],
            [100 * r["hit_rate"] for r in mine],
            marker="o",
            label=policy,
        )
    first = [r for r in rows if r["policy"] == rows[0]["policy"]]
    ax.plot(
        [r["device_blocks"] for r in first],
        [100 * r["optimal_rate"] for r in first],
        "k--",
        marker="s",
        label="optimum (Belady)",
    )
    ax.set_xlabel("device capacity (blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(f"{result['source']}: hit rate vs capacity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
