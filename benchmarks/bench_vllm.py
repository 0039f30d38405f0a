"""vLLM's CPU engine on a multi-turn long-prefix workload: recompute, vLLM's own prefix caching,
tiered_kv's connector, and a restarted engine over the connector's store, each in its own engine
process, same run (``tiered_kv/bench/vllm_turns.py`` says what is measured). Then the
connector's measured cost per block loaded and saved against vLLM's own prefill cost per block,
and its bytes loaded per hit token against loading every layer's KV in full.

Needs vLLM's CPU build, e.g. ``make vllm-venv``; run from the repository root::

    .venv-vllm/bin/python benchmarks/bench_vllm.py             # minutes
    .venv-vllm/bin/python benchmarks/bench_vllm.py --quick     # under three minutes
    .venv-vllm/bin/python benchmarks/bench_vllm.py --quick --model gemma3
    .venv-vllm/bin/python benchmarks/bench_vllm.py --quick --model qwen3-next
    .venv-vllm/bin/python benchmarks/bench_vllm.py --quick --tp 2

The model is tiny and random, built here (``tests/vllm/tiny_model.py``); its outputs mean
nothing, its KV has the real model's shape and its prefill is measurable on a CPU:

- ``--model llama`` (default): 4 layers, hidden 256, 4 heads of 64, 2 KV heads, float32, blocks
  of ``--block-size``;
- ``--model gemma3``: 4 layers, sliding-window (window 64) and full attention alternating, 2 KV
  heads of 32, float32: a hit loads the window layers' in-window pages only;
- ``--model qwen3-next``: 4 layers, gated-delta-net (recurrent state) and full attention
  alternating, bfloat16; vLLM picks its blocks (384 tokens) and its ``align`` mode needs prefix
  caching, so ``c tiered`` and ``d restart`` run with vLLM's prefix caching on and reset between
  turns (their later turns' hits are the connector's); prompts are longer by default.

``--tp 2`` runs every engine with ``tensor_parallel_size=2``, one worker process per core
(``VLLM_CPU_OMP_THREADS_BIND=0|1``), multiprocessing on. Without vLLM it says so and exits 3.
"""

from __future__ import annotations

import argparse
import json
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
# Qwen3-Next's blocks are 384 tokens: prompts several blocks long, so that hits exist
STATE_MODEL = {"system_tokens": 768, "context_tokens": 512, "user_tokens": 192}
STATE_MODEL_QUICK = {"system_tokens": 512, "context_tokens": 384, "user_tokens": 128}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from tiered_kv.bench.vllm_models import MODELS

    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--model",
        choices=MODELS,
        default="llama",
        help="tiny Llama, Gemma-3 (sliding window) or Qwen3-Next (recurrent state)",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        choices=(1, 2),
        help="tensor parallel size of every engine (2: one core per worker)",
    )
    p.add_argument(
        "--load-mode",
        choices=("async", "layerwise"),
        default="async",
        help="the connector's load_mode (layerwise: the llama model only)",
    )
    p.add_argument(
        "--gil-switch-us",
        type=int,
        default=None,
        help="the connector's gil_switch_us (0: the interpreter's 5 ms; default: the connector's)",
    )
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
    p.add_argument("--layers", type=int, default=4, help="Llama only (like the next two)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="head size is hidden / heads")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=32,
                   help="a multiple of 32 on CPU (Qwen3-Next: vLLM's, 384)")  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--multiprocessing", action="store_true",
                   help="vLLM's engine core and worker in processes of their own")  # fmt: skip
    p.add_argument("--workdir", default=None, help="model, stores, engine logs (default: temp)")
    p.add_argument("--json", default=None, help="write the rows and the machine here")
    p.add_argument("--quick", action="store_true", help="3 conversations, short, 1 restart turn")
    if p.parse_known_args(argv)[0].model == "qwen3-next":
        p.set_defaults(**STATE_MODEL)
    args = p.parse_args(argv)
    if args.quick:
        quick = {**QUICK, **(STATE_MODEL_QUICK if args.model == "qwen3-next" else {})}
        for k, v in quick.items():
            setattr(args, k, v)
    args.calibrate_lengths = [int(n) for n in str(args.calibrate_lengths).split(",") if n]
    if min(args.conversations, args.turns, args.restart_turns, args.output_tokens, args.rounds) < 1:
        p.error("--conversations, --turns, --restart-turns, --output-tokens, --rounds: >= 1")
    if args.load_mode == "layerwise" and args.model != "llama":
        p.error(f"--load-mode layerwise serves single-group models only: not --model {args.model}")
    return args


def workload_of(args: argparse.Namespace, block_size: int):
    from tiered_kv.bench.vllm_turns import Workload

    names = {f.name for f in fields(Workload)}
    given = {k: v for k, v in vars(args).items() if k in names}
    return Workload(**{**given, "block_size": block_size})


def build_model(args: argparse.Namespace, where: Path, max_positions: int) -> tuple[Path, str]:
    """The tiny model's directory and the connector's model id for it."""
    from tests.vllm import tiny_model as tiny

    if args.model == "gemma3":
        return tiny.build_tiny_gemma3(where, seed=args.seed), f"tiny-gemma3-bench@seed{args.seed}"
    if args.model == "qwen3-next":
        model = tiny.build_tiny_qwen3_next(where, seed=args.seed)
        return model, f"tiny-qwen3-next-bench@seed{args.seed}"
    model = tiny.build_tiny_llama(
        where, seed=args.seed, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, max_positions=max_positions,
    )  # fmt: skip
    return model, f"tiny-llama-bench@seed{args.seed}-{args.layers}x{args.hidden}"


def model_line(args: argparse.Namespace, model: Path, setup) -> str:
    """The model's shape from its ``config.json``, as the bench built it."""
    c = json.loads((model / "config.json").read_text())
    heads = c["num_attention_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    kinds = sorted(set(c.get("layer_types") or ["full_attention"]))
    return (
        f"model: {args.model}, {c['num_hidden_layers']} layers ({', '.join(kinds)}), hidden "
        f"{c['hidden_size']}, {heads} heads of {head_dim} ({c['num_key_value_heads']} KV), "
        f"{setup.dtype}, block {setup.block_size}"
        + ("" if setup.pass_block_size else " (vLLM's)")
        + (f", sliding window {c['sliding_window']}" if "sliding_attention" in kinds else "")
    )


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means vLLM cannot run here
        print(f"vLLM does not import here ({exc!r}): `make vllm-venv` builds .venv-vllm")
        raise SystemExit(EXIT_NO_VLLM) from None
    sys.path.insert(0, str(ROOT))
    from tiered_kv.bench import machine, report
    from tiered_kv.bench import vllm_tables as tables
    from tiered_kv.bench import vllm_turns as vt
    from tiered_kv.bench.timing import median
    from tiered_kv.bench.vllm_engine import ENGINE_ENV
    from tiered_kv.bench.vllm_models import engine_setup

    os.environ.update(ENGINE_ENV)
    info = machine.machine_info()
    print("\n".join(machine.condition_lines(info)))
    setup = engine_setup(
        args.model, tp=args.tp, block_size=args.block_size, multiprocessing=args.multiprocessing,
        load_mode=args.load_mode, gil_switch_us=args.gil_switch_us,
    )  # fmt: skip
    w = workload_of(args, setup.block_size)
    with tempfile.TemporaryDirectory(prefix="tkv-bench-vllm-", dir=args.workdir) as work:
        model, model_id = build_model(args, Path(work) / "model", max(4096, 2 * w.max_model_len()))
        described = model_line(args, model, setup)
        result = vt.measure_vllm(
            model, w, workdir=work, model_id=model_id, calibrate_lengths=args.calibrate_lengths,
            calibrate_repeats=args.calibrate_repeats, setup=setup, rounds=args.rounds,
            progress=print,
        )  # fmt: skip
    # None where the worker is a process of its own (multiprocessing): not read from here
    threads = sorted({str(e["torch_threads"]) for e in result.engines.values()})
    threads_text = "in the workers, not read" if threads == ["None"] else ", ".join(threads)
    startup = median([e["startup_s"] for e in result.engines.values()])
    print(f"{described}; engines' torch threads {threads_text}, median startup {startup:.1f} s; "
          f"every engine: {setup.layout_line(os.environ)}")  # fmt: skip
    if setup.resets_prefix_cache:
        print(tables.RESET_NOTE)
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
    print("\n".join(tables.goal_lines(result.rows, w.turns)))
    print(report.auto_table(tables.COST_HEADS, tables.cost_table(result.costs)))
    print("\n".join(tables.prefill_lines(result.prefill, w.block_size)))
    print(report.auto_table(tables.BYTE_HEADS, tables.byte_table(result.bytes)))
    print(tables.BYTE_NOTE)
    out = {
        "rows": [asdict(r) for r in result.rows],
        "per_round": [asdict(r) for r in result.per_round],
        "costs": [asdict(r) for r in result.costs],
        "bytes": [asdict(r) for r in result.bytes],
        "setup": asdict(setup),
        "prefill": asdict(result.prefill) if result.prefill else None,
        "engines": result.engines, "loads": loads, "machine": info,
        "config": report.config_of(args),
    }  # fmt: skip
    report.dump_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
