"""Benchmark of HiSparse serving against the dense layout, through the batched schedulers.

The same multi-turn workload - ``--convos`` conversations over a shared system prompt, each
turn the previous turn's prompt and output plus new user tokens - is served twice by the same
DSA model (``SparseDSA``: TinyDSA's logits whether it reads dense or swapped-in KV):

- ``dense``: the batched ``Scheduler`` on a DSA cache (every token of a running request on the
  device, prefixes restored host -> device);
- ``hisparse``: the ``SparseScheduler`` on a HiSparse DSA cache (a running request holds a
  fixed buffer of ``--buffer`` slots and a page; prefixes come from host into prefill staging
  rows, decode swaps each layer's selected tokens in from host).

Per way: device slots a running request holds (mean and peak over decode steps), the same as
MiB at the DeepSeek-V3.2 geometry's bytes per token (61 layers, 1,152 B latent + 132 B indexer
key per token and layer; HiSparse also keeps every token's indexer key on the device), the
host -> device bytes per turn (dense: the prefix loads; HiSparse: the staging copies plus the
swapped-in latents), wall seconds per step, and whether both ways chose the same tokens with
bitwise-equal logits. The load average is recorded.

Run::

    .venv/bin/python benchmarks/bench_hisparse_serving.py --quick
    .venv/bin/python benchmarks/bench_hisparse_serving.py --json hisparse_serving.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from tiered_kv.bench import machine, report
from tiered_kv.cache import TieredKVCache
from tiered_kv.cache.hisparse_serving import HiSparseServing
from tiered_kv.config import TieredKVConfig
from tiered_kv.engine.batch_state import SchedulerConfig
from tiered_kv.engine.dsa import DSAModelConfig
from tiered_kv.engine.hisparse_model import SparseDSA
from tiered_kv.engine.scheduler import Scheduler
from tiered_kv.engine.sparse_scheduler import SparseScheduler

V32_LAYERS, V32_LATENT, V32_INDEX = 61, 1152, 132  # DeepSeek-V3.2: bytes per token and layer
C = report.Column
COLUMNS = [
    C("way", 9, left=True), C("turns", 5), C("slots/req", 9, ".1f"), C("peak", 5),
    C("V3.2 MiB/req", 12, ".1f"), C("h->d MiB/turn", 13, ".3f"), C("ms/step", 8, ".1f"),
    C("same", 4, left=True),
]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--convos", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system", type=int, default=96, help="shared system prompt tokens")
    p.add_argument("--user", type=int, default=24, help="new user tokens per turn")
    p.add_argument("--decode", type=int, default=24, help="tokens generated per turn")
    p.add_argument("--buffer", type=int, default=32, help="HiSparse buffer slots per request")
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="3 conversations, 2 turns")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.quick:
        a.convos, a.turns = 3, 2
    return a


def model_for(args) -> SparseDSA:
    return SparseDSA(
        DSAModelConfig(
            vocab_size=256,
            hidden=32,
            num_layers=2,
            num_heads=2,
            intermediate=48,
            seed=7,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            index_head_dim=128,
            index_topk=args.topk,
        )  # fmt: skip
    )


def cache_for(args, model: SparseDSA, path: str, hisparse: bool) -> TieredKVCache:
    c = model.cfg
    longest = args.system + args.turns * (args.user + args.decode) + 8
    return TieredKVCache(
        TieredKVConfig.flat(
            model="dsa",
            num_layers=c.num_layers,
            kv_lora_rank=c.kv_lora_rank,
            qk_rope_head_dim=c.qk_rope_head_dim,
            index_head_dim=c.index_head_dim,
            dtype="float32",
            page_size=8,
            device_tokens=max(512, 2 * longest // 8 * 8),
            hisparse_logical_ratio=4 if hisparse else 0,
            host_tokens=8192,
            storage_bytes=0,
            model_id="bench-hisparse@1",
            max_requests=args.convos + 1,
            max_context_len=longest + 64,
            prefetch_threshold=8,
        )  # fmt: skip
    )


def serve(args, model: SparseDSA, hisparse: bool) -> dict:
    rng = random.Random(3)
    system = [rng.randrange(1, 256) for _ in range(args.system)]
    histories = [system + [rng.randrange(1, 256) for _ in range(8)] for _ in range(args.convos)]
    cfg = SchedulerConfig(chunk_size=64, max_prefill_tokens=512, max_running=args.convos)
    cfg = SchedulerConfig(**{**vars(cfg), "record_logits": True})
    with tempfile.TemporaryDirectory() as tmp:
        cache = cache_for(args, model, tmp, hisparse)
        try:
            if hisparse:
                serving = HiSparseServing(cache, args.buffer)
                sched = SparseScheduler(serving, model, cfg)
            else:
                sched = Scheduler(cache, model, cfg)
            held, steps, logits, tokens = [], 0, [], []
            t0 = time.perf_counter()
            for _ in range(args.turns):
                reqs = []
                for i, h in enumerate(histories):
                    h.extend(rng.randrange(1, 256) for _ in range(args.user))
                    reqs.append((i, sched.add(list(h), args.decode)))
                while sched.waiting or sched.running:
                    sched.step()
                    steps += 1
                    if sched.running:
                        held.append(held_per_request(sched, hisparse) / len(sched.running))
                for i, r in reqs:
                    histories[i].extend(r.output)
                    tokens.append(r.output)
                    logits.append(torch.stack(r.logits))
            wall = time.perf_counter() - t0
            st = cache.stats()
            moved = host_to_device_bytes(cache, st, sched, hisparse)
        finally:
            cache.close()
    per_token = V32_LAYERS * (V32_LATENT + V32_INDEX)
    context = statistics.mean(len(h) for h in histories)
    slots = statistics.mean(held) if held else 0.0
    v32 = slots * per_token + (context * V32_LAYERS * V32_INDEX if hisparse else 0)
    return {
        "way": "hisparse" if hisparse else "dense", "turns": args.turns, "slots": slots,
        "peak": max(held, default=0), "v32_mib": v32 / 2**20,
        "h2d_mib_turn": moved / args.turns / 2**20, "ms_step": 1e3 * wall / max(1, steps),
        "tokens": tokens, "logits": logits,
    }  # fmt: skip


def held_per_request(sched, hisparse: bool) -> int:
    if hisparse:
        return sched.held_slots()[0]
    ps = sched.page_size
    return sum(-(-len(r.cache_req.tokens) // ps) * ps for r in sched.running)


def host_to_device_bytes(cache, st: dict, sched, hisparse: bool) -> float:
    pool = cache.device_pool
    per_token = pool.layer_num * (pool.kv_cache_dim * 4 + pool.index_row_bytes)
    if not hisparse:
        return float(st["transfer"]["host_to_device"]["bytes"])
    c = sched.serving.counts
    return c["prefix_tokens"] * per_token + c["swap_loaded"] * pool.kv_cache_dim * 4


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    info = machine.machine_info()
    print("\n".join(machine.condition_lines(info)))
    torch.set_num_threads(1)
    model = model_for(args)
    rows = [serve(args, model, hisparse) for hisparse in (False, True)]
    same = rows[0]["tokens"] == rows[1]["tokens"] and all(
        torch.equal(a, b) for a, b in zip(rows[0]["logits"], rows[1]["logits"], strict=True)
    )
    for r in rows:
        r["same"] = same
        del r["logits"], r["tokens"]
    cells = [
        [r["way"], r["turns"], r["slots"], r["peak"], r["v32_mib"], r["h2d_mib_turn"],
         r["ms_step"], "yes" if same else "NO"]
        for r in rows
    ]  # fmt: skip
    print()
    print("\n".join(report.fixed_table(COLUMNS, cells)))
    load = watch.finish()
    print(f"\nload average during the run: {load}")
    report.write_json(
        args.json, {"rows": rows, **load}, config=report.config_of(args), machine=info
    )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
