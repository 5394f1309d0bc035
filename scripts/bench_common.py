"""What the Python benchmarks in this directory share: table rows of a sample's median and
p95 (or p90 and minimum), timing, sandboxes timed from create to a first use, and a sandbox's
memory as its cgroup counts it on this host."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple


def summary(name: str, samples: list, digits: int = 1) -> str:
    """`| name | n | p50 | p95 |`, the figures with `digits` decimals."""
    samples = sorted(samples)
    p95 = samples[min(len(samples) - 1, int(len(samples) * 0.95))]
    return f"| {name} | {len(samples)} | {statistics.median(samples):.{digits}f} | {p95:.{digits}f} |"


def row_p90(name: str, samples: list, digits: int = 1) -> str:
    """`| name | n | p50 | p90 | min |`, the figures with `digits` decimals."""
    samples = sorted(samples)
    p90 = samples[min(len(samples) - 1, int(len(samples) * 0.9))]
    p50 = statistics.median(samples)
    return f"| {name} | {len(samples)} | {p50:.{digits}f} | {p90:.{digits}f} | {samples[0]:.{digits}f} |"


def timed(fn: Callable[[], object]) -> float:
    """How long `fn()` took, in milliseconds."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def creates_then_first_use(create: Callable[[], object], use: Callable[[object], object], n: int) -> Tuple[List[float], List[float]]:
    """`n` times: a sandbox made by `create()`, used once by `use(sandbox)`, then killed; the
    milliseconds from the create's start to its return, and to the end of the first use."""
    creates, first_uses = [], []
    for _ in range(n):
        started = time.monotonic()
        sandbox = create()
        created = time.monotonic()
        use(sandbox)
        done = time.monotonic()
        creates.append((created - started) * 1000)
        first_uses.append((done - started) * 1000)
        sandbox.kill()
    return creates, first_uses


def idle_memory_mib(create: Callable[[], object], n: int, settle_s: float, use: Optional[Callable[[object], object]] = None) -> List[float]:
    """The cgroup memory (cgroup_bytes, in MiB) of `n` sandboxes made by `create()`, each used
    once by `use` where given, read after `settle_s` seconds of idling, of those whose cgroup
    could be read (none where not root or not on the server's host); all killed after."""
    idle: list = []
    try:
        for _ in range(n):
            idle.append(create())
        if use is not None:
            for sandbox in idle:
                use(sandbox)
        time.sleep(settle_s)
        usage = [cgroup_bytes(sandbox.sandbox_id) for sandbox in idle]
        return [u / (1 << 20) for u in usage if u is not None]
    finally:
        for sandbox in idle:
            sandbox.kill()


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
