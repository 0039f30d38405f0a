"""The scale run's hisparse mode on a tiny DSA workload: the SparseScheduler over synthetic
latents and indexer keys, on the dense modes' workload and tiers. Every restored prefix and
every checked swap-in row is exact; the same requests, prompts and decoded tokens as the dense
modes; a fixed device buffer per request; a corrupted staging byte and a swap-in answering the
wrong rows are both found (the negative controls); bad configurations refused by name."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from tests.engine.test_scale_run import TINY
from tiered_kv.engine import presets as P
from tiered_kv.engine import sparse_run, synthetic_sparse
from tiered_kv.engine.kv_bytes import HiSparseBytes
from tiered_kv.engine.scale_run import default_modes, run_mode, run_scale
from tiered_kv.engine.scale_workload import ScaleConfig
from tiered_kv.engine.synthetic_sparse import SyntheticSparseDSA
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.host.hisparse_swap import HiSparseSwapper, SwapIn
from tiered_kv.kernels import native_available

SMALL_DSA = P.scaled(P.preset("deepseek-v3.2"), layers=3, kv_lora_rank=32, qk_rope_head_dim=16)
TOPK = 64


def _cfg(tmp_path, **changes) -> ScaleConfig:
    return ScaleConfig(
        SMALL_DSA, **{**TINY, **changes}, hisparse_topk=TOPK, store_dir=str(tmp_path)
    )


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    return run_scale(_cfg(tmp_path_factory.mktemp("sparse")))


def test_hisparse_serves_the_same_workload_exactly(result):
    modes = result["modes"]
    assert set(modes) == {"tiered", "device_only", "recompute", "tiered_planner", "hisparse"}
    h, t = modes["hisparse"], modes["tiered"]
    v = h["verification"]
    assert v["mismatched_tokens"] == 0 and v["checksum_failures"] == 0
    assert v["verified_tokens"] > 0 and h["hisparse"]["checked_rows"] > 0
    # The same requests, the same prompts (each turn's prompt holds the earlier answers), the
    # same decoded tokens.
    for key in ("requests", "prompt_tokens", "generated_tokens"):
        assert h[key] == t[key], key
    # Prefixes come from host (the tree keeps a sparse request's pages on host) and the store.
    assert h["hits"]["device"] == 0 and h["hits"]["host"] > 0 and h["hits"]["storage"] > 0
    s = h["hisparse"]
    assert s["swap_loaded"] > 0 and s["swap_hits"] > s["swap_loaded"]  # the buffer is reused
    assert s["swap_bytes"] == s["swap_loaded"] * (32 + 16) * 2  # bf16 latents
    assert s["serving"]["finished"] >= h["requests"] and s["failed_copies"] == 0
    assert s["serving"]["refused_device"] >= 0 and h["scheduler"]["overcommits"] == 0
    # A fixed buffer on the device: fewer bytes per request than the dense layout.
    kv = result["kv"]
    assert kv["hisparse_device_per_request"] < kv["device_per_request"]
    assert kv["hisparse_device_saved"] > kv["device_saved"]
    assert result["gains"]["hisparse_throughput_vs_tiered"] > 0
    for mode in ("tiered", "device_only"):
        assert modes[mode]["hisparse"] is None


def test_a_corrupted_staging_byte_is_found(tmp_path):
    def corrupt(cache, req):  # a byte of the first restored latent, as staged
        row = int(req.staging[0])
        buf = cache.device_pool.kv_buffer[0]
        buf[row].view(torch.uint8).view(-1)[5] ^= 0x10

    r = run_mode(_cfg(tmp_path), "hisparse", str(tmp_path), on_restored=corrupt)
    v = r["verification"]
    assert v["restores"] > 0 and v["mismatched_tokens"] >= v["restores"]
    assert v["recomputed_tokens"] > 0


def test_a_swap_in_answering_other_rows_is_found(tmp_path, monkeypatch):
    real = HiSparseSwapper.swap_in  # the model checks the request once, then calls its swapper

    def shifted(self, layer_id, positions):
        got = real(self, layer_id, positions)
        return SwapIn(got.device_slots.roll(1), got.hits, got.loaded, got.failed)

    monkeypatch.setattr(HiSparseSwapper, "swap_in", shifted)
    r = run_mode(_cfg(tmp_path, users=2, rounds=1), "hisparse", str(tmp_path))
    assert r["verification"]["mismatched_tokens"] > 0


def test_modes_and_configurations_refused_by_name(tmp_path):
    llama = P.scaled(P.preset("llama-3-8b"), layers=2, head_num=2, head_dim=32)
    cfg = ScaleConfig(llama, **TINY, store_dir=str(tmp_path))
    assert "hisparse" not in default_modes(cfg)
    assert "hisparse" in default_modes(_cfg(tmp_path))
    with pytest.raises(InvalidArgumentError, match="serves a DSA preset"):
        run_mode(cfg, "hisparse", str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="hisparse_topk=40 must be a multiple"):
        ScaleConfig(SMALL_DSA, **TINY, hisparse_topk=40)
    with pytest.raises(InvalidArgumentError, match="hisparse_topk=0"):
        ScaleConfig(SMALL_DSA, **TINY, hisparse_topk=0)


def test_hisparse_bytes():
    g = SMALL_DSA.to_geometry()
    b = HiSparseBytes(g, 16, 64, 48)
    latent, index = 3 * 48 * 2, 3 * (128 + 4)
    assert (b.latent_per_token, b.index_per_token) == (latent, index)
    assert b.device(50) == 50 * (latent + index)  # all of it fits the buffer
    assert b.device(1000) == 80 * latent + 1000 * index  # the buffer and a page
    assert b.read(30) == 30 * (latent + index) and b.read(1000) == 48 * latent + 1000 * index
    with pytest.raises(InvalidArgumentError, match="topk=65 exceeds"):
        HiSparseBytes(g, 16, 64, 65)
    with pytest.raises(InvalidArgumentError, match="not 'mha'"):
        HiSparseBytes(P.preset("llama-3-8b").to_geometry(), 16, 64, 48)


def test_run_cli_serves_deepseek_v32_with_hisparse(tmp_path, capsys):
    """``tiered-kv run --preset deepseek-v3.2``: its real geometry (61 layers), all five modes,
    the JSON's documented keys, the hisparse line and table row printed, 0 mismatched."""
    import json

    from tests.cli.test_cli_json import _check_documented_keys
    from tiered_kv.cli.main import main

    path = tmp_path / "v32.json"
    argv = ["run", "--preset", "deepseek-v3.2", "--scale", "1", "--users", "3"]
    argv += ["--active-users", "2", "--docs", "2", "--rounds", "2", "--system-tokens", "32"]
    argv += ["--doc-tokens", "96", "--question-tokens", "16", "--answer-tokens", "8"]
    argv += ["--page-size", "16", "--chunk-tokens", "128", "--hisparse-topk", "48"]
    argv += ["--store-dir", str(tmp_path), "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    res = json.loads(path.read_text())
    _check_documented_keys("run", res)
    assert set(res["modes"]) == {
        "tiered", "device_only", "recompute", "tiered_planner", "hisparse",
    }  # fmt: skip
    h = res["modes"]["hisparse"]
    assert h["verification"]["mismatched_tokens"] == 0 and h["hisparse"]["topk"] == 48
    assert h["generated_tokens"] == res["modes"]["tiered"]["generated_tokens"]
    assert "hisparse: buffer 48 latents + a page" in out
    assert "device MiB per request (hisparse)" in out and "hisparse vs tiered:" in out


def _in_mode(monkeypatch, mode: str) -> None:
    """Run the hisparse mode with ``copy_mode=mode``, its checks in chunks of 7 rows (most
    checks span several, the last one partial)."""
    if mode == "blocks" and not native_available():
        pytest.skip("the native copier does not build here")
    monkeypatch.setattr(synthetic_sparse, "CHECK_CHUNK", 7)
    model = partial(SyntheticSparseDSA, copy_mode=mode)
    monkeypatch.setattr(sparse_run, "SyntheticSparseDSA", model)


def test_every_copy_mode_checks_the_same_rows(tmp_path, monkeypatch):
    cfg, got = _cfg(tmp_path, users=2, rounds=1), {}
    for mode in ("numpy", "torch", "blocks"):
        _in_mode(monkeypatch, mode)
        r = run_mode(cfg, "hisparse", str(tmp_path / mode))
        assert r["verification"]["mismatched_tokens"] == 0
        got[mode] = (r["verification"], r["hisparse"], r["generated_tokens"])
    assert got["numpy"][1]["checked_rows"] > 0
    assert got["numpy"] == got["torch"] == got["blocks"]


@pytest.mark.parametrize("mode", ["blocks", "numpy", "torch"])
def test_a_corrupted_row_copied_in_is_found_in_every_copy_mode(tmp_path, monkeypatch, mode):
    """One byte flipped in a row each of three swap-ins copied in from host: every such row
    is checked in the same step, so each is counted."""
    _in_mode(monkeypatch, mode)
    real, flipped = HiSparseSwapper.swap_in, []

    def corrupting(self, layer_id, positions):
        got = real(self, layer_id, positions)
        if len(flipped) < 3 and got.copied.size:
            slot = int(got.device_slots[got.copied[-1]])
            row = self.pool.kv_buffer[self.pool.layer_index(layer_id)][slot]
            row.view(torch.uint8).view(-1)[3] ^= 0x40
            flipped.append(slot)
        return got

    monkeypatch.setattr(HiSparseSwapper, "swap_in", corrupting)
    r = run_mode(_cfg(tmp_path, users=2, rounds=1), "hisparse", str(tmp_path))
    assert len(flipped) == 3 and r["verification"]["mismatched_tokens"] >= 1
