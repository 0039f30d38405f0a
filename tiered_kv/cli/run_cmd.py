"""The reference job: serve a multi-turn workload on the tiered cache with a small Llama-style
model (real compute).

Several users share system prompts and talk for several rounds; each prompt is a system prompt,
the user's history and a new question. The tiers are sized so the device overflows into host
and host into the LMDB store (kept under --store, so a second run starts with the first run's
pages on disk). Every request's logits are checked against the same request computed with
caching disabled, and every restored prefix's KV before its prefill (``cache.verify``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from tqdm import tqdm

from tiered_kv.cli.args import (
    add_storage_backend_arguments,
    check_storage_backend,
    default_cache_dir,
    non_negative_int,
    positive_int,
)
from tiered_kv.cli.preflight import check_store_dir
from tiered_kv.cli.report import write_json
from tiered_kv.cli.run_report import print_report, summarize
from tiered_kv.cli.store_status import check_remote_store, problem_lines
from tiered_kv.errors import StorageOpenError
from tiered_kv.names import (
    EvictionPolicyName,
    ModelKind,
    PrefetchPolicy,
    StorageLayout,
    WritePolicy,
)
from tiered_kv.storage_config import StorageConfig, is_embedded

if TYPE_CHECKING:
    from tiered_kv.engine.model import ModelConfig

HELP = "tiny reference models, real compute: serve with offload, verify the logits bitwise"


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--users", type=positive_int, default=6)
    w.add_argument("--rounds", type=positive_int, default=3)
    w.add_argument("--system-prompts", type=positive_int, default=2)
    w.add_argument("--system-tokens", type=positive_int, default=384)
    w.add_argument("--question-tokens", type=positive_int, default=64)
    w.add_argument("--answer-tokens", type=non_negative_int, default=16, help="decoded per turn")
    w.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model (random weights from --seed)")
    m.add_argument("--layers", type=positive_int, default=4)
    m.add_argument("--hidden", type=positive_int, default=128)
    m.add_argument("--heads", type=positive_int, default=4)
    m.add_argument("--kv-heads", type=positive_int, default=2)
    m.add_argument("--head-dim", type=positive_int, default=32)
    m.add_argument(
        "--attention",
        choices=("gqa", "mla", "dsa", "swa", "hybrid-linear"),
        default="gqa",
        help="mla: latent attention, kv_lora_rank = 2 x head-dim, rope dim = head-dim / 2 "
        "(--kv-heads is ignored); dsa: mla plus a sparse indexer (128-element fp8 keys, each "
        "query attends to its top 8 keys); swa: gqa with one full layer in every 4, the others "
        "attending to the last 48 positions, on a sliding-window pool; hybrid-linear: gqa "
        "every 4th layer, the others a short conv and a gated linear recurrence whose "
        "per-request state is cached at page boundaries beside the KV",
    )
    c = p.add_argument_group("cache")
    c.add_argument("--page-size", type=positive_int, default=16)
    c.add_argument("--device-tokens", type=positive_int, default=1024)
    c.add_argument("--host-tokens", type=positive_int, default=1536)
    c.add_argument("--storage-mib", type=positive_int, default=256)
    c.add_argument(
        "--store",
        default=None,
        help="store directory, kept between runs (created if its parent exists); None: "
        "run-store in the cache directory ($TIERED_KV_CACHE_DIR, else ~/.cache/tiered_kv)",
    )
    c.add_argument(
        "--storage-layout",
        default=StorageConfig.storage_layout,
        choices=StorageLayout.values(),
        help="lmdb: page bytes inside LMDB's map; slab: LMDB holds the index, page bytes in a "
        "preallocated file per namespace (a store directory holds one layout)",
    )
    add_storage_backend_arguments(c)
    c.add_argument("--fresh", action="store_true", help="empty the store first")
    c.add_argument(
        "--host-layout",
        default="page_first",
        choices=("layer_first", "page_first", "page_first_direct"),
    )
    c.add_argument("--device-policy", default="lru", choices=EvictionPolicyName.values())
    c.add_argument("--host-policy", default="lru", choices=EvictionPolicyName.values())
    c.add_argument("--write-policy", default="write_through", choices=WritePolicy.values())
    c.add_argument("--prefetch-policy", default="wait_complete", choices=PrefetchPolicy.values())
    c.add_argument("--prefetch-threshold", type=non_negative_int, default=16, help="tokens")
    p.add_argument("--no-verify", action="store_true", help="skip the no-cache recomputation")
    p.add_argument("--no-progress", action="store_true")


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if args.head_dim % 2:
        parser.error(f"--head-dim {args.head_dim} must be even (RoPE)")
    if args.attention in (ModelKind.MLA, ModelKind.DSA) and args.head_dim % 4:
        parser.error(
            f"--head-dim {args.head_dim} must be a multiple of 4 with --attention {args.attention} "
            "(its rope dim, head-dim / 2, must be even)"
        )
    check_storage_backend(args, parser)
    ps = args.page_size
    if ps & (ps - 1):
        parser.error(f"--page-size {ps} must be a power of two")
    for flag in ("device_tokens", "host_tokens"):
        v = getattr(args, flag)
        if v % ps or v < 2 * ps:
            parser.error(
                f"--{flag.replace('_', '-')} {v} must be a multiple of --page-size "
                f"{ps} and at least two pages"
            )
    longest = (
        args.system_tokens
        + args.rounds * (args.question_tokens + args.answer_tokens)
        + args.page_size
    )
    if longest > args.device_tokens:
        parser.error(
            f"the last round's prompt needs up to {longest} tokens on the device; "
            f"raise --device-tokens (now {args.device_tokens}) or shrink the workload"
        )
    default = args.store is None
    if default:
        args.store = str(default_cache_dir() / "run-store")
    if uses_store_dir(args):  # the default's parents are created with it
        check_store_dir("run-reference", "--store", args.store, create=True, parents=default)


def uses_store_dir(args: argparse.Namespace) -> bool:
    """Whether the run keeps pages under ``--store`` (not a remote store alone)."""
    return is_embedded(args.storage_backend) or args.storage_local_copy


def workload(args) -> list[tuple[int, int, list[int]]]:
    """(user, round, question tokens) in serving order; histories are built while serving."""
    rng = random.Random(args.seed)
    order = []
    for r in range(args.rounds):
        users = list(range(args.users))
        rng.shuffle(users)
        order += [
            (u, r, [rng.randrange(1, 500) for _ in range(args.question_tokens)]) for u in users
        ]
    return order


def model_identity(mc: ModelConfig) -> str:
    """The model's identity for its store keys: its class and a digest of every field of its
    config (the weights are drawn from the seed in it), so another model, or the same model with
    other weights, never reads these pages."""
    text = json.dumps(asdict(mc), sort_keys=True, default=str)
    return f"{type(mc).__name__}@{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def main(args: argparse.Namespace) -> int:
    from tiered_kv.cache import TieredKVCache
    from tiered_kv.config import TieredKVConfig
    from tiered_kv.engine.dsa import DSAModelConfig, TinyDSA
    from tiered_kv.engine.hybrid import HybridModelConfig, TinyHybrid
    from tiered_kv.engine.mla import MLAModelConfig, TinyMLA
    from tiered_kv.engine.model import ModelConfig, TinyLlama
    from tiered_kv.engine.serve import Server
    from tiered_kv.engine.swa import SWAModelConfig, TinySWA

    store_off = check_remote_store("run-reference", args)
    store = args.store
    if args.fresh and uses_store_dir(args):  # a remote store alone keeps nothing there
        shutil.rmtree(store, ignore_errors=True)
    if args.attention in (ModelKind.MLA, ModelKind.DSA):
        config_cls = DSAModelConfig if args.attention == ModelKind.DSA else MLAModelConfig
        mc = config_cls(
            num_layers=args.layers,
            hidden=args.hidden,
            num_heads=args.heads,
            head_dim=args.head_dim,
            kv_lora_rank=2 * args.head_dim,
            qk_nope_head_dim=args.head_dim,
            qk_rope_head_dim=args.head_dim // 2,
            v_head_dim=args.head_dim,
            seed=args.seed,
        )
        geometry = dict(
            model=str(args.attention),
            kv_lora_rank=mc.kv_lora_rank,
            qk_rope_head_dim=mc.qk_rope_head_dim,
        )
    elif args.attention == "hybrid-linear":
        mc = HybridModelConfig(
            num_layers=args.layers,
            hidden=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            seed=args.seed,
            full_layer_every=min(4, args.layers),
        )
        geometry = dict(
            model="hybrid_linear", head_num=args.kv_heads, head_dim=args.head_dim,
            full_layer_every=mc.full_layer_every, conv_kernel=mc.conv_kernel,
            linear_heads=mc.linear_heads, linear_key_dim=mc.linear_key_dim,
            linear_value_dim=mc.linear_value_dim,
        )  # fmt: skip
    else:
        swa = args.attention == ModelKind.SWA
        window = dict(sliding_window=48, full_layer_every=4) if swa else {}
        mc = (SWAModelConfig if swa else ModelConfig)(
            num_layers=args.layers,
            hidden=args.hidden,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            seed=args.seed,
            **window,
        )
        geometry = dict(head_num=args.kv_heads, head_dim=args.head_dim)
        if swa:
            geometry.update(model="swa", **window)
    cfg = TieredKVConfig.flat(
        num_layers=args.layers,
        **geometry,
        model_id=model_identity(mc),
        page_size=args.page_size,
        device_tokens=args.device_tokens,
        host_tokens=args.host_tokens,
        storage_bytes=args.storage_mib << 20,
        storage_path=store,
        storage_layout=args.storage_layout,
        storage_backend=args.storage_backend,
        storage_options=args.storage_options,
        storage_local_copy=args.storage_local_copy,
        host_layout=args.host_layout,
        device_policy=args.device_policy,
        host_policy=args.host_policy,
        write_policy=args.write_policy,
        prefetch_policy=args.prefetch_policy,
        prefetch_threshold=args.prefetch_threshold,
        verify_fraction=0.0 if args.no_verify else 1.0,  # every restored prefix recomputed
        max_context_len=max(
            8192,
            args.system_tokens + args.rounds * (args.question_tokens + args.answer_tokens) + 64,
        ),
    )
    rng = random.Random(args.seed + 1)
    systems = [
        [rng.randrange(1, 500) for _ in range(args.system_tokens)]
        for _ in range(args.system_prompts)
    ]
    history: dict[int, list[int]] = {u: [] for u in range(args.users)}
    models = {
        ModelKind.MLA: TinyMLA,
        ModelKind.DSA: TinyDSA,
        ModelKind.SWA: TinySWA,
        "hybrid-linear": TinyHybrid,
    }
    model = models.get(args.attention, TinyLlama)(mc)
    try:
        cache = TieredKVCache(cfg)
    except StorageOpenError as exc:  # a store of the other layout, a full disk, ...: one line
        raise SystemExit(
            f"tiered-kv run-reference: {exc} (--storage-layout chooses the layout, "
            "--fresh empties --store)"
        ) from exc
    records = []
    t0 = time.perf_counter()
    try:
        server = Server(model, cache)
        plan = workload(args)
        for user, rnd, question in tqdm(plan, desc="serving", unit="req", disable=args.no_progress):
            prompt = systems[user % args.system_prompts] + history[user] + question
            out, rec = server.serve(prompt, args.answer_tokens, verify=not args.no_verify)
            history[user] = history[user] + question + out
            records.append({"user": user, "round": rnd, **asdict(rec)})
        cache.drain()
        stats = cache.stats()
    finally:
        cache.close()
    elapsed = time.perf_counter() - t0
    result = summarize(args, cfg, records, stats, elapsed)
    print_report(result)
    if store_off:
        print(f"storage: {store_off}")
    for line in problem_lines(stats["storage"]):  # what the JSON's storage counters say went wrong
        print(line)
    write_json(args.json, result)
    # 1 only when verification ran and failed; --no-verify (passed is None) is a success.
    return 1 if result["verification"]["passed"] is False else 0
