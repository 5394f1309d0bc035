"""What the Python benchmarks in this directory share: a table row of a sample's median and
p95, and a sandbox's memory as its cgroup counts it on this host."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional


def summary(name: str, samples: list, digits: int = 1) -> str:
    """`| name | n | p50 | p95 |`, the figures with `digits` decimals."""
    samples = sorted(samples)
    p95 = samples[min(len(samples) - 1, int(len(samples) * 0.95))]
    return f"| {name} | {len(samples)} | {statistics.median(samples):.{digits}f} | {p95:.{digits}f} |"


def cgroup_bytes(sandbox_id: str) -> Optional[int]:
    """The memory a sandbox's cgroup holds (v1 `memory.usage_in_bytes` under
    `/sys/fs/cgroup/memory/sandbar/<id>`, v2 `memory.current`); `None` when neither can be
    read (not root, or not on the server's host)."""
    for path in (
        Path("/sys/fs/cgroup/memory/sandbar") / sandbox_id / "memory.usage_in_bytes",
        Path("/sys/fs/cgroup/sandbar") / sandbox_id / "memory.current",
    ):
        try:
            return int(path.read_text())
        except OSError:
            continue
    return None
