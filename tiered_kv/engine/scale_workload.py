"""The scale run's workload and sizes: :class:`ScaleConfig` (frozen, validated), the tiers it
implies (``sizes``) and :class:`Workload`. Plain data: no cache, no tensors.

The workload: ``users`` users, ``active_users`` of them in session at once in a closed loop
(a user's next turn arrives when its previous one finishes; when a user's ``rounds`` turns are
done the next user starts). Each turn's prompt is a shared system prompt, one of ``docs``
documents (user ``u`` reads document ``u % docs``, so a document is read again by a later
session), the user's history (its earlier questions and the answers decoded for them) and a
new question; ``answer_tokens`` are decoded. Every length is multiplied by ``scale``.

The tiers come from the workload's unique tokens (its working set): the device holds
``device_fraction`` of it (at least the longest request and its decode reserve), the host
``host_fraction`` of it on top of a copy of the device's pages (write-through keeps one), the
disk all of it with room to spare. Bytes per token are the preset's (Llama-3-8B: 128 KiB).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from tiered_kv.engine.cost_model import CostModel, cost_model
from tiered_kv.engine.presets import ModelPreset, kv_bytes, preset
from tiered_kv.engine.synthetic_model import VOCAB_SIZE, LinkModel
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.storage_config import StorageConfig

PRESET_COST_MODELS = {
    "llama-3-8b": "h100-llama-3-8b",
    "qwen2.5-7b": "h200-qwen2.5-7b",
    "deepseek-v3": "h800x8-deepseek-v3",
    "deepseek-v3.2": "h800x8-deepseek-v3",  # V3's figures: the indexer's cost not modeled
    "gemma-3-4b": "h100-gemma-3-4b",
    "gemma-3-12b": "h100-gemma-3-12b",
    "qwen3-next-80b-a3b": "h200x2-qwen3-next-80b-a3b",
}
# A preset's default ``scale`` where 1 would not show what its cache does: Gemma 3's window
# (1024) is longer than every request at scale 1 (928 tokens at most), and a Qwen3-Next
# request's 75 MiB state outweighs the KV of its full layers below about 3k tokens. Gemma 3
# 12B stays at 1: at 384 KiB a token its scale-2 working set is 12.8 GiB (docs/serving_and_sim.md).
# DeepSeek-V3.2 at 4: its hisparse mode's device buffer holds the 2048 tokens its indexer
# selects, and at scale 1 no request is longer than that (at 4 every one is: 2.8k-3.7k tokens).
PRESET_SCALES = {"gemma-3-4b": 2.0, "qwen3-next-80b-a3b": 4.0, "deepseek-v3.2": 4.0}


@dataclass(frozen=True)
class ScaleConfig:
    """One scale run. ``preset``: a preset name or a :class:`ModelPreset` (any kind the
    scheduler serves: mha, mla, dsa, swa, hybrid_linear). Lengths in tokens before ``scale``."""

    preset: str | ModelPreset = "llama-3-8b"
    scale: float | None = None  # None: the preset's default (``PRESET_SCALES``, else 1)
    users: int = 32
    active_users: int = 8
    docs: int = 16
    rounds: int = 3
    system_tokens: int = 128
    doc_tokens: int = 512
    question_tokens: int = 64
    answer_tokens: int = 32
    page_size: int = 64
    chunk_tokens: int = 2048
    max_running: int = 8
    device_fraction: float = 0.10
    host_fraction: float = 0.30
    cost_model: str | None = None  # None: the preset's own (``PRESET_COST_MODELS``)
    links: LinkModel = LinkModel()
    seed: int = 0
    store_dir: str | None = None  # the store goes in a fresh temporary directory under it
    # the tiered mode's storage tier (StorageConfig's fields): a remote backend is shared with
    # other runs and nodes, so its pages can be storage hits from the first turn
    storage_backend: str = StorageConfig.storage_backend
    storage_options: Mapping[str, object] | None = None
    storage_local_copy: bool = False
    # The cache's ``verify_fraction``: restored prefixes the synthetic model checks byte for
    # byte before their first forward (a wrong one quarantined and computed again).
    verify_fraction: float = 1.0
    # The hisparse mode (DSA presets): latents selected per layer and token, and the device
    # buffer of each running request (DeepSeek-V3.2-Exp config.json: index_topk 2048).
    hisparse_topk: int = 2048

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            _need_int(name, getattr(self, name))
        if self.scale is None:  # resolved once (frozen); a ``scaled`` copy's default is 1
            object.__setattr__(self, "scale", PRESET_SCALES.get(self.model_preset.name, 1.0))
        ok = isinstance(self.scale, (int, float)) and not isinstance(self.scale, bool)
        if not ok or not 0 < self.scale < 1e4:
            raise InvalidArgumentError(f"scale={self.scale!r} must be a number in (0, 1e4)")
        for name in ("device_fraction", "host_fraction"):
            f = getattr(self, name)
            if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 < f <= 1:
                raise InvalidArgumentError(f"{name}={f!r} must be a fraction in (0, 1]")
        f = self.verify_fraction
        if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 <= f <= 1:
            raise InvalidArgumentError(f"verify_fraction={f!r} must be a fraction in [0, 1]")
        if self.hisparse_topk % self.page_size:
            raise InvalidArgumentError(
                f"hisparse_topk={self.hisparse_topk} must be a multiple of "
                f"page_size={self.page_size} (it sizes each request's device buffer)"
            )
        if self.chunk_tokens % self.page_size:
            raise InvalidArgumentError(
                f"chunk_tokens={self.chunk_tokens} must be a multiple of page_size={self.page_size}"
            )
        _ = self.cost  # an unknown name raises, listing the valid ones
        StorageConfig(  # the backend's fields, checked as the cache will check them
            storage_bytes=1, storage_path=".", storage_backend=self.storage_backend,
            storage_options=self.storage_options, storage_local_copy=self.storage_local_copy,
        )  # fmt: skip

    @property
    def model_preset(self) -> ModelPreset:
        return self.preset if isinstance(self.preset, ModelPreset) else preset(self.preset)

    @property
    def cost(self) -> CostModel:
        """The named cost model, else the one stated for the preset's model (H100 figures
        for Llama-3-8B where the preset has none)."""
        base = self.model_preset.name.split("[")[0]  # a ``scaled`` copy models its original
        return cost_model(self.cost_model or PRESET_COST_MODELS.get(base, "h100-llama-3-8b"))

    def tokens(self, name: str) -> int:
        """A length after ``scale`` (at least 1)."""
        return max(1, round(getattr(self, name) * self.scale))


_INT_FIELDS = (
    "users", "active_users", "docs", "rounds", "system_tokens", "doc_tokens", "question_tokens",
    "answer_tokens", "page_size", "chunk_tokens", "max_running", "hisparse_topk",
)  # fmt: skip


def _need_int(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise InvalidArgumentError(f"ScaleConfig.{name}={v!r} must be an int >= 1")


class Sizes(NamedTuple):
    working_set_tokens: int  # unique tokens of the whole workload
    longest_tokens: int  # the longest request: prompt + answer
    device_tokens: int  # full-side slots (every token holds one)
    host_tokens: int
    storage_bytes: int
    bytes_per_token: int  # KV over every layer that keeps KV (window layers included)
    device_window_tokens: int | None  # SWA: the window side's slots (None: no window layers)
    state_bytes: int  # hybrid: one request's recurrent state (0: none)
    device_bytes: int  # the device tier: full side, window side, state slots


def sizes(cfg: ScaleConfig) -> Sizes:
    """The tiers for ``cfg``'s workload (whole pages), from what the cache holds per kind: the
    full side gets ``device_fraction`` of the working set; an SWA model's window side room for
    one request prefilling and the others decoding (each holds at most a window and a step,
    ``KVBytes.window_held``), not a window per token; a hybrid's state slots are the cache's
    default (4 per request), and the store has room for a snapshot per turn besides the KV."""
    ps = cfg.page_size
    turn = cfg.tokens("question_tokens") + cfg.tokens("answer_tokens")
    ws = (
        cfg.tokens("system_tokens")
        + min(cfg.docs, cfg.users) * cfg.tokens("doc_tokens")
        + cfg.users * cfg.rounds * turn
    )
    longest = cfg.tokens("system_tokens") + cfg.tokens("doc_tokens") + cfg.rounds * turn

    def pages(n: float) -> int:
        return max(2, -(-int(n) // ps)) * ps

    device = max(pages(cfg.device_fraction * ws), pages(longest) + 4 * ps)  # + decode reserve
    host = device + pages(cfg.host_fraction * ws)  # write-through: it copies the device's too
    b = kv_bytes(cfg.model_preset, ps)
    window = None
    if b.window_layers:
        # The scheduler's per-request peak (``budget.Budget.window_peak``): its window from the
        # first page its next query reads, plus the step's new tokens and two pages.
        w = cfg.model_preset.sliding_window

        def peak(step: int) -> int:
            return min(pages(longest), pages(w + step) + 2 * ps)

        alone = pages(w + cfg.chunk_tokens) + 2 * ps  # what the scheduler asks of the pool
        window = max(alone, peak(cfg.chunk_tokens) + (cfg.max_running - 1) * peak(1))
    snapshots = cfg.users * cfg.rounds * 2 if b.state else 0  # a prefix's end, a retraction
    store = ws * b.per_token + snapshots * b.state
    state_slots = 4 * cfg.max_running if b.state else 0
    device_bytes = device * b.full_per_token + (window or 0) * b.window_per_token
    return Sizes(
        ws,
        longest,
        device,
        host,
        int(store * 1.5) + (64 << 20),
        b.per_token,
        window,
        b.state,
        device_bytes + state_slots * b.state,
    )


class Workload:
    """The users' prompts, built turn by turn from what their earlier turns decoded."""

    def __init__(self, cfg: ScaleConfig) -> None:
        rng = random.Random(cfg.seed)

        def draw(n: int) -> list[int]:
            return [rng.randrange(1, VOCAB_SIZE) for _ in range(n)]

        self.cfg = cfg
        self.system = draw(cfg.tokens("system_tokens"))
        self.docs = [draw(cfg.tokens("doc_tokens")) for _ in range(min(cfg.docs, cfg.users))]
        q = cfg.tokens("question_tokens")
        self.questions = [[draw(q) for _ in range(cfg.rounds)] for _ in range(cfg.users)]
        self.history: list[list[int]] = [[] for _ in range(cfg.users)]
        self.round = [0] * cfg.users

    def prompt(self, user: int) -> list[int]:
        doc = self.docs[user % len(self.docs)]
        return self.system + doc + self.history[user] + self.questions[user][self.round[user]]

    def answered(self, user: int, output: list[int]) -> bool:
        """Record a finished turn; whether the user has another."""
        self.history[user] += self.questions[user][self.round[user]] + output
        self.round[user] += 1
        return self.round[user] < self.cfg.rounds
