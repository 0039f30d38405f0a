"""KVCache: the base of every device KV pool (one tensor per layer, slot 0 a padding sink).

Layout contract shared by the subclasses:
- each layer owns its own tensor of ``size + page_size`` rows; slot 0 (and the rest of page 0)
  is where padded tokens write dummy KV, so it is never handed out by an allocator;
- ``store_dtype`` is what the tensor holds; fp8 dtypes are stored as uint8 (``index_put`` is not
  implemented for them) and viewed back as ``dtype`` by the getters;
- layer ids are global; this pool holds layers ``start_layer..end_layer`` (pipeline parallelism)
  and indexes its buffers by ``layer_id - start_layer``.
"""

from __future__ import annotations

import abc

import psutil
import torch

from tiered_kv import platform
from tiered_kv._checks import check_index_tensor, check_positive_int, check_range
from tiered_kv.device.pool_decl import HostPart, HostPoolDecl
from tiered_kv.device.write_loc import KVWriteLoc, as_write_loc, write_loc_is_physical
from tiered_kv.errors import HostMemoryError, InvalidArgumentError, PhysicalWriteLocError

FP8_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, name)
    for name in ("float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
KV_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)


def input_dtypes_for(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The KV dtypes a pool of ``dtype`` accepts in a write: its own, and float32 (a model's
    compute dtype) narrowed into it; an fp8 pool also takes float16 / bfloat16 (quantized with
    the write's scale). Anything else (float64, the other half type) is a caller's bug."""
    wider = (
        (torch.float32, torch.float16, torch.bfloat16) if dtype in FP8_DTYPES else (torch.float32,)
    )
    return (dtype, *(d for d in wider if d != dtype))


def store_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """uint8 for fp8 dtypes (no index_put for them), the dtype itself otherwise."""
    return torch.uint8 if dtype in FP8_DTYPES else dtype


def free_bytes(device: torch.device) -> int:
    """Bytes a new tensor on ``device`` can take: free GPU memory plus what torch's caching
    allocator holds unused; on CPU the RAM the OS calls available (swap excluded: the pools are
    zero-filled, so every page is touched at once)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return psutil.virtual_memory().available


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def mha_kv_bytes(
    layer_num: int, tokens: int, head_num: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The seed's M_MHA = 2 * L * T * H * d * b (K and V, equal head dims)."""
    return 2 * layer_num * tokens * head_num * head_dim * dtype_bytes(dtype)


def mla_kv_bytes(
    layer_num: int, tokens: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype: torch.dtype
) -> int:
    """The seed's M_MLA = L * T * (r + d_r) * b: one latent shared by every head."""
    return layer_num * tokens * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes(dtype)


class KVCache(abc.ABC):
    """Base of the device KV pools. Subclasses create their buffers and implement the getters.

    Writes go through :meth:`set_kv_buffer` with a :class:`KVWriteLoc`; a pool whose ids are
    virtual sets ``requires_physical_write_loc`` and refuses an unmarked loc.
    """

    requires_physical_write_loc: bool = False

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: str | torch.device | None,
        start_layer: int | None = None,
        end_layer: int | None = None,
    ) -> None:
        self.size = check_positive_int("size", size)
        self.page_size = check_positive_int("page_size", page_size)
        self.layer_num = check_positive_int("layer_num", layer_num)
        if dtype not in KV_DTYPES:
            names = ", ".join(str(d) for d in KV_DTYPES)
            raise InvalidArgumentError(f"dtype {dtype} is not a KV dtype; use one of {names}")
        self.dtype = dtype
        self.store_dtype = store_dtype_for(dtype)
        self.input_dtypes = input_dtypes_for(dtype)
        self.device = platform.resolve_device(device)
        self.start_layer = (
            0 if start_layer is None else check_positive_int("start_layer", start_layer, minimum=0)
        )
        expected_end = self.start_layer + layer_num - 1
        self.end_layer = expected_end if end_layer is None else end_layer
        if self.end_layer != expected_end:
            raise InvalidArgumentError(
                f"end_layer={end_layer} does not match start_layer={self.start_layer} and "
                f"layer_num={layer_num}; expected end_layer={expected_end}"
            )
        # Validation that reads index values costs a device sync on CUDA: on by default only
        # where it is free (CPU tensors); debug_mode turns it on everywhere.
        self.debug_mode = False
        self.layer_transfer_counter = None

    # -- layer-wise loading ---------------------------------------------------------------
    def register_layer_transfer_counter(self, counter) -> None:
        """From now on ``get_key_buffer`` / ``get_value_buffer`` of a layer first wait until
        ``counter`` says that layer's host -> device load is done (``None``: never wait)."""
        if counter is not None and counter.num_layers != self.layer_num:
            raise InvalidArgumentError(
                f"layer transfer counter counts {counter.num_layers} layers; this pool holds "
                f"{self.layer_num}"
            )
        self.layer_transfer_counter = counter

    def _ready_layer(self, layer_id: int) -> int:
        """Local index of ``layer_id`` once any load into that layer has landed."""
        index = self.layer_index(layer_id)
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(index)
        return index

    # -- geometry ---------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        """Rows per layer buffer: ``size`` usable slots plus the padding page."""
        return self.size + self.page_size

    def layer_index(self, layer_id: int) -> int:
        """Local buffer index of global ``layer_id``; raises if this pool does not hold it."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise InvalidArgumentError(f"layer_id must be an int, got {layer_id!r}")
        if not self.start_layer <= layer_id <= self.end_layer:
            raise InvalidArgumentError(
                f"layer_id={layer_id} is not held by this pool; valid global layer ids are "
                f"{self.start_layer}..{self.end_layer}"
            )
        return layer_id - self.start_layer

    def _check_fits(self, bytes_per_token_per_layer: int, what: str = "KV") -> None:
        """Refuse, before allocating anything, buffers of ``bytes_per_token_per_layer`` per slot
        and layer that the device has no room for: a raw allocator error (or the OOM killer,
        since CPU buffers are zero-filled) names neither the setting nor the size."""
        nbytes = self.num_slots * self.layer_num * bytes_per_token_per_layer
        free = free_bytes(self.device)
        if nbytes > free:
            gib = 1 << 30
            raise HostMemoryError(
                f"{type(self).__name__} with size={self.size} tokens (+{self.page_size} padding) "
                f"x {self.layer_num} layers x {bytes_per_token_per_layer} bytes per token needs "
                f"{nbytes / gib:.2f} GiB of {what} but {self.device} has {free / gib:.2f} GiB "
                "free; lower size (or layer_num, the head count or the dtype)"
            )

    def _view(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(self.dtype) if self.store_dtype != self.dtype else t

    # -- writes -----------------------------------------------------------------------------
    def _check_physical_write_loc(self, loc_info: KVWriteLoc | torch.Tensor, where: str) -> None:
        # A flag read, no device sync: cheap enough for every write. Fused writers that scatter
        # through get_kv_buffer, and a replayed CUDA graph, do not pass through here.
        if self.requires_physical_write_loc and not write_loc_is_physical(loc_info):
            raise PhysicalWriteLocError(
                f"{where}: write loc is not marked physical. Pass KVWriteLoc.for_batch(batch) for "
                "a batch whose out_cache_loc is physical, or KVWriteLoc(loc, physical=True) for "
                "ids already translated to physical slots"
            )

    def _write_target(
        self, layer_id: int, loc_info: KVWriteLoc | torch.Tensor, n_tokens: int, where: str
    ) -> tuple[int, torch.Tensor]:
        """Validate a write and return (local layer index, slot tensor). Changes nothing."""
        self._check_physical_write_loc(loc_info, where)
        write_loc = as_write_loc(loc_info)
        local = self.layer_index(layer_id)
        loc = check_index_tensor(f"{where}: loc", write_loc.target_full_loc, self.device)
        if loc.shape[0] != n_tokens:
            raise InvalidArgumentError(
                f"{where}: write loc has {loc.shape[0]} slots but the KV has {n_tokens} tokens; "
                "they must be equal"
            )
        if self.device.type == "cpu" or self.debug_mode:
            check_range(f"{where}: loc", loc, 0, self.num_slots)
        return local, loc

    @staticmethod
    def _num_tokens(name: str, x: object) -> int:
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            raise InvalidArgumentError(
                f"{name} must be a tensor with a leading token dimension, got {x!r:.80}"
            )
        return int(x.shape[0])

    def _to_store(
        self,
        name: str,
        x: torch.Tensor,
        shape: tuple[int, ...],
        scale: float | torch.Tensor | None,
    ) -> torch.Tensor:
        """Check ``x`` against ``shape`` (a flat last dim is reshaped) and ``input_dtypes``, cast
        to ``dtype`` (dividing by ``scale`` first when given), and view it as ``store_dtype``."""
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape) != shape:
            # Only a flattened (n, H*d) input is reshaped; any other layout is refused rather
            # than scrambled into heads.
            if x.dim() == 2 and tuple(x.shape) == (shape[0], _prod(shape[1:])):
                x = x.reshape(shape)
            else:
                raise InvalidArgumentError(
                    f"{name} has shape {tuple(x.shape)}; expected {shape} for this pool"
                )
        if x.dtype not in self.input_dtypes:
            allowed = ", ".join(str(d) for d in self.input_dtypes)
            raise InvalidArgumentError(
                f"{name} has dtype {x.dtype}; a pool of {self.dtype} takes {allowed} "
                f"(cast it first, e.g. {name}.to({self.dtype}))"
            )
        if x.dtype != self.dtype:
            if scale is not None:
                x = x / scale
            x = x.to(self.dtype)
        if x.device != self.device:
            x = x.to(self.device)
        return x.view(self.store_dtype) if self.store_dtype != self.dtype else x

    # -- interface ----------------------------------------------------------------------------
    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor: ...

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    @abc.abstractmethod
    def set_kv_buffer(
        self,
        layer_id: int,
        write_loc: KVWriteLoc | torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor | None,
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
    ) -> None:
        """Write ``cache_k``/``cache_v`` of ``len(write_loc)`` tokens into layer ``layer_id``.
        Validates everything first; on error nothing is written."""

    @abc.abstractmethod
    def buffers(self) -> list[torch.Tensor]:
        """Every tensor this pool owns (store dtype), for byte accounting and transfers."""

    def get_kv_size_bytes(self) -> int:
        """Bytes this pool holds on its device, padding page included."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    @abc.abstractmethod
    def bytes_per_token_per_layer(self) -> int:
        """Bytes one token occupies in one layer (K and V together)."""

    # -- host tier ----------------------------------------------------------------------------
    host_pool_kind: str = "kv"

    @abc.abstractmethod
    def _host_parts(self) -> tuple[HostPart, ...]:
        """The per-token rows of this pool's buffers, in record order."""

    def host_pool_decls(self) -> tuple[HostPoolDecl, ...]:
        """Host pools kept for the buffers this pool owns: the KV itself. Buffers owned elsewhere
        (e.g. recurrent state held by a request pool) are declared by their owner."""
        return (
            HostPoolDecl(
                name="kv",
                kind=self.host_pool_kind,
                device_pool=self,
                parts=self._host_parts(),
                dtype=self.store_dtype,
                layer_ids=tuple(range(self.start_layer, self.end_layer + 1)),
                page_size=self.page_size,
                num_slots=self.num_slots,
            ),
        )


def _prod(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
