"""What the disk under a storage benchmark is, and the page cache around it.

A cold get must read the disk: ``drop_page_cache`` syncs and writes ``3`` to
``/proc/sys/vm/drop_caches`` (root only; False otherwise), and ``cached_mib`` reads how much
page cache is left. ``disk_lines`` are the details a storage result records: file system,
mount options, free space, the block device's queue settings.
"""

from __future__ import annotations

import os
import shutil

DROP_CACHES = "/proc/sys/vm/drop_caches"
NO_COLD = "cold get not measured: cannot drop page cache"
GIB = 1 << 30


def drop_page_cache() -> bool:
    """``sync`` and drop the page cache; False when this process may not."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def cached_mib() -> float:
    """The page cache's size (``Cached:`` of ``/proc/meminfo``), MiB; nan where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Cached:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def mount_of(path: str) -> tuple[str, str, str, str]:
    """(device, mount point, fs type, options) of the mount holding ``path``."""
    path = os.path.realpath(path)
    best = ("?", "/", "?", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype, opts = line.split()[:4]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype, opts)
    except OSError:
        pass
    return best


def disk_of(path: str) -> str:
    """The block device under ``path``: name, rotational flag, read-ahead, scheduler, model."""
    st = os.stat(path)
    sysdir = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    try:
        real = os.path.realpath(sysdir)
        if not os.path.exists(os.path.join(real, "queue")):  # a partition: its disk has queue/
            real = os.path.dirname(real)

        def read(name: str) -> str:
            try:
                with open(os.path.join(real, name)) as f:
                    return f.read().strip()
            except OSError:
                return "?"

        return (
            f"{os.path.basename(real)} (rotational flag {read('queue/rotational')}, "
            f"read_ahead_kb {read('queue/read_ahead_kb')}, scheduler "
            f"{read('queue/scheduler')}, model {read('device/model') or '?'})"
        )
    except OSError:
        return "unknown"


def disk_lines(workdir: str, can_drop: bool) -> list[str]:
    """The work dir's file system and disk, and whether cold gets can be measured."""
    dev, mnt, fstype, opts = mount_of(workdir)
    du = shutil.disk_usage(workdir)
    return [
        f"work dir {workdir}: {fstype} on {dev} mounted at {mnt} ({opts}); "
        f"free {du.free / GIB:.0f} GiB of {du.total / GIB:.0f} GiB",
        f"disk {disk_of(workdir)}",
        f"uid {os.geteuid()}; page cache drop ({DROP_CACHES}): "
        + ("yes" if can_drop else f"NO -- {NO_COLD}"),
    ]
