#!/usr/bin/env python3
"""The desktop template against a running server, through E2B's Desktop SDK: create → first
screenshot, a click → a screenshot that shows it, and the memory of idle desktops (their
memory cgroups, read on this host).

    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \\
    E2B_API_KEY=e2b_... python3 scripts/bench-desktop.py [--creates 10] [--clicks 20] [--idle 5]

Run it as root on the server's host for the memory figures (cgroup v1 `memory.usage_in_bytes`
under `/sys/fs/cgroup/memory/sandbar/<id>`, v2 `memory.current`).
"""

from __future__ import annotations

import argparse
import functools
import io
import statistics
import time

from e2b_desktop import Sandbox
from PIL import Image, ImageChops
import bench_common
from bench_common import creates_then_first_use, idle_memory_mib

# Whole milliseconds.
summary = functools.partial(bench_common.summary, digits=0)


def shot(desk: Sandbox) -> Image.Image:
    return Image.open(io.BytesIO(bytes(desk.screenshot()))).convert("RGB")


def differs(a: Image.Image, b: Image.Image) -> bool:
    return ImageChops.difference(a, b).getbbox() is not None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=10)
    parser.add_argument("--clicks", type=int, default=20)
    parser.add_argument("--idle", type=int, default=5)
    args = parser.parse_args()

    creates, first_shots = creates_then_first_use(
        lambda: Sandbox.create(timeout=120), lambda desk: desk.screenshot(), args.creates
    )
    print(f"{len(creates)} creates done", flush=True)

    # A right click on the desktop opens its menu, a click elsewhere closes it: each right
    # click timed until a screenshot shows the menu.
    desk = Sandbox.create(timeout=300)
    clicks = []
    try:
        for _ in range(args.clicks):
            before = shot(desk)
            started = time.monotonic()
            desk.right_click(400, 400)
            while not differs(before, shot(desk)):
                if time.monotonic() - started > 10:
                    raise SystemExit("a right click showed nothing on the screen within 10 s")
            clicks.append((time.monotonic() - started) * 1000)
            # A click elsewhere on the desktop closes the menu.
            desk.left_click(900, 650)
            time.sleep(0.5)
    finally:
        desk.kill()

    mib = idle_memory_mib(lambda: Sandbox.create(timeout=300), args.idle, settle_s=10)

    print("| measure (ms) | n | p50 | p95 |")
    print("|---|--:|--:|--:|")
    print(summary("create (SDK: create, Xvfb and session checked)", creates))
    print(summary("create → first screenshot", first_shots))
    print(summary("right click → screenshot showing the menu", clicks))
    if mib:
        print(f"\nidle desktop memory (cgroup, after 10 s): median {statistics.median(mib):.0f} MiB, "
              f"max {max(mib):.0f} MiB over {len(mib)} sandboxes")


if __name__ == "__main__":
    main()
