"""TieredKVConfig: everything a :class:`TieredKVCache` is built from, nested, frozen, validated.

Five sections, each a frozen dataclass validated on construction: ``geometry`` (the model's KV
shape), ``device`` (pool and request capacities), ``host`` (the host pool's size, layout and own
options), ``storage`` (the store's budget, path and own options) and ``policies``. Field names
are unique across sections, so :meth:`TieredKVConfig.flat` (and :meth:`replace`) take them as
plain keywords. Every check names the field (``TieredKVConfig.<field>=<value>``) and what would
be valid; nothing is built from a config that fails. This module imports nothing from the rest
of the package but its vocabulary, errors, the allocators' sizing settings and the storage
section (``storage_config``, with the backend choice).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tiered_kv._config_checks import _choice, _finite, _ints, _is_int, _need, _seconds
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import (
    EvictionPolicyName,
    HostLayout,
    IOBackend,
    ModelKind,
    PrefetchPolicy,
    WritePolicy,
)
from tiered_kv.sizing_config import AllocSizingConfig, resolve_sizing
from tiered_kv.storage_config import StorageConfig

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ModelGeometry:
    num_layers: int = 4
    model: str = "mha"  # ModelKind
    head_num: int = 2  # MHA: KV heads
    head_dim: int = 64  # MHA: K head dim (V the same unless v_head_dim)
    v_head_dim: int | None = None
    kv_lora_rank: int = 64  # MLA
    qk_rope_head_dim: int = 16  # MLA
    index_head_dim: int = 128  # DSA: the indexer key's elements (whole 128-element blocks)
    sliding_window: int = 64  # SWA: tokens a window layer attends to (its own included)
    full_layer_every: int = 4  # SWA: layer i is full attention when i % full_layer_every == 0
    # hybrid_linear: layer i is full attention when (i + 1) % full_layer_every == 0, the others
    # recurrent (a short causal conv of conv_kernel taps, then a gated linear recurrence).
    conv_kernel: int = 4
    linear_heads: int = 2
    linear_key_dim: int = 16
    linear_value_dim: int = 32
    ngram_context_len: int = 0  # hybrid_linear: an n-gram draft pool of this context (0: none)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        _ints(
            self,
            ("num_layers", "head_num", "head_dim", "kv_lora_rank", "qk_rope_head_dim",
             "index_head_dim", "sliding_window", "full_layer_every", "linear_heads",
             "linear_key_dim", "linear_value_dim"),
        )  # fmt: skip
        _ints(self, ("conv_kernel",), minimum=2)
        _ints(self, ("ngram_context_len",), minimum=0)
        _need(self.index_head_dim % 128 == 0, self, "index_head_dim", "a multiple of 128")
        if self.model == ModelKind.SWA:
            _need(
                self.num_layers > 1 and self.full_layer_every > 1,
                self,
                "full_layer_every",
                "> 1 with num_layers > 1 (an SWA model has full and window layers)",
            )
        if self.model == ModelKind.HYBRID_LINEAR:
            _need(
                1 < self.full_layer_every <= self.num_layers,
                self,
                "full_layer_every",
                f"2..num_layers={self.num_layers} (a hybrid model has full and recurrent layers)",
            )
        v = self.v_head_dim
        _need(v is None or (_is_int(v) and v >= 1), self, "v_head_dim", "None or an int >= 1")
        _choice(self, "model", ModelKind.values())
        _choice(self, "dtype", tuple(DTYPES))

    def swa_layer_ids(self) -> tuple[list[int], list[int]]:
        """(full layer ids, window layer ids) of an SWA model."""
        every = self.full_layer_every
        ids = range(self.num_layers)
        return [i for i in ids if i % every == 0], [i for i in ids if i % every]

    def hybrid_layer_ids(self) -> tuple[list[int], list[int]]:
        """(full layer ids, recurrent layer ids) of a hybrid_linear model."""
        every, ids = self.full_layer_every, range(self.num_layers)
        return [i for i in ids if (i + 1) % every == 0], [i for i in ids if (i + 1) % every]

    def conv_state_shape(self) -> tuple[int, int]:
        """A recurrent layer's conv history: (q, k and v channels, conv_kernel - 1)."""
        dim = self.linear_heads * (2 * self.linear_key_dim + self.linear_value_dim)
        return dim, self.conv_kernel - 1

    def temporal_state_shape(self) -> tuple[int, int, int]:
        return self.linear_heads, self.linear_key_dim, self.linear_value_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"
    page_size: int = 16
    device_tokens: int = 4096
    max_requests: int = 64
    max_context_len: int = 8192
    device_swa_tokens: int | None = None  # SWA: window sub-pool slots (None: device_tokens)
    # SWA: full and window KV in one page range over one shared buffer (UnifiedSWAKVPool):
    # device_tokens is the whole budget, split between the sides as requests need it
    swa_unified_pool: bool = False
    # DSA: HiSparse (0: off). The device allocator gives every token a logical slot, this many
    # per device slot; a sparse request (``HiSparseServing``) keeps its tokens on host and only
    # a fixed buffer on the device
    hisparse_logical_ratio: int = 0
    # hybrid_linear: Mamba state slots (requests' own, their tracking slots and cached
    # snapshots; None: 4 per request), the tracking buffer, overlap scheduling, lazy tracking
    device_state_slots: int | None = None
    state_extra_buffer: bool = True
    state_overlap: bool = False
    state_lazy: bool = False
    # hybrid_linear: also keep a snapshot every this many pages while a request runs (0: only
    # at the end of each cached prefix), so requests sharing a long prompt but not its end hit
    state_snapshot_every: int = 16
    # Speculative decoding, decode context parallelism and overlap scheduling: the request
    # rows' headroom and every per-step reserve derive from it (None: none of them)
    sizing: AllocSizingConfig | None = None

    def __post_init__(self) -> None:
        _ints(self, ("page_size", "device_tokens", "max_requests", "max_context_len"))
        try:
            resolve_sizing(self.sizing, self.page_size)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"TieredKVConfig.sizing: {exc}") from None
        n = self.device_state_slots
        ok = n is None or (_is_int(n) and n >= 1)
        _need(ok, self, "device_state_slots", "None (4 per request) or an int >= 1")
        _ints(self, ("state_snapshot_every", "hisparse_logical_ratio"), minimum=0)
        for f in ("state_extra_buffer", "state_overlap", "state_lazy", "swa_unified_pool"):
            _need(isinstance(getattr(self, f), bool), self, f, "True or False")
        w = self.device_swa_tokens
        _need(
            w is None or (_is_int(w) and w >= 2 * self.page_size and w % self.page_size == 0),
            self,
            "device_swa_tokens",
            f"None or a multiple of page_size={self.page_size}, at least two pages",
        )
        _need(
            not (self.swa_unified_pool and w is not None),
            self,
            "device_swa_tokens",
            "None with swa_unified_pool=True (one page range of device_tokens serves both sides)",
        )
        ps = self.page_size
        _need(ps & (ps - 1) == 0, self, "page_size", "a power of two (1, 2, 4, ..., 16, 64, ...)")
        _need(
            self.device_tokens % ps == 0 and self.device_tokens >= 2 * ps,
            self,
            "device_tokens",
            f"a multiple of page_size={ps}, at least two pages",
        )
        _choice(self, "device", DEVICES)


@dataclass(frozen=True)
class HostConfig:
    host_tokens: int = 16384  # 0: no host tier (and then no storage tier)
    host_layout: str = "page_first"  # HostLayout
    io_backend: str = "kernel"  # IOBackend
    pin: bool | None = None  # None: pinned where CUDA exists
    reserve_bytes: int | None = None  # host memory left to others (None: the pool's default)
    kernel_backend: str | None = None  # None: platform's choice
    host_state_slots: int | None = None  # hybrid_linear: host state snapshots (None: derived)

    def __post_init__(self) -> None:
        _ints(self, ("host_tokens",), minimum=0)
        n = self.host_state_slots
        _need(n is None or (_is_int(n) and n >= 1), self, "host_state_slots", "None or an int >= 1")
        _choice(self, "host_layout", HostLayout.values())
        _choice(self, "io_backend", IOBackend.values())
        _need(self.pin is None or isinstance(self.pin, bool), self, "pin", "None, True or False")
        r = self.reserve_bytes
        _need(r is None or (_is_int(r) and r >= 0), self, "reserve_bytes", "None or an int >= 0")
        kb = self.kernel_backend
        _need(
            kb is None or kb in ("auto", "triton", "torch", "native"),
            self,
            "kernel_backend",
            "None, 'auto', 'triton', 'torch' or 'native'",
        )


@dataclass(frozen=True)
class PolicyConfig:
    device_policy: str = "lru"  # EvictionPolicyName
    host_policy: str = "lru"
    write_policy: str = "write_through"  # WritePolicy
    selective_hits: int = 2
    prefetch_policy: str = "timeout"  # PrefetchPolicy: a bounded wait serves a restart's hits
    prefetch_threshold: int = 256  # tokens: smaller storage hits are recomputed
    prefetch_timeout_base_s: float = 0.5
    prefetch_timeout_per_1k_s: float = 0.25
    prefetch_timeout_max_s: float = 5.0
    # Sampled live verification (``cache.verify``): the fraction of restored prefixes whose KV
    # the engine's verifier recomputes and compares before their first forward (0.0: none).
    verify_fraction: float = 0.0
    # The load planner (``cache.load_planner``, needs a host tier): per request, load a cached
    # prefix or compute it again, whichever its estimates say is faster. Its priors (what it
    # assumes before observing a copy, or before the engine gives its compute cost):
    load_planner: bool = False
    planner_host_gbps: float = 25.0  # host -> device (PCIe 5.0 x16, layer-wise pinned copies)
    planner_storage_gbps: float = 6.0  # storage -> host (one NVMe 4.0 x4 drive)
    planner_host_op_s: float = 1e-5  # fixed seconds per copy op
    planner_storage_op_s: float = 1e-4
    planner_prefill_tokens_per_s: float = 30_000.0  # until ``set_compute_cost``

    def __post_init__(self) -> None:
        _ints(self, ("selective_hits",))
        v = self.verify_fraction  # NaN fails both comparisons
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
        _need(ok, self, "verify_fraction", "a number from 0.0 (verify none) to 1.0 (verify all)")
        _need(isinstance(self.load_planner, bool), self, "load_planner", "True or False")
        for n in ("planner_host_gbps", "planner_storage_gbps"):
            _finite(self, n, positive=True, unit="GB/s")
        for n in ("planner_host_op_s", "planner_storage_op_s"):
            _finite(self, n, positive=False, unit="seconds")
        _finite(self, "planner_prefill_tokens_per_s", positive=True, unit="tokens/s")
        _need(
            _is_int(self.prefetch_threshold) and self.prefetch_threshold >= 0,
            self,
            "prefetch_threshold",
            "an int >= 0 (tokens)",
        )
        for n in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_s", "prefetch_timeout_max_s"):
            _seconds(self, n)
        _choice(self, "device_policy", EvictionPolicyName.values())
        _choice(self, "host_policy", EvictionPolicyName.values())
        _choice(self, "write_policy", WritePolicy.values())
        _choice(self, "prefetch_policy", PrefetchPolicy.values())

    def prefetch_timeout_s(self, tokens: int) -> float:
        """``timeout`` policy: base + per-1K-token term, capped."""
        t = self.prefetch_timeout_base_s + self.prefetch_timeout_per_1k_s * tokens / 1000
        return min(t, self.prefetch_timeout_max_s)

    def prefetch_wait_s(self, tokens: int) -> float | None:
        """How long ``begin`` waits for a storage hit of ``tokens`` (None: until done)."""
        if self.prefetch_policy == PrefetchPolicy.WAIT_COMPLETE:
            return None
        if self.prefetch_policy == PrefetchPolicy.TIMEOUT:
            return self.prefetch_timeout_s(tokens)
        return 0.0


_SECTIONS = {
    "geometry": ModelGeometry,
    "device": DeviceConfig,
    "host": HostConfig,
    "storage": StorageConfig,
    "policies": PolicyConfig,
}
_FIELD_SECTION = {f.name: s for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class TieredKVConfig:
    geometry: ModelGeometry = field(default_factory=ModelGeometry)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    host: HostConfig = field(default_factory=HostConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    policies: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise InvalidArgumentError(
                    f"TieredKVConfig.{name} must be a {cls.__name__}, got "
                    f"{type(getattr(self, name)).__name__}"
                )
        # Rules that span sections.
        ps, host = self.device.page_size, self.host
        _need(
            not self.device.swa_unified_pool or self.geometry.model == ModelKind.SWA,
            self.device,
            "swa_unified_pool",
            f"False for model={self.geometry.model!r} (only a sliding-window model, "
            "model='swa', has two sides to unify)",
        )
        _need(
            not self.device.hisparse_logical_ratio or self.geometry.model == ModelKind.DSA,
            self.device,
            "hisparse_logical_ratio",
            f"0 for model={self.geometry.model!r} (HiSparse serves a DSA model, model='dsa')",
        )
        _need(
            not self.device.hisparse_logical_ratio or host.host_tokens,
            self.device,
            "hisparse_logical_ratio",
            "0 without a host tier (a sparse request keeps its tokens on host; set host_tokens)",
        )
        if host.host_tokens:
            _need(
                host.host_tokens >= ps,
                host,
                "host_tokens",
                f"0 (no host tier) or at least one page ({ps} tokens)",
            )
            _need(host.host_tokens % ps == 0, host, "host_tokens", f"a multiple of page_size={ps}")
        if self.storage.storage_bytes:
            _need(
                host.host_tokens > 0,
                self.storage,
                "storage_bytes",
                "0 when host_tokens is 0 (storage pages move through the host tier)",
            )
            name, at, revision = (self.storage.model_id or "").rpartition("@")
            _need(
                bool(name and at and revision),
                self.storage,
                "model_id",
                "the model's identity when storage_bytes > 0: its name plus a weights "
                "fingerprint or revision (e.g. 'llama-3-8b@<sha>'), so that KV of two models "
                "with the same shape never shares a page",
            )

    @classmethod
    def flat(cls, **fields: object) -> TieredKVConfig:
        """A config from flat field names (``page_size=16, host_tokens=0, ...``), each routed to
        its section; the rest take their defaults."""
        return cls().replace(**fields)

    def replace(self, **changes: object) -> TieredKVConfig:
        """A copy with flat fields (or whole sections) changed, validated again."""
        by_section: dict[str, dict[str, object]] = {}
        whole: dict[str, object] = {}
        for name, value in changes.items():
            if name in _SECTIONS and isinstance(value, _SECTIONS[name]):
                whole[name] = value  # a whole section ("device" is also a flat field's name)
                continue
            section = _FIELD_SECTION.get(name)
            if section is None:
                raise InvalidArgumentError(
                    f"TieredKVConfig has no field {name!r}; fields are "
                    f"{', '.join(sorted(_FIELD_SECTION))}"
                )
            by_section.setdefault(section, {})[name] = value
        parts = {s: whole.get(s, getattr(self, s)) for s in _SECTIONS}
        for s, kw in by_section.items():
            parts[s] = dataclasses.replace(parts[s], **kw)
        return TieredKVConfig(**parts)

    def as_flat(self) -> dict[str, object]:
        """Every field by its flat name (for reports and JSON)."""
        return {n: getattr(getattr(self, s), n) for n, s in _FIELD_SECTION.items()}

    # -- derived ----------------------------------------------------------------------------
    @property
    def torch_dtype(self) -> torch.dtype:
        return self.geometry.torch_dtype

    @property
    def page_size(self) -> int:
        return self.device.page_size

    @property
    def storage_dir(self) -> Path | None:
        s = self.storage
        return Path(s.storage_path) if s.storage_bytes and s.storage_path is not None else None

    def prefetch_timeout_s(self, tokens: int) -> float:
        return self.policies.prefetch_timeout_s(tokens)
