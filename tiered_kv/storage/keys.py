"""Page keys: a namespace fingerprint followed by a chain of SHA-256 digests over page tokens.

Digest i = SHA-256(digest i-1 || token ids of page i as little-endian uint32); the first page
chains from ``prior`` (empty by default; a request identity's ``extra_key_prior``), so a key
names a page, everything before it, and the request's identity. The namespace fingerprint
covers every field of ``NAMESPACE_FIELDS``: the same tokens under another model, revision,
dtype, scales, geometry, layout, rank or tenant never share a key. ``check_complete`` fails
closed: a namespace missing a field a store needs is refused before any store opens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NewType

import numpy as np
import torch

from tiered_kv.errors import InvalidArgumentError, StorageOpenError
from tiered_kv.storage.value_format import VERSION as VALUE_FORMAT_VERSION

# Every field a namespace holds, and what it is: the one list (docs/storage_tier.md repeats it).
NAMESPACE_FIELDS: dict[str, str] = {
    "model": "the model's name and weights revision, '<name>@<revision>' (a commit, a "
    "checkpoint digest): a fine-tune and its base never share a page",
    "kind": "the pool kind that wrote the pages (mha, mla, a pool group, sglang-mha, ...)",
    "parts": "each stored part's name and per-token shape (heads, head dims, latent width)",
    "dtype": "the KV dtype, logical (two fp8 variants never share a page)",
    "kv_scales": "the identity of the KV quantization scales (required for float8 KV; none "
    "for unquantized KV)",
    "page_size": "tokens per page",
    "layout": "the host layout the page bytes are in",
    "layer_ids": "the global layer ids the pages hold (a pipeline stage's own)",
    "rank": "the tensor / pipeline / context-parallel rank, where ranks hold different bytes "
    "(none: this process holds all of them)",
    "tenant": "a tenant's salt (none: no tenant)",
    "format": "the namespace encoding's version",
    "value_format": "tiered_kv's stored value format version (value_format.VERSION)",
}
_NAMESPACE_FORMAT = 3  # 3: kv_scales and value_format joined the fields

PageKey = NewType("PageKey", bytes)
FINGERPRINT_BYTES = 16
DIGEST_BYTES = 32
KEY_BYTES = FINGERPRINT_BYTES + DIGEST_BYTES


@dataclass(frozen=True)
class StorageNamespace:
    """What a store's pages belong to. ``fingerprint`` prefixes every key and every value."""

    description: str  # canonical JSON of NAMESPACE_FIELDS
    fingerprint: bytes
    model: str | None = None  # which model wrote the pages (stores refuse a namespace without)
    dtype: str = ""
    kv_scales: str | None = None

    @classmethod
    def create(
        cls,
        *,
        kind: str,
        parts: Sequence[tuple[str, Sequence[int]]],
        dtype: torch.dtype | str,
        layer_ids: Sequence[int],
        page_size: int,
        layout: str,
        tenant: str | None = None,
        model: str | None = None,
        rank: str | None = None,
        kv_scales: str | None = None,
    ) -> StorageNamespace:
        """``model``: the model's identity, a name plus a weights fingerprint or revision (two
        models with the same KV shape, a fine-tune and its base, must never share a page);
        ``rank``: the tensor / pipeline / context-parallel rank where ranks hold different
        bytes; ``tenant``: a salt that keeps one tenant's pages from another's;
        ``kv_scales``: the identity of quantized KV's scales (see ``NAMESPACE_FIELDS``)."""
        named = (("model", model), ("rank", rank), ("tenant", tenant), ("kv_scales", kv_scales))
        for name, value in named:
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(f"{name}={value!r} must be None or a non-empty str")
        fields: dict[str, Any] = {
            "format": _NAMESPACE_FORMAT,
            "value_format": VALUE_FORMAT_VERSION,
            "kv_scales": kv_scales,
            "model": model,
            "rank": rank,
            "kind": kind,
            "parts": [[name, list(shape)] for name, shape in parts],
            "dtype": str(dtype),
            "layer_ids": list(layer_ids),
            "page_size": int(page_size),
            "layout": str(layout),
            "tenant": tenant,
        }
        if set(fields) != set(NAMESPACE_FIELDS):  # the list and the encoding never drift
            raise AssertionError(f"namespace fields {sorted(fields)} != NAMESPACE_FIELDS")
        text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        digest = hashlib.sha256(text.encode()).digest()[:FINGERPRINT_BYTES]
        return cls(text, digest, model, str(dtype), kv_scales)

    @classmethod
    def for_host_pool(
        cls,
        host_pool: Any,
        tenant: str | None = None,
        *,
        model: str | None = None,
        rank: str | None = None,
        kv_scales: str | None = None,
    ) -> StorageNamespace:
        """The namespace of a host pool's pages (its declaration, layout and page size) written
        by ``model`` (see ``create``)."""
        decl = host_pool.decl
        return cls.create(
            kind=decl.kind,
            parts=[(p.name, p.item_shape) for p in decl.parts],
            dtype=decl.dtype,
            layer_ids=decl.layer_ids,
            page_size=decl.page_size,
            layout=host_pool.layout.value,
            tenant=tenant,
            model=model,
            rank=rank,
            kv_scales=kv_scales,
        )

    def missing(self) -> list[str]:
        """The fields a store needs that this namespace lacks, each with what would do."""
        out = []
        name, at, revision = (self.model or "").rpartition("@")
        if self.model is None or not at or not name or not revision:
            out.append(
                f"model={self.model!r}: the model's name and weights revision, as "
                "'<name>@<revision>' (TieredKVConfig.model_id / the integration's model_id)"
            )
        if "float8" in self.dtype and self.kv_scales is None:
            out.append(
                f"kv_scales=None with dtype {self.dtype}: name the KV quantization scales "
                "(e.g. 'per-tensor:<checkpoint digest>'), or pages under other scales would match"
            )
        return out

    def check_complete(self) -> None:
        """Fail closed: StorageOpenError naming every field a store needs that is missing
        (stores and integrations call it before they open; nothing is defaulted)."""
        missing = self.missing()
        if missing:
            raise StorageOpenError(
                "the storage namespace is incomplete, so its pages could be served to another "
                "model or quantization; refusing to open the store: " + "; ".join(missing)
            )

    def owns(self, key: bytes) -> bool:
        return len(key) == KEY_BYTES and key[:FINGERPRINT_BYTES] == self.fingerprint


def _token_array(tokens: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(tokens, torch.Tensor):
        arr = tokens.detach().cpu().numpy()
    else:
        arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise InvalidArgumentError(
            f"tokens must be a 1-D sequence of ints, got shape {arr.shape} dtype {arr.dtype}"
        )
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise InvalidArgumentError("token ids must fit in uint32 (0 .. 4294967295)")
    return arr.astype("<u4", copy=False)


def page_digests(
    tokens: Sequence[int] | np.ndarray | torch.Tensor, page_size: int, prior: bytes = b""
) -> list[bytes]:
    """The chained digest of every *full* page of ``tokens`` (a partial last page has none),
    continuing from ``prior`` (the digest of the page before ``tokens[0]``, or empty)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise InvalidArgumentError(f"page_size={page_size!r} must be an int >= 1")
    if prior and len(prior) != DIGEST_BYTES:
        raise InvalidArgumentError(f"prior digest has {len(prior)} bytes; expected {DIGEST_BYTES}")
    arr = _token_array(tokens)
    out, prev = [], prior
    for i in range(arr.size // page_size):
        prev = hashlib.sha256(prev + arr[i * page_size : (i + 1) * page_size].tobytes()).digest()
        out.append(prev)
    return out


_EXTRA_KEY = b"tiered-kv/request-extra-key/1\0"


def extra_key_prior(extra_key: str | bytes | None) -> bytes:
    """The chain's starting digest for a request's ``extra_key`` (an opaque per-request
    identity: LoRA adapter id and revision, cache salt, multimodal content hashes): b"" for
    None, else SHA-256 of a fixed tag and the whole key (UTF-8 for a str), so requests with
    different extra keys never share a page digest, a page key or a state key. The key is
    hashed at full width: no prefix of it stands for it."""
    if extra_key is None:
        return b""
    if isinstance(extra_key, str):
        extra_key = extra_key.encode("utf-8", "surrogatepass")
    if not isinstance(extra_key, (bytes, bytearray, memoryview)) or not len(extra_key):
        raise InvalidArgumentError(
            f"extra_key={extra_key!r:.80} must be None (no per-request identity) or a "
            "non-empty str or bytes (e.g. 'lora=<adapter id>@<revision>;salt=<cache salt>')"
        )
    return hashlib.sha256(_EXTRA_KEY + bytes(extra_key)).digest()


def page_keys(
    namespace: StorageNamespace,
    tokens: Sequence[int] | np.ndarray | torch.Tensor,
    page_size: int,
    prior: bytes = b"",
) -> list[PageKey]:
    """Storage keys of every full page of ``tokens`` under ``namespace``."""
    return [PageKey(namespace.fingerprint + d) for d in page_digests(tokens, page_size, prior)]


_WINDOWLESS = b"tiered-kv/windowless-page/1"


def page_keys_of(
    namespace: StorageNamespace, digests: Sequence[bytes], *, windowless: bool = False
) -> list[PageKey]:
    """Storage keys under ``namespace`` of pages whose chain digests are already known (a
    prefix tree keeps them per node). ``windowless``: the keys of the pages' *full-KV-only*
    values (a sliding-window model's tombstones, whose window part is not kept): another key
    for the same page, so such a value is never read as a page with its window KV."""
    fp = namespace.fingerprint
    for d in digests:
        if len(d) != DIGEST_BYTES:
            raise InvalidArgumentError(f"a page digest has {len(d)} bytes; expected {DIGEST_BYTES}")
    if windowless:
        return [PageKey(fp + hashlib.sha256(_WINDOWLESS + d).digest()) for d in digests]
    return [PageKey(fp + d) for d in digests]


def digest_of(key: bytes) -> bytes:
    """The chain digest inside a key (to continue the chain from it)."""
    return key[FINGERPRINT_BYTES:]


_STATE = b"tiered-kv/state-snapshot/1"


def state_keys_of(namespace: StorageNamespace, digests: Sequence[bytes]) -> list[PageKey]:
    """Storage keys under a *state* namespace (``HostStatePool.namespace``) of the recurrent
    state snapshot taken at the end of each page whose chain digest is given. The digest is
    hashed with a fixed tag, so a state key never equals a page key, even under a namespace
    mistakenly shared with KV pages."""
    fp = namespace.fingerprint
    for d in digests:
        if len(d) != DIGEST_BYTES:
            raise InvalidArgumentError(f"a page digest has {len(d)} bytes; expected {DIGEST_BYTES}")
    return [PageKey(fp + hashlib.sha256(_STATE + d).digest()) for d in digests]
