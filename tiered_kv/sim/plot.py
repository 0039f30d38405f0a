"""The sweep's plot: hit rate against device capacity per policy with both bounds, and the
per-tier split (device / host / storage) as stacked bars, one bar per policy and capacity."""

from __future__ import annotations

import itertools

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")
_TIERS = (("device_rate", "device", "#1f77b4"), ("host_rate", "host", "#ff7f0e"))
_STORAGE = ("storage_rate", "storage", "#2ca02c")


def plot(result: dict, path: str, *, log_capacity: bool = False) -> None:
    """Write the figure to ``path`` (PNG). Imports matplotlib here, so the sweep never needs it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    caps = list(dict.fromkeys(r["device_blocks"] for r in rows))
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(12, 4.8))

    styles = zip(itertools.cycle(_MARKERS), itertools.cycle(_LINES), strict=False)
    for policy, (marker, line) in zip(policies, styles, strict=False):
        mine = [r for r in rows if r["policy"] == policy]
        ax.plot(
            [r["device_blocks"] for r in mine],
            [100 * r["hit_rate"] for r in mine],
            marker=marker,
            linestyle=line,
            label=policy,
        )
    first = [r for r in rows if r["policy"] == policies[0]]
    x = [r["device_blocks"] for r in first]
    ax.plot(
        x,
        [100 * r["effective_rate"] for r in first],
        "k-",
        lw=2.5,
        alpha=0.35,
        label="Belady, effective capacity",
    )
    ax.plot(
        x,
        [100 * r["total_rate"] for r in first],
        "k:",
        lw=1.5,
        label="Belady, device + host + storage",
    )
    if log_capacity:
        ax.set_xscale("log")
    ax.set_xlabel("device capacity (blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title("hit rate vs device capacity")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)

    tiers = _TIERS + ((_STORAGE,) if any(r["storage_blocks"] for r in rows) else ())
    width = 0.8 / len(policies)
    for ci, cap in enumerate(caps):
        for pi, policy in enumerate(policies):
            r = next(r for r in rows if r["device_blocks"] == cap and r["policy"] == policy)
            bottom = 0.0
            for key, label, color in tiers:
                h = 100 * r[key]
                bars.bar(
                    ci + (pi - (len(policies) - 1) / 2) * width,
                    h,
                    width * 0.9,
                    bottom=bottom,
                    color=color,
                    label=label if ci == pi == 0 else None,
                )
                bottom += h
    bars.set_xticks(range(len(caps)), [str(c) for c in caps])
    bars.set_xlabel(f"device capacity (blocks); bars left to right: {', '.join(policies)}")
    bars.set_ylabel("block hit rate (%)")
    bars.set_title("hits per tier")
    bars.grid(alpha=0.3, axis="y")
    bars.legend(fontsize=8)
    fig.suptitle(
        f"{_short(result['source'])}, {result['write_policy']}, "
        f"host {result['host_ratio']:g}x device"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _short(source: str) -> str:
    return source.rsplit("/", 1)[-1]
