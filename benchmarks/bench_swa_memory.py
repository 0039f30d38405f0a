"""A sliding-window model against the same model with every layer full attention, served through
the tiered cache: device memory a request holds, and bytes restored per hit.

The SWA model has one full layer per ``--full-every`` layers, the rest window layers of
``--window`` tokens; the other has every layer full (same heads, dims, dtype). Per context length:

- a request prefills ``--tokens`` and decodes ``--decode`` tokens (random KV written through
  ``write_kv``); *device KV MiB* is what it holds at its end: full slots x full-layer bytes plus
  window slots x window-layer bytes (the window-aware cache gave back the window KV its queries
  left behind), against tokens x every layer's bytes;
- the request finishes, its pages are evicted to host, and the next turn (its tokens plus 16)
  begins: *restored MiB* are the bytes the host -> device load copied (counted at the host pools'
  own copy calls, per layer and token), against the all-full model's.

Every restored byte is checked against what was written (full layers everywhere, window layers
inside the next query's window). Run::

    .venv/bin/python benchmarks/bench_swa_memory.py
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from tiered_kv.bench import machine, report
from tiered_kv.cache import TieredKVCache
from tiered_kv.config import TieredKVConfig

C = report.Column
COLUMNS = [
    C("tokens", 7), C("all-full MiB", 12, ".1f"), C("swa MiB", 8, ".1f"), C("saved", 6, ".2f"),
    C("full restored MiB", 17, ".1f"), C("swa restored MiB", 16, ".1f"), C("saved", 6, ".2f"),
]  # fmt: skip


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--full-every", type=int, default=4)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--page-size", type=int, default=64)
    return p.parse_args(argv)


def config(args, swa: bool, tokens: int) -> TieredKVConfig:
    room = tokens + args.decode + 32 + 2 * args.page_size
    extra = (
        dict(model="swa", sliding_window=args.window, full_layer_every=args.full_every)
        if swa
        else {}
    )
    return TieredKVConfig.flat(
        num_layers=args.layers, head_num=2, head_dim=64, page_size=args.page_size,
        device_tokens=room, host_tokens=room, max_requests=4, max_context_len=2 * room,
        storage_bytes=0, storage_path=tempfile.mkdtemp(prefix="tkv-swa-mem-"), **extra,
    )  # fmt: skip


def token_layer_bytes(cache: TieredKVCache, layer: int) -> int:
    pool = cache.device_pool
    k, v = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
    return k[0].numel() * k.element_size() + v[0].numel() * v.element_size()


class LoadCounter:
    """Bytes the host pools copy into the device, counted at each member's per-layer load."""

    def __init__(self, cache: TieredKVCache) -> None:
        self.bytes = 0
        # Read before any load: a buffer getter waits for its layer's load (the copy thread
        # must not).
        self.per_token = {
            i: token_layer_bytes(cache, i) for i in range(cache.config.geometry.num_layers)
        }
        members = getattr(cache.host_pool, "members", (cache.host_pool,))
        for m in members:
            self._wrap(cache, m)

    def _wrap(self, cache, member) -> None:
        inner = member.load_to_device_per_layer

        def counted(pool, host, device, layer_id, io_backend="kernel"):
            self.bytes += len(device) * self.per_token[layer_id]
            return inner(pool, host, device, layer_id, io_backend)

        member.load_to_device_per_layer = counted


def measure(args, swa: bool, tokens: int, gen: torch.Generator) -> tuple[float, float]:
    cache = TieredKVCache(config(args, swa, tokens))
    try:
        layers = range(args.layers)
        window = set(cache.config.geometry.swa_layer_ids()[1]) if swa else set()
        written: dict[int, torch.Tensor] = {}
        prompt = torch.randint(0, 50_000, (tokens,), generator=gen).tolist()
        req = cache.begin(prompt)
        slots = [cache.extend(req, prompt)]
        for _ in range(args.decode):
            slots.append(cache.decode(req, int(torch.randint(0, 50_000, (1,), generator=gen))))
        allocs = torch.cat(slots)
        for layer in layers:
            k = torch.randn(len(allocs), 2, 64, generator=gen).half()
            cache.write_kv(layer, allocs, k, -k)
            written[layer] = k
        a = cache.allocator
        if swa:
            full_used = a.size - a.full_available_size()
            window_used = a.size_swa - a.swa_available_size()
            held = sum(
                (window_used if i in window else full_used) * token_layer_bytes(cache, i)
                for i in layers
            )
        else:
            used = a.size - a.available_size()
            held = used * sum(token_layer_bytes(cache, i) for i in layers)
        turn = req.tokens + torch.randint(0, 50_000, (16,), generator=gen).tolist()
        cache.finish(req)
        cache.drain()
        cache.manager.evict_device(1 << 30)
        cache.drain()
        counter = LoadCounter(cache)
        nxt = cache.begin(turn)
        cache.prepare_forward(nxt)
        if nxt.prefix_len != len(allocs) // args.page_size * args.page_size:
            raise SystemExit(f"expected a hit of the whole conversation, got {nxt.prefix_len}")
        _check(cache, nxt, written, window, args.window)
        cache.abort(nxt)
        return held / 2**20, counter.bytes / 2**20
    finally:
        cache.close()


def _check(cache, req, written, window, w) -> None:
    end = req.prefix_len
    pool = cache.device_pool
    for layer, k in written.items():
        idx = req.slots[:end].to(torch.int64)
        lo = 0
        if layer in window:
            lo = max(0, end - w + 1)
            idx = cache.allocator.translate_loc_from_full_to_swa(idx[lo:])
        buf = pool.get_key_buffer(layer)
        got = buf[idx].view(torch.uint8)
        if not torch.equal(got, k[lo:end].to(buf.dtype).view(torch.uint8)):
            raise SystemExit(f"layer {layer}: restored KV differs")


def main(argv=None) -> int:
    args = parse_args(argv)
    watch = machine.LoadWatch()
    print("\n".join(machine.condition_lines(machine.machine_info(torch.device("cpu")))))
    gen = torch.Generator().manual_seed(14)
    rows = []
    for tokens in args.tokens:
        full_held, full_restored = measure(args, False, tokens, gen)
        swa_held, swa_restored = measure(args, True, tokens, gen)
        rows.append([tokens, full_held, swa_held, full_held / swa_held, full_restored,
                     swa_restored, full_restored / swa_restored])  # fmt: skip
    print(
        f"{args.layers} layers, 1 full per {args.full_every}, window {args.window}, "
        f"page {args.page_size}, decode {args.decode}"
    )
    print("\n".join(report.fixed_table(COLUMNS, rows)))
    print("(device KV a request holds at its end; bytes its next turn loads back from host)")
    loads = watch.finish()
    print("load average: " + ", ".join(f"{k} {v}" for k, v in loads.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
