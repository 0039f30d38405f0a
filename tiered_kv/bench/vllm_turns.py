"""vLLM's CPU engine on a multi-turn long-prefix workload, with and without tiered_kv's connector,
one engine process per configuration, all in one run (``benchmarks/bench_vllm.py``).

The workload: ``conversations`` conversations, each opening with one shared system prompt and
a context of its own; every later turn's prompt is the previous turn's prompt, its output and
``user_tokens`` new tokens (random ids, fixed by the seed). Every turn is one batch of all the
conversations (``LLM.generate``), greedy, ``output_tokens`` tokens each (EOS ignored). The
configurations (``CONFIGS``):

- ``a recompute``: vLLM alone, prefix caching off: every turn computes its whole prompt;
- ``b vllm-pc``: vLLM's own prefix caching (hits resident in its KV cache);
- ``c tiered``: the connector, vLLM's prefix caching off: every hit is loaded from tiered_kv's
  host tier (or its store);
- ``d restart`` / ``d restart+pc``: a new engine process over a copy of ``c``'s store as ``c``
  left it (its host tier and vLLM's cache empty), prefix caching off / on, continuing ``c``'s
  conversations for ``restart_turns`` more turns: its first turn's prefixes can only come from
  the store. ``a`` and ``b`` run those turns too (``turns + restart_turns`` in all), ``c`` stops
  at ``turns``.

Every engine runs one untimed warm-up batch first (the first turn's prompt lengths, tokens of
their own: no hit on the workload), so a turn's TTFT is never a new engine's first batch: the
restart turn measures the store, not the engine's cold kernels; the counters start after it.
Every engine of a run gets the same ``EngineSetup`` (``vllm_models``: model, dtype, block size,
tensor parallelism and thread binding). For a model with recurrent state (Qwen3-Next: vLLM's
``align`` mode needs prefix caching) ``c tiered`` and ``d restart`` run with vLLM's prefix
caching on and reset between turns (``Config.caching``), so their later turns' hits are still
the connector's (vLLM's cache reset leaves the connector's tiers as they are); ``a`` stays
prefix caching off, ``b`` and ``d restart+pc`` on without a reset.

Per configuration and turn: TTFT p50 / p99 (vLLM's per-request ``first_token_latency``, arrival
to first token, so a batch's later requests wait for its earlier prefills; p99 is nearest rank,
the slowest request below 100), prefill tokens computed (prompt tokens minus
``num_cached_tokens``), the tokens hit (vLLM's ``num_cached_tokens``: its own cache's and the
connector's), the blocks the connector loaded from its host tier and from its store, output
tokens per second of the turn's wall time.

The connector's cost per block is its timing counters over its block counters in each connector
engine: store read per block loaded from the store, host -> block copy per block loaded,
block -> host copy per block saved, store write per page written. vLLM's own prefill cost per
block is measured in ``a``'s engine after its turns: single prompts of ``calibrate_lengths``
tokens, one at a time, one output token each, ``calibrate_repeats`` times, the lengths
interleaved in a seeded order after one untimed call per length; the marginal cost is the
least-squares slope of median TTFT over prompt length (times the block size) with its standard
error, not used (``resolved`` False) unless above zero by twice that, the mean
cost the longest prompt's median TTFT over its blocks. Counters come from the engine's
Prometheus registry (``vllm_engine``). Bytes per hit token (``vllm_costs.byte_row``): the
connector's ``loaded_bytes`` over the tokens vLLM took from it, against every KV layer loaded in
full (``vllm_models.kv_bytes_per_token`` of the model's ``config.json``): a sliding-window layer
loads only its in-window pages.

The whole sequence runs ``rounds`` times (fresh engines and stores each round); a row is the
median over rounds of each figure, a cost the median of the rounds' costs, and the calibration
pools every round's samples: on a shared machine a neighbour can slow one engine's run several
times over, and an engine process cannot be interleaved with another."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from tiered_kv.bench import machine
from tiered_kv.bench.timing import median, nearest_rank
from tiered_kv.bench.vllm_costs import (
    ByteRow,
    CostRow,
    PrefillCost,
    byte_row,
    cost_rows,
    median_byte_row,
    prefill_cost,
    with_ratios,
)
from tiered_kv.bench.vllm_engine import EngineError, follow, run_engine
from tiered_kv.bench.vllm_models import EngineSetup, kv_bytes_per_token

FIRST_ID = 3  # below: <s>, </s>, <pad>
HOST_BYTES = 256 << 20
STORE_BYTES = 2 << 30


@dataclass(frozen=True)
class Workload:
    """The conversations' shape; ``turns`` before the restart, ``restart_turns`` after it."""

    conversations: int = 8
    system_tokens: int = 512
    context_tokens: int = 384
    user_tokens: int = 96
    output_tokens: int = 32
    turns: int = 4
    restart_turns: int = 2
    block_size: int = 32
    vocab: int = 512
    seed: int = 1

    @property
    def all_turns(self) -> int:
        return self.turns + self.restart_turns

    def max_model_len(self) -> int:
        longest = self.system_tokens + self.context_tokens + self.all_turns * self.output_tokens
        longest += (self.all_turns - 1) * self.user_tokens
        return -(-longest // self.block_size) * self.block_size

    def tokens(self) -> tuple[list[list[int]], list[list[list[int]]]]:
        """(first-turn prompts, appends[turn][conversation]) with appends[0] empty."""
        rng = random.Random(self.seed)

        def draw(n: int) -> list[int]:
            return [rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]

        system = draw(self.system_tokens)
        first = [system + draw(self.context_tokens) for _ in range(self.conversations)]
        appends = [[]] + [
            [draw(self.user_tokens) for _ in range(self.conversations)]
            for _ in range(1, self.all_turns)
        ]
        return first, appends


@dataclass(frozen=True)
class Config:
    """One engine: with the connector or not, vLLM's prefix caching on or off, a restart."""

    name: str
    connector: bool
    prefix_caching: bool
    restart: bool = False

    def caching(self, resets: bool) -> tuple[bool, bool]:
        """(vLLM's prefix caching on, reset before every later turn) of this engine; ``resets``
        (``EngineSetup.resets_prefix_cache``): a connector engine without vLLM's prefix caching
        runs with it on and reset instead."""
        if resets and self.connector and not self.prefix_caching:
            return True, True
        return self.prefix_caching, False


CONFIGS = (
    Config("a recompute", False, False),
    Config("b vllm-pc", False, True),
    Config("c tiered", True, False),
    Config("d restart", True, False, restart=True),
    Config("d restart+pc", True, True, restart=True),
)


@dataclass
class TurnRow:
    """One configuration's turn (1-based, counted across the restart)."""

    config: str
    turn: int
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    prompt_tokens: int
    prefill_tokens: int
    hit_tokens: int
    host_blocks: int
    store_blocks: int
    output_tokens: int
    out_tok_s: float
    wall_s: float


@dataclass
class VllmResult:
    rows: list[TurnRow]
    costs: list[CostRow]
    prefill: PrefillCost | None
    engines: dict[str, dict] = field(default_factory=dict)
    loads: dict = field(default_factory=dict)
    rounds: int = 1
    per_round: list[TurnRow] = field(default_factory=list)
    bytes: list[ByteRow] = field(default_factory=list)
    setup: EngineSetup = field(default_factory=EngineSetup)


def kv_config(
    store: Path, model_id: str, load_mode: str = "async", gil_switch_us: int | None = None
) -> dict:
    extra = {} if gil_switch_us is None else {"gil_switch_us": gil_switch_us}
    return {
        "kv_connector": "TieredKVConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "model_id": model_id, "storage_path": str(store), "storage_bytes": STORE_BYTES,
            "host_bytes": HOST_BYTES, "load_mode": load_mode, **extra,
        },
    }  # fmt: skip


def _turn_specs(w: Workload, first: list, appends: list, start: int, stop: int) -> list[list]:
    """Turns ``start``..``stop - 1`` (0-based), the first given as ``first`` prompts."""
    specs = [first]
    for t in range(start + 1, stop):
        specs.append([follow(t - start - 1, i, appends[t][i]) for i in range(w.conversations)])
    return specs


def turn_row(config: str, turn: int, result: dict, before: dict) -> TurnRow:
    outs, after = result["outputs"], result["counters"]
    ttfts = [o["ttft_s"] * 1e3 for o in outs]
    prompt = sum(len(o["prompt_token_ids"]) for o in outs)
    hit = sum(o["num_cached_tokens"] for o in outs)
    output = sum(len(o["token_ids"]) for o in outs)

    def delta(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    return TurnRow(
        config, turn, len(outs), median(ttfts), nearest_rank(ttfts, 0.99), prompt, prompt - hit,
        hit, delta("loaded_host_blocks"), delta("loaded_store_blocks"), output,
        output / result["wall_s"], result["wall_s"],
    )  # fmt: skip


def _run_config(
    cfg, w, model_dir, round_dir: Path, c_result, *, model_id, setup: EngineSetup, **engine
) -> dict:
    """One configuration's engine (a restart continues ``c_result``'s conversations); an
    ``EngineError`` where vLLM ran with another block size than the workload's."""
    first, appends = w.tokens()
    store = round_dir / ("store-" + cfg.name.replace(" ", "-").replace("+", "-"))
    if cfg.restart:
        start = [o["prompt_token_ids"] + o["token_ids"] + appends[w.turns][i]
                 for i, o in enumerate(c_result["turns"][-1]["outputs"])]  # fmt: skip
        specs = _turn_specs(w, start, appends, w.turns, w.all_turns)
        shutil.copytree(round_dir / "store-c-tiered", store)
    else:
        specs = _turn_specs(w, first, appends, 0, w.turns if cfg.connector else w.all_turns)
    caching, reset = cfg.caching(setup.resets_prefix_cache)
    log = round_dir / (store.name.removeprefix("store-") + ".log")
    result = run_engine(
        model_dir, specs, max_tokens=w.output_tokens, block_size=setup.engine_block_size,
        kv_transfer_config=(
            kv_config(store, model_id, setup.load_mode, setup.gil_switch_us)
            if cfg.connector
            else None
        ),
        enable_prefix_caching=caching, reset_prefix_cache=reset,
        engine_args=setup.engine_args(), env=setup.env(), multiprocessing=setup.multiprocessing,
        log_path=log, **engine,
    )  # fmt: skip
    if result.get("block_size") != w.block_size:
        raise EngineError(
            f"{cfg.name}: vLLM ran with block size {result.get('block_size')}, the workload "
            f"prices and counts blocks of {w.block_size}: give the workload vLLM's (log: {log})"
        )
    return result


def _round(w, model_dir, round_dir: Path, calibrate, parallel: bool, engine: dict, say):
    """One round: every configuration's engine result and the load average at its start."""
    results: dict[str, dict] = {}
    loads: dict[str, tuple | None] = {}

    def run(cfg: Config) -> None:
        loads[cfg.name] = machine.load_average()
        say(f"{round_dir.name}: {cfg.name} (load average {loads[cfg.name]})")
        results[cfg.name] = _run_config(
            cfg, w, model_dir, round_dir, results.get("c tiered"),
            calibrate=calibrate if cfg.name == "a recompute" else (), **engine,
        )  # fmt: skip

    if parallel:  # the restarts after the rest: they copy c's store
        for wave in ([c for c in CONFIGS if not c.restart], [c for c in CONFIGS if c.restart]):
            with ThreadPoolExecutor(len(wave)) as pool:
                list(pool.map(run, wave))
    else:
        for cfg in CONFIGS:
            run(cfg)
    return results, loads


def _median_rows(rows: Sequence, key: Callable, make: Callable) -> list:
    """Rows grouped by ``key`` (in first-seen order), each field the median over the group."""
    groups: dict = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    return [make(k, g) for k, g in groups.items()]


def _median_turn(key, group: list[TurnRow]) -> TurnRow:
    nums = {f: median([getattr(r, f) for r in group]) for f in TurnRow.__dataclass_fields__
            if f not in ("config", "turn")}  # fmt: skip
    ints = ("requests", "prompt_tokens", "prefill_tokens", "hit_tokens", "host_blocks",
            "store_blocks", "output_tokens")  # fmt: skip
    return TurnRow(*key, **{f: round(v) if f in ints else v for f, v in nums.items()})


def measure_vllm(
    model_dir: str | Path,
    workload: Workload,
    *,
    workdir: str | Path,
    model_id: str,
    rounds: int = 1,
    calibrate_lengths: Sequence[int] = (128, 256, 512, 768, 1024),
    calibrate_repeats: int = 3,
    setup: EngineSetup | None = None,
    timeout: float = 600.0,
    parallel: bool = False,
    progress: Callable[[str], None] | None = None,
) -> VllmResult:
    """``rounds`` rounds of every configuration of ``CONFIGS``, each in its own engine process,
    one after another; a row is the median over rounds (``per_round`` keeps each).
    ``setup`` (default: a float32 Llama's, blocks of ``workload.block_size``) is every
    engine's; its block size must be the workload's (ValueError). ``parallel`` runs the engines
    of a round at once (the restarts after the rest), for tests: their timings then measure
    each other."""
    say = progress or (lambda _msg: None)
    w, work = workload, Path(workdir)
    setup = setup or EngineSetup(block_size=w.block_size)
    if setup.block_size != w.block_size:
        raise ValueError(
            f"setup.block_size={setup.block_size} but workload.block_size={w.block_size}: "
            "the workload prices and counts the engines' blocks, give both the same"
        )
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    full_per_token = kv_bytes_per_token(hf_config, setup.dtype)
    rng = random.Random(f"{w.seed}:calibrate")
    calibrate = [
        [rng.randrange(FIRST_ID, w.vocab) for _ in range(n)]
        for _ in range(calibrate_repeats)
        for n in calibrate_lengths
    ]
    rng.shuffle(calibrate)  # lengths interleaved: no length always runs first
    first, _ = w.tokens()
    warm_rng = random.Random(f"{w.seed}:warmup")
    warmup = [[warm_rng.randrange(FIRST_ID, w.vocab) for _ in p] for p in first]
    longest = max(w.max_model_len(), max(calibrate_lengths, default=0) + 1)
    engine = {"max_model_len": -(-longest // w.block_size) * w.block_size, "model_id": model_id,
              "setup": setup, "timeout": timeout, "warmup": warmup}  # fmt: skip
    watch = machine.LoadWatch()
    rows: list[TurnRow] = []
    costs: list[CostRow] = []
    hit_bytes: list[ByteRow] = []
    samples: list[dict] = []
    engines: dict[str, dict] = {}
    for n in range(rounds):
        round_dir = work / f"round{n + 1}"
        round_dir.mkdir(parents=True, exist_ok=True)
        results, loads = _round(w, model_dir, round_dir, calibrate, parallel, engine, say)
        for cfg in CONFIGS:
            result = results[cfg.name]
            warm = result.get("warmup_counters") or {}
            before: dict = warm  # the warm-up batch is no turn's
            offset = w.turns if cfg.restart else 0
            for t, turn in enumerate(result["turns"]):
                rows.append(turn_row(cfg.name, offset + t + 1, turn, before))
                before = turn["counters"]
            if cfg.connector:
                final = {k: v - warm.get(k, 0) for k, v in result["final_counters"].items()}
                costs += cost_rows(cfg.name, final)
                hit_bytes.append(byte_row(cfg.name, final, full_per_token))
            samples += result["calibrate"]
            engines[f"{cfg.name} #{n + 1}"] = {
                "startup_s": result["startup_s"], "warmup_s": result.get("warmup_s"),
                "torch_threads": result["torch_threads"],
                "load_before": loads[cfg.name], "final_counters": result["final_counters"],
            }  # fmt: skip
    prefill = prefill_cost(samples, w.block_size)
    prefill_us = prefill.marginal_us_per_block if prefill and prefill.resolved else None

    def median_cost(key, group: list[CostRow]) -> CostRow:
        blocks = round(median([r.blocks for r in group]))
        return CostRow(*key, blocks, median([r.us_per_block for r in group]), None)

    order = [c.name for c in CONFIGS]
    by_turn = _median_rows(rows, lambda r: (r.config, r.turn), _median_turn)
    by_turn.sort(key=lambda r: (r.turn, order.index(r.config)))
    return VllmResult(
        by_turn,
        with_ratios(_median_rows(costs, lambda r: (r.config, r.op), median_cost), prefill_us),
        prefill,
        engines, watch.finish(), rounds, rows,
        _median_rows(hit_bytes, lambda r: r.config, median_byte_row), setup,
    )  # fmt: skip
