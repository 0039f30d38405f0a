"""The engine layout every configuration of one ``bench_vllm`` run shares: which tiny model
(``MODELS``), its dtype and block size, tensor parallelism and vLLM's CPU thread binding,
multiprocessing, and how the connector's engines keep vLLM's prefix cache; and what one token
of that model's KV costs when every layer is loaded in full (``kv_bytes_per_token``, the
reference for the connector's bytes per hit token). No vLLM import."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

MODELS = ("llama", "gemma3", "qwen3-next")
# vLLM raises the tiny Qwen3-Next's block size to 384 itself (its recurrent-state page sets it)
STATE_MODEL_BLOCK_SIZE = 384
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"  # cores vLLM leaves its engine core
TP_BINDING = {2: "0|1"}  # one core per worker on this 2-core box: "auto" needs NUMA nodes
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
KV_LAYER_TYPES = ("full_attention", "sliding_attention")
NO_KV_LAYER_TYPES = ("linear_attention",)


@dataclass(frozen=True)
class EngineSetup:
    """What every engine of a run is given. ``block_size`` is the workload's (prefill pricing,
    hit accounting); ``pass_block_size`` False lets vLLM pick it (checked equal after each
    engine). ``resets_prefix_cache``: the connector's configurations without vLLM's prefix
    caching run with it on and reset between turns (Qwen3-Next: vLLM's ``align`` mode for the
    recurrent state needs prefix caching), so their later turns' hits are the connector's."""

    model: str = "llama"
    dtype: str = "float32"
    block_size: int = 32
    pass_block_size: bool = True
    tp: int = 1
    multiprocessing: bool = False
    resets_prefix_cache: bool = False
    load_mode: str = "async"  # the connector's (``kv_connector_extra_config.load_mode``)
    gil_switch_us: int | None = None  # the connector's; None: its default

    @property
    def engine_block_size(self) -> int | None:
        """The block size given to vLLM; None: vLLM picks it."""
        return self.block_size if self.pass_block_size else None

    def engine_args(self) -> dict:
        """``vllm.LLM`` keywords beyond the bench's own (model, caching, connector)."""
        args: dict = {"dtype": self.dtype}
        if self.tp > 1:
            args["tensor_parallel_size"] = self.tp
        return args

    def env(self) -> dict[str, str]:
        """Environment of every engine process (the thread binding under TP)."""
        return {BIND_ENV: TP_BINDING[self.tp]} if self.tp > 1 else {}

    def layout_line(self, environ: Mapping[str, str]) -> str:
        """How the engines' threads are laid out, for the printed notes."""
        bind = self.env().get(BIND_ENV, environ.get(BIND_ENV))
        reserved = self.env().get(RESERVED_ENV, environ.get(RESERVED_ENV))
        return (
            f"tensor parallel {self.tp}, {BIND_ENV}="
            f"{bind if bind else 'unset (vLLM picks)'}, {RESERVED_ENV}="
            f"{reserved if reserved is not None else 'unset (vLLM picks)'}, "
            f"multiprocessing {'on' if self.multiprocessing else 'off'}, connector load_mode "
            f"{self.load_mode}, gil_switch_us "
            f"{'default' if self.gil_switch_us is None else self.gil_switch_us}"
        )


def engine_setup(
    model: str = "llama",
    *,
    tp: int = 1,
    block_size: int = 32,
    multiprocessing: bool = False,
    load_mode: str = "async",
    gil_switch_us: int | None = None,
) -> EngineSetup:
    """The setup of ``model`` under ``tp``-way tensor parallelism (``tp`` > 1 turns
    multiprocessing on: one worker process per rank). ``block_size`` is the Llama's and
    Gemma-3's; Qwen3-Next's is vLLM's (``STATE_MODEL_BLOCK_SIZE``). ValueError naming the
    argument for a model, a ``tp`` or a ``load_mode`` this bench does not know (layer-wise loads
    serve single-group models only: the Llama)."""
    if model not in MODELS:
        raise ValueError(f"model={model!r}: one of {', '.join(MODELS)}")
    if load_mode not in ("async", "layerwise") or (load_mode == "layerwise" and model != "llama"):
        raise ValueError(f"load_mode={load_mode!r}: async, or layerwise with the llama model")
    if tp != 1 and tp not in TP_BINDING:
        raise ValueError(f"tp={tp}: 1 or one of {sorted(TP_BINDING)} (one core per worker)")
    multiprocessing = multiprocessing or tp > 1
    if model == "qwen3-next":
        return EngineSetup(
            model, "bfloat16", STATE_MODEL_BLOCK_SIZE, pass_block_size=False, tp=tp,
            multiprocessing=multiprocessing, resets_prefix_cache=True, gil_switch_us=gil_switch_us,
        )  # fmt: skip
    return EngineSetup(
        model, "float32", block_size, tp=tp, multiprocessing=multiprocessing, load_mode=load_mode,
        gil_switch_us=gil_switch_us,
    )  # fmt: skip


def kv_bytes_per_token(hf_config: Mapping, dtype: str) -> int:
    """Bytes of one token's K and V in every layer that keeps KV per token, from a Hugging Face
    ``config.json``: KV layers x KV heads x 2 (K, V) x head size x the bytes of ``dtype``. A
    model with ``layer_types`` counts its full- and sliding-window attention layers (a
    linear-attention layer keeps a recurrent state, no per-token KV); ValueError for a layer
    type it does not know."""
    layers = int(hf_config["num_hidden_layers"])
    types = hf_config.get("layer_types")
    if types:
        unknown = sorted(set(types) - set(KV_LAYER_TYPES) - set(NO_KV_LAYER_TYPES))
        if unknown:
            raise ValueError(
                f"layer_types {unknown}: known are {KV_LAYER_TYPES + NO_KV_LAYER_TYPES}"
            )
        layers = sum(t in KV_LAYER_TYPES for t in types[:layers])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r}: one of {', '.join(DTYPE_BYTES)}")
    return layers * kv_heads * 2 * int(head_dim) * DTYPE_BYTES[dtype]
