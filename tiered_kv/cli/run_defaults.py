"""What ``tiered-kv run``'s flags show before any work, as plain data: the presets it serves,
:class:`~tiered_kv.engine.scale_workload.ScaleConfig`'s defaults, each preset's own scale and
cost model, and the modeled links' bandwidths.

Copies, so that building the parser (and ``--help``) imports no torch: the engine's modules
that own these values import it. ``tests/cli/test_cli_help_fast.py`` checks every value here
against the engine's, so a change there that is not made here fails the tests.
"""

from __future__ import annotations

from types import SimpleNamespace

# engine.presets.PRESETS whose kind the batched scheduler serves (scale_cmd.SERVED_KINDS).
SERVED = (
    "llama-3-8b",
    "qwen2.5-7b",
    "deepseek-v3",
    "deepseek-v3.2",
    "gemma-2-9b",
    "gemma-3-12b",
    "gemma-3-4b",
    "qwen3-next-80b-a3b",
)
# engine.scale_workload.PRESET_SCALES and PRESET_COST_MODELS.
PRESET_SCALES = {"gemma-3-4b": 2.0, "qwen3-next-80b-a3b": 4.0, "deepseek-v3.2": 4.0}
PRESET_COST_MODELS = {
    "llama-3-8b": "h100-llama-3-8b",
    "qwen2.5-7b": "h200-qwen2.5-7b",
    "deepseek-v3": "h800x8-deepseek-v3",
    "deepseek-v3.2": "h800x8-deepseek-v3",
    "gemma-3-4b": "h100-gemma-3-4b",
    "gemma-3-12b": "h100-gemma-3-12b",
    "qwen3-next-80b-a3b": "h200x2-qwen3-next-80b-a3b",
}
# engine.scale_workload.ScaleConfig's bound on scale: 0 < scale < MAX_SCALE.
MAX_SCALE = 1e4
# engine.scale_workload.ScaleConfig()'s fields that are flags.
SCALE = SimpleNamespace(
    preset="llama-3-8b",
    users=32,
    active_users=8,
    docs=16,
    rounds=3,
    system_tokens=128,
    doc_tokens=512,
    question_tokens=64,
    answer_tokens=32,
    seed=0,
    page_size=64,
    chunk_tokens=2048,
    max_running=8,
    device_fraction=0.10,
    host_fraction=0.30,
    verify_fraction=1.0,
    hisparse_topk=2048,
)
# engine.synthetic_model.LinkModel()'s bandwidths, in GB/s.
PCIE_GBPS = 25.0
DISK_GBPS = 6.0
