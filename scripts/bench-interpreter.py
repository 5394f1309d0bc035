#!/usr/bin/env python3
"""The code interpreter template against a running server, through E2B's code interpreter SDK:
create → first `run_code("1+1")` result, the round trip of `run_code("1+1")` on a warm
kernel, and the memory of idle interpreter sandboxes (their memory cgroups, read on this host).

    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \\
    E2B_API_KEY=e2b_... python3 scripts/bench-interpreter.py [--creates 20] [--calls 100] [--idle 5]

Run it as root on the server's host for the memory figures (cgroup v1 `memory.usage_in_bytes`
under `/sys/fs/cgroup/memory/sandbar/<id>`, v2 `memory.current`).
"""

from __future__ import annotations

import argparse
import statistics
import time

from e2b_code_interpreter import Sandbox
from bench_common import creates_then_first_use, idle_memory_mib, summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--idle", type=int, default=5)
    args = parser.parse_args()

    def two(sbx: Sandbox) -> None:
        assert sbx.run_code("1+1").text == "2"

    creates, first_results = creates_then_first_use(lambda: Sandbox.create(timeout=120), two, args.creates)

    sbx = Sandbox.create(timeout=300)
    try:
        sbx.run_code("1+1")
        trips = []
        for _ in range(args.calls):
            started = time.monotonic()
            assert sbx.run_code("1+1").text == "2"
            trips.append((time.monotonic() - started) * 1000)
    finally:
        sbx.kill()

    mib = idle_memory_mib(lambda: Sandbox.create(timeout=300), args.idle, settle_s=5, use=lambda s: s.run_code("1+1"))

    print("| measure | n | p50 ms | p95 ms |")
    print("|---|---|---|---|")
    print(summary("create (returns once the default kernel runs)", creates))
    print(summary("create → first run_code('1+1') result", first_results))
    print(summary("run_code('1+1') round trip, warm kernel", trips))
    if mib:
        print(
            f"\nidle interpreter sandbox, memory cgroup usage (page cache included): "
            f"median {statistics.median(mib):.1f} MiB over {len(mib)} sandboxes"
        )


if __name__ == "__main__":
    main()
