"""Why a write through LMDB's map is slower than ``write()`` into a new file, and what helps.

The same random bytes (``--mib``, in chunks of ``--chunk-mib``) go into a new file on the
benchmark's file system, five ways, in the same run (each repeat, every way once, in order;
``tiered_kv.bench.map_write`` says what each way does):

- ``pwrite``: ``os.pwrite`` of each chunk (what the file-per-page store's set does);
- ``map sparse``: ``ftruncate``, then a memcpy of each chunk into a shared writable mapping
  (LMDB with ``writemap`` on a fresh region: one write fault per 4 KiB page);
- ``map reserved``: the same after ``fallocate`` of the whole file (what ``LMDBStorage`` does);
- ``map reserved+huge``: the same with ``MADV_HUGEPAGE`` (``LMDBStorage(hugepages=True)``);
- ``map reused``: a memcpy into the mapping of a file whose pages are already in the page cache
  and mapped (a store at its budget reusing freed pages: no allocation, no fault).

GB/s is 1e9 bytes/s; ``vs pwrite`` is a way's median over pwrite's median. The file is
``os.sync``-ed and removed between ways; every way's file is read back and compared with the
source before it is removed. ``--json`` writes the results with the config and machine details.

Run::

    .venv/bin/python benchmarks/bench_map_write.py
"""

from __future__ import annotations

import argparse
import os  # noqa: F401  (tests patch os.pwrite through here)
import sys
import tempfile
from collections.abc import Sequence

from tiered_kv.bench import machine, report
from tiered_kv.bench.map_write import WAYS, Result, measure_map_write
from tiered_kv.bench.verify import exit_on_failure

__all__ = ["WAYS", "Result", "main"]


def main(argv: Sequence[str] | None = None) -> list[Result]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes written per way, MiB")
    ap.add_argument("--chunk-mib", type=float, default=2.0, help="bytes per write / memcpy")
    ap.add_argument("--repeats", type=int, default=5, help="repeats (median)")
    ap.add_argument("--dir", default=None, help="parent of the files (default TMPDIR)")
    ap.add_argument("--json", metavar="PATH", help="also write the results (with config, machine)")
    args = ap.parse_args(argv)
    if args.mib < 1 or args.repeats < 1 or args.chunk_mib <= 0:
        ap.error("--mib and --repeats must be >= 1 and --chunk-mib > 0")
    workdir = args.dir or tempfile.gettempdir()
    watch = machine.LoadWatch()
    load = " ".join(f"{x:.2f}" for x in watch.before or ())
    print(
        f"{args.mib} MiB per way in {args.chunk_mib:g} MiB chunks, {args.repeats} repeats "
        f"(median), under {workdir}; load average {load}"
    )
    with exit_on_failure():
        results = measure_map_write(args.mib, args.chunk_mib, args.repeats, workdir)
    print(f"{'way':<20} {'GB/s':>6} {'vs pwrite':>9}  samples")
    for r in results:
        samples = " ".join(f"{x:.2f}" for x in r.samples_gbps)
        print(f"{r.way:<20} {r.gbps:>6.2f} {r.ratio:>9.2f}  {samples}")
    loads = watch.finish()
    noise = machine.noise_check(results[0].samples_gbps, list(loads.values()))
    if noise.noisy:
        print("noise (pwrite, the baseline, or the load): " + "; ".join(noise.reasons))
    info = {**machine.machine_info(), **loads, "noise": list(noise.reasons)}
    payload = {"results": results}
    report.write_json(args.json, payload, config=report.config_of(args), machine=info)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
