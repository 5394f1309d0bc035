"""Benchmark: a sandbox's disk latency next to two sandboxes that write with O_DIRECT as fast as
they may, against the same sandbox alone, with the server's per-sandbox disk rates and without
them (the shared server restarted with every rate 0), by turns:

- a 4 MiB write + fsync in the measured sandbox (timed inside it);
- create → first output of a new sandbox;
- what each writer gets, read from its cgroup on this host over a window.

Not collected by the suite (no `test_` file name); run it on its own, as root, from the
repository's root:

    [SANDBAR_BENCH_DISK_ROUNDS=3] python3 -m pytest tests/e2e/bench_disk_fairness.py -q -s -p no:cacheprovider
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from e2b import Sandbox

FSYNC_LOOP = (
    "for i in $(seq {n}); do s=$(date +%s%N); "
    "dd if=/dev/zero of=/home/user/probe bs=4M count=1 conv=fsync status=none; "
    "e=$(date +%s%N); echo $(( (e - s) / 1000 )); done; rm -f /home/user/probe"
)
WRITER = (
    "while true; do dd if=/dev/zero of=/home/user/flood bs=1M count=256 oflag=direct "
    "status=none; done"
)


def percentile(samples: list, share: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def fsync_ms(sbx: Sandbox, samples: int) -> list:
    out = sbx.commands.run(FSYNC_LOOP.format(n=samples), timeout=300).stdout
    return [int(line) / 1000 for line in out.split()]


def create_to_output_ms(samples: int) -> list:
    times = []
    for _ in range(samples):
        started = time.monotonic()
        sbx = Sandbox.create(timeout=60)
        assert sbx.commands.run("echo ready").stdout.strip() == "ready"
        times.append((time.monotonic() - started) * 1000)
        sbx.kill()
    return times


def written_bytes(sandbox_id: str) -> int:
    v1 = Path("/sys/fs/cgroup/blkio/sandbar") / sandbox_id / "blkio.throttle.io_service_bytes"
    v2 = Path("/sys/fs/cgroup/sandbar") / sandbox_id / "io.stat"
    if v1.exists():
        return sum(
            int(parts[2])
            for parts in (line.split() for line in v1.read_text().splitlines())
            if len(parts) == 3 and parts[1] == "Write"
        )
    return sum(
        int(pair.split("=")[1]) for pair in v2.read_text().split() if pair.startswith("wbytes=")
    )


def row(name: str, samples: list) -> str:
    return (
        f"| {name} | {len(samples)} | {statistics.median(samples):.1f} | "
        f"{percentile(samples, 0.95):.1f} |"
    )


UNLIMITED = [
    "--sandbox-disk-read-mbps", "0", "--sandbox-disk-write-mbps", "0",
    "--sandbox-disk-read-iops", "0", "--sandbox-disk-write-iops", "0",
]
ROUNDS = int(os.environ.get("SANDBAR_BENCH_DISK_ROUNDS") or 3)
SAMPLES = 20
CREATES = 10
WINDOW_S = 5.0


def measure_round(results: dict) -> None:
    measured = Sandbox.create(timeout=600)
    try:
        results["alone"] += fsync_ms(measured, SAMPLES)
        results["create alone"] += create_to_output_ms(CREATES)
        writers = [Sandbox.create(timeout=600) for _ in range(2)]
        try:
            for w in writers:
                w.commands.run(WRITER, background=True)
            time.sleep(1)
            before = [written_bytes(w.sandbox_id) for w in writers]
            time.sleep(WINDOW_S)
            after = [written_bytes(w.sandbox_id) for w in writers]
            results["rates"] += [(a - b) / WINDOW_S / 2**20 for a, b in zip(after, before)]
            results["crowded"] += fsync_ms(measured, SAMPLES)
            results["create crowded"] += create_to_output_ms(CREATES)
        finally:
            for w in writers:
                w.kill()
    finally:
        measured.kill()


def report(name: str, results: dict) -> None:
    print(f"\n### {name}\n\n| measurement (ms) | n | p50 | p95 |\n|---|--:|--:|--:|")
    print(row("4 MiB write + fsync, alone", results["alone"]))
    print(row("4 MiB write + fsync, next to 2 O_DIRECT writers", results["crowded"]))
    print(row("create → first output, alone", results["create alone"]))
    print(row("create → first output, next to 2 O_DIRECT writers", results["create crowded"]))
    ratio = statistics.median(results["crowded"]) / statistics.median(results["alone"])
    create_ratio = statistics.median(results["create crowded"]) / statistics.median(results["create alone"])
    print(f"\nwrite + fsync p50 next to the writers: {ratio:.2f}× alone; create → first output {create_ratio:.2f}×")
    print("each writer's rate over {:.0f} s windows, MiB/s: {}".format(
        WINDOW_S, ", ".join(f"{r:.0f}" for r in results["rates"])))


def test_disk_fairness_with_and_without_rates(sandbar):
    keys = ["alone", "crowded", "create alone", "create crowded", "rates"]
    limited = {k: [] for k in keys}
    unlimited = {k: [] for k in keys}
    try:
        for _ in range(ROUNDS):
            measure_round(limited)
            sandbar.extra_args += UNLIMITED
            sandbar.restart()
            measure_round(unlimited)
            del sandbar.extra_args[-len(UNLIMITED):]
            sandbar.restart()
    finally:
        if sandbar.extra_args[-len(UNLIMITED):] == UNLIMITED:
            del sandbar.extra_args[-len(UNLIMITED):]
            sandbar.restart()
    report("with the default per-sandbox disk rates", limited)
    report("without disk rates", unlimited)
