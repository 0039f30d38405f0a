"""vLLM's CPU engine on a multi-turn long-prefix workload: recompute, vLLM's own prefix caching,
tiered_kv's connector, and a restarted engine over the connector's store, each in its own engine
process, same run (``tiered_kv/bench/vllm_turns.py`` says what is measured). Then the
connector's measured cost per block loaded and saved against vLLM's own prefill cost per block.

Needs vLLM's CPU build, e.g. ``make vllm-venv``; run from the repository root::

    .venv-vllm/bin/python benchmarks/bench_vllm.py             # minutes
    .venv-vllm/bin/python benchmarks/bench_vllm.py --quick     # under three minutes

The model is a tiny random Llama built here (``tests/vllm/tiny_model.py``; default 4 layers,
hidden 256, 4 heads of 64, 2 KV heads, float32): its KV has a real Llama's shape and its prefill
is measurable on a CPU, its outputs mean nothing. Without vLLM it says so and exits 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXIT_NO_VLLM = 3
QUICK = {
    "conversations": 3, "system_tokens": 256, "context_tokens": 160, "user_tokens": 64,
    "output_tokens": 16, "turns": 3, "restart_turns": 1, "calibrate_lengths": "128,384,768",
    "calibrate_repeats": 2, "rounds": 1,
}  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=512, help="shared by every conversation")
    p.add_argument("--context-tokens", type=int, default=384, help="each conversation's own")
    p.add_argument("--user-tokens", type=int, default=96, help="new tokens per later turn")
    p.add_argument("--output-tokens", type=int, default=32, help="generated per request")
    p.add_argument("--turns", type=int, default=4, help="turns before the restart")
    p.add_argument("--restart-turns", type=int, default=2, help="turns after it")
    p.add_argument("--calibrate-lengths", default="128,256,512,768,1024,1536",
                   help="prompt lengths that price vLLM's prefill (comma-separated)")  # fmt: skip
    p.add_argument("--calibrate-repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="medians over this many rounds")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="head size is hidden / heads")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on CPU")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--multiprocessing", action="store_true",
                   help="vLLM's engine core and worker in processes of their own")  # fmt: skip
    p.add_argument("--workdir", default=None, help="model, stores, engine logs (default: temp)")
    p.add_argument("--json", default=None, help="write the rows and the machine here")
    p.add_argument("--quick", action="store_true", help="3 conversations, short, 1 restart turn")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    args.calibrate_lengths = [int(n) for n in str(args.calibrate_lengths).split(",") if n]
    if min(args.conversations, args.turns, args.restart_turns, args.output_tokens, args.rounds) < 1:
        p.error("--conversations, --turns, --restart-turns, --output-tokens, --rounds: >= 1")
    return args


def workload_of(args: argparse.Namespace):
    from tiered_kv.bench.vllm_turns import Workload

    names = {f.name for f in fields(Workload)}
    return Workload(**{k: v for k, v in vars(args).items() if k in names})


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means vLLM cannot run here
        print(f"vLLM does not import here ({exc!r}): `make vllm-venv` builds .venv-vllm")
        raise SystemExit(EXIT_NO_VLLM) from None
    sys.path.insert(0, str(ROOT))
    from tests.vllm.tiny_model import build_tiny_llama
    from tiered_kv.bench import machine, report
    from tiered_kv.bench import vllm_tables as tables
    from tiered_kv.bench import vllm_turns as vt
    from tiered_kv.bench.timing import median
    from tiered_kv.bench.vllm_engine import ENGINE_ENV

    os.environ.update(ENGINE_ENV)
    info = machine.machine_info()
    print("\n".join(machine.condition_lines(info)))
    w = workload_of(args)
    with tempfile.TemporaryDirectory(prefix="tkv-bench-vllm-", dir=args.workdir) as work:
        model = build_tiny_llama(
            Path(work) / "model", seed=args.seed, layers=args.layers, hidden=args.hidden,
            heads=args.heads, kv_heads=args.kv_heads, vocab=w.vocab,
            max_positions=max(4096, 2 * w.max_model_len()),
        )  # fmt: skip
        model_id = f"tiny-llama-bench@seed{args.seed}-{args.layers}x{args.hidden}"
        result = vt.measure_vllm(
            model, w, workdir=work, model_id=model_id, calibrate_lengths=args.calibrate_lengths,
            calibrate_repeats=args.calibrate_repeats, multiprocessing=args.multiprocessing,
            rounds=args.rounds, progress=print,
        )  # fmt: skip
    threads = sorted({str(e["torch_threads"]) for e in result.engines.values()})
    startup = median([e["startup_s"] for e in result.engines.values()])
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads of "
          f"{args.hidden // args.heads} ({args.kv_heads} KV), float32, block {w.block_size}; "
          f"engines' torch threads {', '.join(threads)}, median startup {startup:.1f} s, "
          f"multiprocessing {'on' if args.multiprocessing else 'off'}")  # fmt: skip
    print(f"workload: {w.conversations} conversations, system {w.system_tokens} + context "
          f"{w.context_tokens} tokens, +{w.output_tokens} out +{w.user_tokens} user per turn, "
          f"{w.turns} turns then {w.restart_turns} after the restart")  # fmt: skip
    loads = result.loads
    print(f"load average before {loads['load_before']}, after {loads['load_after']}")
    noise = machine.noise_check(loads=[loads["load_before"], loads["load_after"]])
    if noise.noisy:
        print("NOISY: " + "; ".join(noise.reasons))
    print(report.auto_table(tables.TURN_HEADS, tables.turn_table(result.rows)))
    print(f"(medians over {result.rounds} round(s); per turn one batch of every conversation; "
          "TTFT = vLLM's first_token_latency, p99 nearest rank; prefill tok = prompt - "
          "num_cached_tokens; host / store blk = blocks the connector loaded from its host "
          "tier / its store)")  # fmt: skip
    print(report.auto_table(tables.COST_HEADS, tables.cost_table(result.costs)))
    print("\n".join(tables.prefill_lines(result.prefill, w.block_size)))
    out = {
        "rows": [asdict(r) for r in result.rows],
        "per_round": [asdict(r) for r in result.per_round],
        "costs": [asdict(r) for r in result.costs],
        "prefill": asdict(result.prefill) if result.prefill else None,
        "engines": result.engines, "loads": loads, "machine": info,
        "config": report.config_of(args),
    }  # fmt: skip
    report.dump_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
