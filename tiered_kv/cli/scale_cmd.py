"""The main job: serve a long-context multi-turn workload at a real model's KV size with the
batched scheduler and synthetic KV, four ways in one run: tiered (device + host + disk), device
only, recomputing everything, and tiered with the load planner (per request, load what is faster
to load than to compute). The device holds ~10% of the workload's unique tokens, the host
~30% more, the disk all of it. Compute time is MODELED from a stated cost model (a named
accelerator's prefill tokens/s and decode step time) and modeled link bandwidths; bytes moved
and their GB/s are measured on this machine. Restored prefixes are verified byte for byte
(``--verify-fraction`` of them, all by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import TYPE_CHECKING

from tiered_kv.cli import omp_wait, preflight, run_defaults
from tiered_kv.cli.args import (
    add_storage_backend_arguments,
    check_storage_backend,
    float_in,
    fraction,
    positive_float,
    positive_int,
)
from tiered_kv.cli.observe import add_metrics_arguments, check_metrics_arguments, observed_run
from tiered_kv.cli.progress import add_progress_argument
from tiered_kv.cli.report import table, write_json
from tiered_kv.cli.run_defaults import PRESET_COST_MODELS, PRESET_SCALES, SERVED
from tiered_kv.cli.store_status import StoreWatch, check_remote_store, problem_lines
from tiered_kv.engine.cost_model import COST_MODELS
from tiered_kv.errors import InvalidArgumentError
from tiered_kv.names import ModelKind
from tiered_kv.storage_config import is_embedded

if TYPE_CHECKING:
    from tiered_kv.engine.scale_workload import ScaleConfig

HELP = (
    "the main job: a long-context workload at real model scale, tiered vs device-only vs "
    "recompute vs tiered with the load planner (synthetic KV, modeled compute)"
)
_D = run_defaults.SCALE  # ScaleConfig()'s, without importing torch to build the parser
# What the batched scheduler serves: full attention, sliding-window and hybrid-linear caches
# (SERVED: the presets of these kinds).
SERVED_KINDS = (ModelKind.MHA, ModelKind.MLA, ModelKind.DSA, ModelKind.SWA, ModelKind.HYBRID_LINEAR)
# ScaleConfig's ranges, checked by the parser: a bad value is refused naming its flag (not the
# field), before the engine (and torch) is imported.
_scale = float_in(0, run_defaults.MAX_SCALE, high_in=False)
_open_fraction = float_in(0, 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload (lengths in tokens, each multiplied by --scale)")
    w.add_argument("--preset", default=_D.preset, choices=SERVED, help="KV geometry")
    by_scale = ", ".join(f"{p} {v:g}" for p, v in PRESET_SCALES.items())
    w.add_argument(
        "--scale",
        type=_scale,
        default=None,
        help=f"None: the preset's ({by_scale}; else 1)",
    )
    w.add_argument("--users", type=positive_int, default=_D.users)
    w.add_argument("--active-users", type=positive_int, default=_D.active_users)
    w.add_argument("--docs", type=positive_int, default=_D.docs, help="user u reads doc u %% docs")
    w.add_argument("--rounds", type=positive_int, default=_D.rounds)
    w.add_argument("--system-tokens", type=positive_int, default=_D.system_tokens)
    w.add_argument("--doc-tokens", type=positive_int, default=_D.doc_tokens)
    w.add_argument("--question-tokens", type=positive_int, default=_D.question_tokens)
    w.add_argument("--answer-tokens", type=positive_int, default=_D.answer_tokens)
    w.add_argument("--seed", type=int, default=_D.seed)
    c = p.add_argument_group("cache and scheduler")
    c.add_argument("--page-size", type=positive_int, default=_D.page_size)
    c.add_argument("--chunk-tokens", type=positive_int, default=_D.chunk_tokens)
    c.add_argument("--max-running", type=positive_int, default=_D.max_running)
    c.add_argument("--device-fraction", type=_open_fraction, default=_D.device_fraction)
    c.add_argument("--host-fraction", type=_open_fraction, default=_D.host_fraction)
    c.add_argument(
        "--verify-fraction",
        type=fraction,
        default=_D.verify_fraction,
        help="restored prefixes checked byte for byte before their first forward (a wrong "
        "page is quarantined on every tier and computed again); 0 checks none",
    )
    c.add_argument(
        "--hisparse-topk",
        type=positive_int,
        default=_D.hisparse_topk,
        help="DSA presets' hisparse mode: latents selected per layer and token, and each "
        "request's device buffer (DeepSeek-V3.2: 2048)",
    )
    c.add_argument("--store-dir", default=None, help="where the store's temporary directory goes")
    add_storage_backend_arguments(c)
    observe = p.add_argument_group("observability")
    add_progress_argument(observe)
    add_metrics_arguments(observe)
    m = p.add_argument_group("modeled time")
    by_preset = ", ".join(f"{p} {c}" for p, c in PRESET_COST_MODELS.items())
    m.add_argument(
        "--cost-model",
        choices=tuple(COST_MODELS),
        help=f"None: the preset's own ({by_preset})",
    )
    m.add_argument("--pcie-gbps", type=positive_float, default=run_defaults.PCIE_GBPS)
    m.add_argument("--disk-gbps", type=positive_float, default=run_defaults.DISK_GBPS)


def config_of(args: argparse.Namespace) -> ScaleConfig:
    from tiered_kv.engine.scale_workload import ScaleConfig
    from tiered_kv.engine.synthetic_model import LinkModel

    links = LinkModel()
    given = (args.pcie_gbps * 1e9, args.disk_gbps * 1e9)
    if given != (links.host_to_device_bytes_per_s, links.storage_to_host_bytes_per_s):
        links = LinkModel(
            "given", *given, source=f"modeled: {args.pcie_gbps:g} GB/s host -> device, "
            f"{args.disk_gbps:g} GB/s storage -> host (--pcie-gbps, --disk-gbps)",
        )  # fmt: skip
    fields = {f.name for f in dataclasses.fields(ScaleConfig)} - {"links"}
    return ScaleConfig(**{f: getattr(args, f) for f in fields}, links=links)


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    check_storage_backend(args, parser)
    check_metrics_arguments(args, parser)
    if args.active_users > args.users:
        parser.error(
            f"--active-users {args.active_users} must be <= --users {args.users} (the users "
            "in session at once, out of all of them)"
        )
    # What would fail later, refused before any work (one line, status 2).
    if args.store_dir is not None:  # every mode's temporary directory goes there
        preflight.check_store_dir("run", "--store-dir", args.store_dir)
    preflight.check_port_free("run", args.metrics_host, args.metrics_port)
    try:
        cfg = config_of(args)
    except InvalidArgumentError as exc:
        parser.error(str(exc))
    preflight.check_run_fits(cfg)


def main(args: argparse.Namespace) -> int:
    from tiered_kv.engine.scale_run import default_modes, run_scale
    from tiered_kv.engine.scale_workload import sizes

    store_off = check_remote_store("run", args)
    cfg = config_of(args)
    s = sizes(cfg)
    tier = "disk" if is_embedded(args.storage_backend) else f"{args.storage_backend} store"
    held = ""
    if s.device_window_tokens:
        held = f"; window side {s.device_window_tokens} tokens"
    if s.state_bytes:
        held = f"; {s.state_bytes / 2**20:.1f} MiB of state per request"
    print(
        f"{cfg.model_preset.name} at scale {cfg.scale:g} ({s.bytes_per_token >> 10} KiB/token "
        f"over every layer that keeps KV{held}), working set "
        f"{s.working_set_tokens} tokens ({s.working_set_tokens * s.bytes_per_token / 2**30:.2f} "
        f"GiB); device {s.device_tokens} tokens "
        f"({100 * s.device_tokens / s.working_set_tokens:.0f}%), host {s.host_tokens} "
        f"({100 * s.host_tokens / s.working_set_tokens:.0f}%), {tier} {s.storage_bytes >> 20} MiB",
        flush=True,
    )
    if omp_wait.applied:
        print(omp_wait.applied, flush=True)
    load_before = _load()
    modes = default_modes(cfg)
    # Progress on stderr; the endpoint up until the report is out (and --metrics-linger).
    with observed_run(args, modes, cfg.users * cfg.rounds) as observers:
        watch = StoreWatch(observers.hooks)  # each mode's store counters, for the summary
        result = run_scale(cfg, modes, **watch.hooks)
        result["command"] = "run"
        result["config"] = {k: v for k, v in vars(args).items() if k not in ("json", "config")}
        result["load_average"] = {"before": load_before, "after": _load()}
        print_report(result)
        if store_off:
            print(f"storage: {store_off}")
        for mode, storage in watch.storage.items():
            for line in problem_lines(storage, mode):
                print(line)
        write_json(args.json, result)
        observers.finish()
    bad = sum(m["verification"]["mismatched_tokens"] for m in result["modes"].values())
    return 1 if bad else 0


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def print_report(res: dict) -> None:
    from tiered_kv.engine.scale_run import MODES, TIERED

    modes = [m for m in MODES if m in res["modes"]]
    r = res["modes"]
    cm = res["cost_model"]
    print(f"\nMODELED times: cost model {cm['name']} ({cm['source']})")
    print(f"MODELED loads: {res['links']['source']}")

    def row(name, fn):
        return [name, *(fn(r[m]) for m in modes)]

    def pct(m, tier):
        return f"{m['hits'][tier]} ({100 * m['hits'][tier] / max(1, m['prompt_tokens']):.0f}%)"

    rows = [
        row("requests", lambda m: m["requests"]),
        row("prompt + generated tokens", lambda m: m["prompt_tokens"] + m["generated_tokens"]),
        row("computed tokens", lambda m: m["computed_tokens"]),
        *(row(f"hit {t}", lambda m, t=t: pct(m, t)) for t in ("device", "host", "storage")),
        row("missed (computed)", lambda m: pct(m, "missed")),
        row("  planner declined host / storage", lambda m: "{declined_host_tokens} / "
            "{declined_storage_tokens}".format(**m["planner"])),
        row("modeled total s", lambda m: f"{m['modeled']['total_s']:.2f}"),
        row("  prefill / decode / load s", lambda m: "{prefill_s:.2f} / {decode_s:.2f} / "
            "{load_s:.2f}".format(**m["modeled"])),
        row("  verify s (not in total)", lambda m: f"{m['modeled']['verify_s']:.2f}"),
        row("modeled tokens/s", lambda m: f"{m['modeled']['tokens_per_s']:.0f}"),
        row("modeled TTFT p50 ms", lambda m: f"{1e3 * m['modeled']['ttft_p50_s']:.1f}"),
        row("modeled TTFT p99 ms", lambda m: f"{1e3 * m['modeled']['ttft_p99_s']:.1f}"),
        row("restored MiB / turn (every layer full)", lambda m: "{:.1f} ({:.1f})".format(
            m["bytes"]["restored_per_turn"] / 2**20,
            m["bytes"]["all_full_restored_per_turn"] / 2**20)),
        row("verified tokens", lambda m: m["verification"]["verified_tokens"]),
        row("mismatched tokens", lambda m: m["verification"]["mismatched_tokens"]),
        row("quarantined pages", lambda m: m["verification"]["quarantined_pages"]),
        row("steps (idle)", lambda m: f"{m['scheduler']['steps']} ({m['modeled']['idle_steps']})"),
        row("retracted", lambda m: m["scheduler"]["retracted"]),
        row("wall s", lambda m: f"{m['wall_s']:.1f}"),
    ]  # fmt: skip
    print()
    print(table(["", *modes], rows))
    print_kv(res["kv"])
    for mode in (m for m in TIERED if m in r):
        t = r[mode]["transfers"]
        rows = [[d, v["bytes"] / 2**20, v["seconds"], v["gbps"], v["ops"]] for d, v in t.items()]
        print(f"\n{mode} run, bytes moved (measured on this machine)")
        print(table(["transfer", "MiB", "s", "GB/s", "ops"], rows))
    g = res["gains"]
    for mode, prefix, bases in (
        ("tiered", "", ("device_only", "recompute")),
        ("tiered_planner", "planner_", ("tiered", "recompute")),
        ("hisparse", "hisparse_", ("tiered", "device_only", "recompute")),
    ):
        got = [b for b in bases if g.get(f"{prefix}throughput_vs_{b}") is not None]
        if got:
            print(f"\n{mode} vs " + ", ".join(
                f"{b}: {g[f'{prefix}throughput_vs_{b}']:.2f}x throughput, "
                f"{g[f'{prefix}ttft_p50_vs_{b}']:.2f}x TTFT p50" for b in got
            ) + " (modeled)", end="")  # fmt: skip
    print()
    h = r.get("hisparse", {}).get("hisparse")
    if h:
        moved = h["swap_bytes"] / 2**20
        print(
            f"hisparse: buffer {h['buffer_tokens']} latents + a page per running request, top "
            f"{h['topk']} selected per layer and token; swap-in {h['swap_loaded']} rows copied "
            f"from host ({moved:.1f} MiB), {h['swap_hits']} buffer hits, "
            f"{h['failed_copies']} failed copies; {h['checked_rows']} rows checked"
        )
    est = r.get("tiered_planner", {}).get("planner", {}).get("estimates")
    if est:
        print("planner's estimates at the end (fed by the modeled links): " + ", ".join(
            f"{d} {e['gbps']:.3g} GB/s + {1e6 * e['op_s']:.3g} us/op ({e['observed_ops']} ops)"
            for d, e in est.items() if d != "compute"
        ) + f"; compute cost: {est['compute']}")  # fmt: skip
    la = res.get("load_average") or {}
    print(f"wall {res['wall_s']:.1f} s; load average before {la.get('before')}, after "
          f"{la.get('after')} ({time.strftime('%H:%M:%S')})")  # fmt: skip


def print_kv(kv: dict) -> None:
    """What the cache holds and restores against the same model with every layer full."""
    layers = f"{kv['full_layers']} full"
    if kv["window_layers"]:
        layers += f", {kv['window_layers']} window"
    if kv["recurrent_layers"]:
        layers += f", {kv['recurrent_layers']} recurrent"
    kib = {k: kv[f"{k}_bytes_per_token"] / 1024 for k in ("full", "window", "all_full")}
    print(
        f"\nKV against the same model with every layer full attention ({kv['kind']}: {layers}; "
        f"per token {kib['full']:.4g} KiB on full layers, {kib['window']:.4g} KiB on window "
        f"layers, {kv['state_bytes'] / 2**20:.1f} MiB of state per request; every layer full: "
        f"{kib['all_full']:.4g} KiB per token)"
    )
    rows = []
    for label, name, per in (
        ("device MiB per request", "device", "request"),
        ("restored MiB per turn (tiered)", "restored", "turn"),
    ):
        if kv[f"{name}_per_{per}"] is not None:
            here, full = kv[f"{name}_per_{per}"], kv[f"all_full_{name}_per_{per}"]
            rows.append([label, here / 2**20, full / 2**20, f"{kv[f'{name}_saved']:.2f}x"])
    if kv.get("hisparse_device_per_request") is not None:
        here, full = kv["hisparse_device_per_request"], kv["all_full_device_per_request"]
        saved = f"{kv['hisparse_device_saved']:.2f}x"
        rows.append(["device MiB per request (hisparse)", here / 2**20, full / 2**20, saved])
    print(table(["", "this model", "every layer full", "saved"], rows))
