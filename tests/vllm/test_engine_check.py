"""``check_engine``'s parallel-layout rules on stand-in configs (no engine started): tensor and
pipeline parallelism are served with async loads; layer-wise loads under them and context
parallelism are refused by name, before anything is allocated. Also ``parallel_rank``'s names.
Runs in the vLLM venv (the connector module imports vLLM)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tiered_kv.errors import InvalidArgumentError


def spec_of(name: str, block_size: int = 16, **attrs):
    return type(name, (), {"block_size": block_size, **attrs})()


def engine(tp=1, pp=1, dcp=1, pcp=1, policy="recompute", spec="FullAttentionSpec", groups=1,
           specs=None):  # fmt: skip
    specs = specs or [spec_of(spec, sliding_window=64) for _ in range(groups)]
    return (
        SimpleNamespace(
            kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy),
            parallel_config=SimpleNamespace(
                tensor_parallel_size=tp, pipeline_parallel_size=pp,
                decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
            ),
            cache_config=SimpleNamespace(cache_dtype="auto"),
        ),
        SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs]),
    )  # fmt: skip


def settings(load_mode: str):
    from tiered_kv.integrations.vllm.settings import read_settings

    extra = {"model_id": "m@1", "storage_path": "/nonexistent", "storage_bytes": 1 << 30}
    return read_settings({**extra, "load_mode": load_mode})


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_tensor_and_pipeline_parallel_are_served_with_async_loads(tp, pp):
    from tiered_kv.integrations.vllm.connector import check_engine

    check_engine(*engine(tp, pp), settings("async"))
    if tp * pp == 1:
        check_engine(*engine(tp, pp), settings("layerwise"))


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_layerwise_loads_under_parallelism_are_refused_by_name(tp, pp):
    from tiered_kv.integrations.vllm.connector import check_engine

    with pytest.raises(InvalidArgumentError, match=r"load_mode='layerwise'.*use load_mode='async'"):
        check_engine(*engine(tp, pp), settings("layerwise"))


@pytest.mark.parametrize("field", ["dcp", "pcp"])
def test_context_parallelism_is_refused_by_name(field):
    from tiered_kv.integrations.vllm.connector import check_engine

    with pytest.raises(InvalidArgumentError, match="context_parallel_size=2"):
        check_engine(*engine(**{field: 2}), settings("async"))


def test_other_refusals_still_name_their_field():
    from tiered_kv.integrations.vllm.connector import check_engine

    with pytest.raises(InvalidArgumentError, match="kv_load_failure_policy='fail'"):
        check_engine(*engine(policy="fail"), settings("async"))


def test_hybrid_groups_are_served_and_their_limits_refused_by_name():
    from tiered_kv.integrations.vllm.connector import check_engine
    from tiered_kv.integrations.vllm.groups import GroupKind

    window = spec_of("SlidingWindowSpec", 32, sliding_window=64, extra_retained_tokens=3)
    state = spec_of("MambaSpec", 32, mamba_cache_mode="align")
    full = spec_of("FullAttentionSpec", 32)
    grid = check_engine(*engine(specs=[window, full, state]), settings("async"))
    assert [p.kind for p in grid.groups] == [GroupKind.WINDOW, GroupKind.FULL, GroupKind.STATE]
    assert grid.groups[0].window == 64 and grid.groups[0].retained == 3 and grid.hybrid
    assert not check_engine(*engine(), settings("layerwise")).hybrid
    with pytest.raises(InvalidArgumentError, match=r"load_mode='layerwise' with KV cache groups"):
        check_engine(*engine(specs=[window, full]), settings("layerwise"))
    with pytest.raises(InvalidArgumentError, match="ChunkedLocalAttentionSpec"):
        check_engine(*engine(specs=[spec_of("ChunkedLocalAttentionSpec"), full]), settings("async"))
    with pytest.raises(InvalidArgumentError, match="mamba_cache_mode='none'.*--enable-prefix"):
        none = spec_of("MambaSpec", 32, mamba_cache_mode="none")
        check_engine(*engine(specs=[none, full]), settings("async"))
    mamba2 = spec_of(
        "MambaSpec", 32, mamba_cache_mode="align", mamba_type=SimpleNamespace(name="MAMBA2")
    )
    config, kv = engine(specs=[mamba2, full])
    with pytest.raises(InvalidArgumentError, match="mamba_type=MAMBA2.*CPU build"):
        check_engine(
            SimpleNamespace(**vars(config), device_config=SimpleNamespace(device_type="cpu")),
            kv,
            settings("async"),
        )
    assert check_engine(config, kv, settings("async")).hybrid  # a GPU build serves it
    with pytest.raises(InvalidArgumentError, match=r"block sizes \[16, 32\]"):
        check_engine(*engine(specs=[spec_of("FullAttentionSpec", 16), full]), settings("async"))


def test_rank_names(monkeypatch):
    import vllm.distributed.parallel_state as ps

    from tiered_kv.integrations.vllm.connector import parallel_rank

    assert parallel_rank(engine()[0].parallel_config) is None  # one worker: unchanged pages
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 1)
    monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    assert parallel_rank(engine(2, 2)[0].parallel_config) == "tp1of2-pp0of2"
