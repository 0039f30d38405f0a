"""``bench_vllm``'s arithmetic without an engine: every layer's KV bytes per token from a model's
``config.json``, the connector's bytes per hit token from its counters, the engine setup of each
model and tensor-parallel size, and which engines keep vLLM's prefix cache."""

from __future__ import annotations

import random

import pytest

from tests.benchmarks import _load
from tiered_kv.bench import vllm_costs, vllm_models, vllm_turns

# config.json as tests/vllm/tiny_model.py writes it (the fields the arithmetic reads)
LLAMA = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64}  # fmt: skip
GEMMA3 = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32,
          "layer_types": ["sliding_attention", "full_attention"] * 2}  # fmt: skip
QWEN3_NEXT = {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32,
              "layer_types": ["linear_attention", "full_attention"] * 2}  # fmt: skip


def test_full_layer_bytes_per_token():
    # layers x KV heads x (K, V) x head size x dtype bytes
    assert vllm_models.kv_bytes_per_token(LLAMA, "float32") == 4 * 2 * 2 * 64 * 4
    assert vllm_models.kv_bytes_per_token(GEMMA3, "float32") == 2048
    # the linear-attention layers keep a recurrent state, no per-token KV
    assert vllm_models.kv_bytes_per_token(QWEN3_NEXT, "bfloat16") == 2 * 2 * 2 * 32 * 2
    no_head_dim = {k: v for k, v in LLAMA.items() if k != "head_dim"}
    assert vllm_models.kv_bytes_per_token(no_head_dim, "float32") == 4096
    with pytest.raises(ValueError, match="mamba"):
        vllm_models.kv_bytes_per_token({**GEMMA3, "layer_types": ["mamba"] * 4}, "float32")
    with pytest.raises(ValueError, match="int8"):
        vllm_models.kv_bytes_per_token(LLAMA, "int8")


def test_bytes_per_hit_token_from_counters():
    rng = random.Random(5)
    hit_blocks, block, full = rng.randint(20, 90), 32, 2048
    # Gemma-3: the full-attention group loads every hit block (2 layers), the window group two
    # in-window blocks per hit (2 layers); a page is one block of its group's layers
    hits = rng.randint(2, 9)
    page = 2 * 2 * block * 64 * 4
    counters = {
        vllm_costs.EXTERNAL_HITS: hit_blocks * block,
        "loaded_bytes": (hit_blocks + 2 * hits) * page,
        "loaded_window_blocks": 2 * hits,
        "window_skipped_blocks": hit_blocks - 2 * hits,
        "num_cached_tokens": 1,  # ignored
    }
    row = vllm_costs.byte_row("c tiered", counters, full)
    assert row.hit_tokens == hit_blocks * block
    assert row.bytes_per_token == pytest.approx((hit_blocks + 2 * hits) * page / (hit_blocks * 32))
    assert row.ratio == pytest.approx(row.bytes_per_token / full)
    assert 0.5 < row.ratio < 1
    assert row.loaded_window_blocks == 2 * hits
    assert row.window_skipped_blocks == hit_blocks - 2 * hits
    assert row.loaded_state_blocks == row.failed_load_requests == 0
    none = vllm_costs.byte_row("d restart", {"loaded_bytes": 0}, full)
    assert none.hit_tokens == 0 and none.bytes_per_token is None and none.ratio is None


def test_median_byte_row_over_rounds():
    rows = [
        vllm_costs.byte_row("c tiered", {vllm_costs.EXTERNAL_HITS: 64, "loaded_bytes": b}, 1024)
        for b in (64 * 1024, 64 * 512, 64 * 2048)
    ]
    mid = vllm_costs.median_byte_row("c tiered", rows)
    assert mid.loaded_bytes == 64 * 1024 and mid.bytes_per_token == 1024 and mid.ratio == 1


@pytest.mark.parametrize("model", vllm_models.MODELS)
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_setup(model, tp):
    s = vllm_models.engine_setup(model, tp=tp, block_size=64)
    assert s.multiprocessing == (tp > 1)
    assert s.engine_args().get("tensor_parallel_size", 1) == tp
    assert s.env() == ({"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {})
    assert f"tensor parallel {tp}" in s.layout_line({})
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=unset" in s.layout_line({})
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1," in s.layout_line({"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})
    if model == "qwen3-next":
        assert (s.dtype, s.block_size, s.engine_block_size) == ("bfloat16", 384, None)
        assert s.resets_prefix_cache
    else:
        assert (s.dtype, s.block_size, s.engine_block_size) == ("float32", 64, 64)
        assert not s.resets_prefix_cache
    with pytest.raises(ValueError, match="tp=3"):
        vllm_models.engine_setup(model, tp=3)
    assert s.load_mode == "async" and "connector load_mode async" in s.layout_line({})
    if model == "llama":
        lw = vllm_models.engine_setup(model, tp=tp, load_mode="layerwise")
        assert lw.load_mode == "layerwise" and "load_mode layerwise" in lw.layout_line({})
    else:  # layer-wise loads serve single-group models only
        with pytest.raises(ValueError, match="load_mode='layerwise'"):
            vllm_models.engine_setup(model, load_mode="layerwise")
    with pytest.raises(ValueError, match="load_mode='sync'"):
        vllm_models.engine_setup(model, load_mode="sync")


def test_the_connector_config_carries_the_load_mode(tmp_path):
    kv = vllm_turns.kv_config(tmp_path, "m@1", "layerwise")
    assert kv["kv_connector_extra_config"]["load_mode"] == "layerwise"
    default = vllm_turns.kv_config(tmp_path, "m@1")["kv_connector_extra_config"]
    assert default["load_mode"] == "async" and "gil_switch_us" not in default
    off = vllm_turns.kv_config(tmp_path, "m@1", gil_switch_us=0)["kv_connector_extra_config"]
    assert off["gil_switch_us"] == 0


def test_which_engines_keep_vllms_prefix_cache():
    caching = {c.name: c.caching(True) for c in vllm_turns.CONFIGS}
    assert caching == {
        "a recompute": (False, False), "b vllm-pc": (True, False), "c tiered": (True, True),
        "d restart": (True, True), "d restart+pc": (True, False),
    }  # fmt: skip
    assert all(c.caching(False) == (c.prefix_caching, False) for c in vllm_turns.CONFIGS)


def test_bench_vllm_arguments():
    bench = _load.load_bench("bench_vllm")
    default = bench.parse_args([])
    assert (default.model, default.tp, default.system_tokens) == ("llama", 1, 512)
    qwen = bench.parse_args(["--model", "qwen3-next", "--quick"])
    assert qwen.system_tokens + qwen.context_tokens > 2 * vllm_models.STATE_MODEL_BLOCK_SIZE
    w = bench.workload_of(qwen, vllm_models.STATE_MODEL_BLOCK_SIZE)
    assert w.block_size == 384 and w.max_model_len() % 384 == 0
    assert bench.parse_args(["--model", "qwen3-next"]).system_tokens == 768
    assert (
        bench.parse_args(["--model", "qwen3-next", "--system-tokens", "900"]).system_tokens == 900
    )
