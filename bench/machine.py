"""What the numbers were measured on: CPU, cores, memory, disk, versions, date."""

from __future__ import annotations

import os
import platform
import shutil
from datetime import UTC, datetime
from pathlib import Path


def _cpuinfo_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return float("nan")


def _filesystem(path: Path) -> str:
    """The device and type that ``path`` lives on (from /proc/mounts, longest mount prefix)."""
    best = ("?", "?", "")
    try:
        resolved = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype, *_ = line.split()
            if (resolved == mnt or resolved.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                best = (dev, fstype, mnt)
    except OSError:
        pass
    return f"{best[0]} ({best[1]})"


def describe(work_dir: Path) -> dict[str, str]:
    import ray
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpuinfo_model(),
        "cores": str(os.cpu_count()),
        "memory": f"{_mem_total_gib():.1f} GiB",
        "disk": f"{_filesystem(work_dir)}, {shutil.disk_usage(work_dir).free / 1024**3:.0f} GiB free",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "load average at start": " ".join(f"{x:.2f}" for x in load),
    }
