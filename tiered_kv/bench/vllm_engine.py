"""One vLLM offline engine in a child process, for ``bench_vllm``: turns of token-id prompts, each
request's first-token latency and cache hit, and the engine's counters after every turn, vLLM's
own and the connector's.

The child is this module run as a script (vLLM's CPU engine must be built under ``__main__``); it
reads a JSON spec and writes a JSON result. A prompt of a later turn may be ``{"follow": [turn,
index], "append": [...]}``: that request's prompt, then its output, then ``append`` (a
multi-turn conversation without a callable crossing the process boundary). ``calibrate`` runs
after the turns: single requests of given lengths, one at a time, one output token each (their
first-token latencies price vLLM's own prefill). The connector's counters are read from the
Prometheus registry of the engine's process (where vLLM's ``PrometheusStatLogger`` puts a
connector's metrics also offline; ``LLM.get_metrics`` reads only the ``vllm:`` families).
A last one-token request shorter than a block (``flush``) makes the engine step once more after
the turns, so that counters the worker took after the final step of the last turn (store writes
finish on a thread) are reported.

Greedy outputs ignoring EOS, so every request generates exactly ``max_tokens`` tokens. The
environment, ``follow`` and the process-group handling are shared with the tests' engine helper
(``tests/vllm/engine_proc.py``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

# Nothing is downloaded; the CPU KV cache is sized in GiB (1 is a million tokens of a tiny
# model; vLLM's default is a share of RAM). The host IP is the loopback: `make test` runs in a
# namespace where nothing else is up. Usage stats would try the network.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}
CONNECTOR_PREFIX = "tiered_kv_vllm_"
VLLM_COUNTERS = (
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
)  # fmt: skip
LOG_TAIL = 4000
MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class EngineError(RuntimeError):
    """The child engine failed or ran past its timeout; the message ends with its log."""


def follow(turn: int, index: int, append: Sequence[int] = ()) -> dict:
    """A later turn's prompt: request ``index`` of ``turn``'s prompt + output + ``append``."""
    return {"follow": [turn, index], "append": list(append)}


def run_engine(
    model_dir: str | Path,
    turns: Sequence[Sequence[Sequence[int] | dict]],
    *,
    max_tokens: int,
    max_model_len: int,
    kv_transfer_config: dict | None = None,
    enable_prefix_caching: bool = False,
    reset_prefix_cache: bool = False,
    block_size: int | None = 32,
    engine_args: dict | None = None,
    env: dict | None = None,
    calibrate: Sequence[Sequence[int]] = (),
    warmup: Sequence[Sequence[int]] = (),
    multiprocessing: bool = False,
    timeout: float = 600.0,
    log_path: str | Path | None = None,
) -> dict:
    """Run ``warmup``, ``turns`` then ``calibrate`` in a fresh child engine.

    ``warmup``: one batch of prompts (``max_tokens`` each) before the turns, untimed, so a new
    engine's first batch (its kernels' first calls at these shapes) is not the first turn's;
    ``warmup_counters`` are the counters after it. ``calibrate``: single prompts, one output
    token each; every distinct length runs once untimed first (the engine's first call at a
    prompt length is slower), then the given ones in the given order.

    ``block_size`` None lets vLLM pick it (a model with recurrent state does);
    ``engine_args`` go to ``vllm.LLM`` last (over ``dtype="float32"``, ``enforce_eager``);
    ``env`` is added to the child's environment (e.g. vLLM's CPU thread binding);
    ``reset_prefix_cache`` empties vLLM's prefix cache before every turn but the first (the
    connector's tiers keep theirs), so later turns' hits are the connector's.

    Returns ``{"turns": [{"outputs", "wall_s", "counters"}], "calibrate": [{"prompt_tokens",
    "ttft_s"}], "warmup_counters", "warmup_s", "final_counters", "startup_s", "torch_threads",
    "block_size"}`` (the worker's
    torch threads, None under ``multiprocessing``, where the worker is another process; the
    block size vLLM ran with); an output is ``{"prompt_token_ids", "token_ids",
    "num_cached_tokens", "ttft_s"}``. ``counters`` are cumulative: vLLM's (``VLLM_COUNTERS``,
    external hits split by label) and the connector's (``tiered_kv_vllm_*`` without the
    prefix). Raises ``EngineError`` with the child's log."""
    spec = {
        "model": str(model_dir),
        "turns": [[p if isinstance(p, dict) else list(p) for p in turn] for turn in turns],
        "calibrate": [list(p) for p in calibrate],
        "warmup": [list(p) for p in warmup],
        "max_tokens": max_tokens,
        "max_model_len": max_model_len,
        "kv_transfer_config": kv_transfer_config,
        "enable_prefix_caching": enable_prefix_caching,
        "reset_prefix_cache": reset_prefix_cache,
        "block_size": block_size,
        "engine_args": engine_args or {},
    }
    env = {**os.environ, **ENGINE_ENV, **(env or {})}
    env[MP_ENV] = "1" if multiprocessing else "0"
    with tempfile.TemporaryDirectory(prefix="tkv-vllm-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        log = Path(log_path) if log_path else Path(tmp) / "engine.log"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)]
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(
                cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.wait(timeout=30)
                raise EngineError(
                    f"the engine ran past {timeout}s; its log:\n{log_tail(log)}"
                ) from None
            finally:
                kill_group(proc)  # whatever of vLLM's outlived the child
        if rc != 0 or not out_path.exists():
            raise EngineError(f"the engine exited with {rc}; its log:\n{log_tail(log)}")
        return json.loads(out_path.read_text())


def log_tail(path: Path) -> str:
    """The end of a child's log (what an error message carries)."""
    try:
        return path.read_text(errors="replace")[-LOG_TAIL:]
    except OSError:
        return "(no log)"


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the child's process group (it leads one: vLLM's own children are in it too)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


# --- the child --------------------------------------------------------------------------------


def _counters() -> dict[str, float]:
    """The engine's cumulative counters from the Prometheus registry of this process."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        ours = family.name.startswith(CONNECTOR_PREFIX)
        if family.type != "counter" or not (ours or family.name in VLLM_COUNTERS):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = family.name.removeprefix(CONNECTOR_PREFIX)
            source = sample.labels.get("source")
            if source:
                name += "{" + source + "}"
            out[name] = out.get(name, 0.0) + sample.value
    return out


def _outputs(prompts, outs) -> list[dict]:
    return [
        {
            "prompt_token_ids": prompt,
            "token_ids": list(o.outputs[0].token_ids),
            "num_cached_tokens": o.num_cached_tokens or 0,
            "ttft_s": getattr(o.metrics, "first_token_latency", None),
        }
        for prompt, o in zip(prompts, outs, strict=True)
    ]


def _child(spec_path: str, out_path: str) -> None:
    start = time.perf_counter()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    kv = spec["kv_transfer_config"]
    args = {"dtype": "float32", "enforce_eager": True, "max_model_len": spec["max_model_len"]}
    if spec["block_size"]:
        args["block_size"] = spec["block_size"]
    llm = LLM(
        model=spec["model"], seed=0, enable_prefix_caching=spec["enable_prefix_caching"],
        disable_log_stats=False, kv_transfer_config=None if kv is None else KVTransferConfig(**kv),
        **{**args, **spec["engine_args"]},
    )  # fmt: skip
    ready = time.perf_counter()

    def generate(prompts, max_tokens):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return llm.generate(batch, params, use_tqdm=False)

    t0 = time.perf_counter()
    if spec["warmup"]:
        generate(spec["warmup"], spec["max_tokens"])
    warmup_s, warmup_counters = time.perf_counter() - t0, _counters()
    turns: list[dict] = []
    for turn in spec["turns"]:
        if turns and spec["reset_prefix_cache"]:  # later turns hit the connector, not vLLM
            llm.reset_prefix_cache()
        prompts = []
        for p in turn:
            if isinstance(p, dict):
                before = turns[p["follow"][0]]["outputs"][p["follow"][1]]
                p = before["prompt_token_ids"] + before["token_ids"] + p["append"]
            prompts.append(p)
        t0 = time.perf_counter()
        outs = generate(prompts, spec["max_tokens"])
        wall = time.perf_counter() - t0
        turns.append({"outputs": _outputs(prompts, outs), "wall_s": wall, "counters": _counters()})
    seen: set[int] = set()
    for prompt in spec["calibrate"]:  # each length's first call, untimed
        if len(prompt) not in seen:
            seen.add(len(prompt))
            generate([prompt[::-1]], 1)  # not the timed prompt: no cached prefix to find
    calibrate = []
    for prompt in spec["calibrate"]:
        (out,) = _outputs([prompt], generate([prompt], 1))
        calibrate.append({"prompt_tokens": len(prompt), "ttft_s": out["ttft_s"]})
    time.sleep(0.2)  # the store's write thread finishes the last turn's pages
    generate([[3]], 1)  # flush: one more step reports them (shorter than a block: no page)
    result = {
        "turns": turns,
        "calibrate": calibrate,
        "final_counters": _counters(),
        "warmup_counters": warmup_counters,
        "warmup_s": warmup_s,
        "startup_s": ready - start,
        # the worker's only where it runs in this process (no multiprocessing)
        "torch_threads": torch.get_num_threads() if os.environ.get(MP_ENV) == "0" else None,
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.rename(out_path)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
