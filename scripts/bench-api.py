#!/usr/bin/env python3
"""Server cost of many idle sandboxes (metrics sampling included) and API request throughput,
against a running server started by hand:

    sandbar serve --listen 127.0.0.1:3999 --data-dir /var/tmp/sandbar-e2e --max-sandboxes 200
    E2B_API_URL=http://127.0.0.1:3999 E2B_API_KEY=e2b_... \\
        python3 scripts/bench-api.py [--sandboxes 100] [--window 60] [--requests 20000]

A template with little memory for hosts that cannot grant 100 × 512 MiB:

    python3 -c 'from e2b import Template; Template.build(Template().from_template("base"),
        alias="small", cpu_count=1, memory_mb=128)'

1. Creates N sandboxes, lets them settle, then reads the server process's CPU time (utime +
   stime from /proc) over a window: with nothing else happening, that is what the server spends
   on N idle sandboxes (its reaper, the metrics sampler every 2 s, timeouts). Run it once with
   `--sandboxes 0` for the idle server's own floor.
2. Throughput of `GET /sandboxes/{id}` (API key check, store read) next to `GET /health` with
   ApacheBench (`ab`, Debian `apache2-utils`) at a fixed concurrency.
Every sandbox it creates is killed before it exits.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import time

import httpx


def server_pid(port: int) -> int:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(cmd) > 1 and os.path.basename(cmd[0]) == b"sandbar" and b"serve" in cmd:
            if any(f":{port}".encode() in c for c in cmd):
                return int(pid)
    raise SystemExit(f"no `sandbar serve` listening on port {port}")


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of stat(5); index 0 here is field 3.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ab(url: str, requests: int, concurrency: int, key: str | None) -> tuple[float, float]:
    cmd = ["ab", "-q", "-k", "-n", str(requests), "-c", str(concurrency)]
    if key:
        cmd += ["-H", f"X-API-Key: {key}"]
    out = subprocess.run(cmd + [url], check=True, capture_output=True, text=True).stdout
    if re.search(r"^Non-2xx responses:\s+(\d+)", out, re.M):
        raise SystemExit(f"ab saw errors from {url}:\n{out}")
    rps = float(re.search(r"Requests per second:\s+([\d.]+)", out).group(1))
    p50 = float(re.search(r"^\s+50%\s+(\d+)", out, re.M).group(1))
    return rps, p50


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sandboxes", type=int, default=100)
    # The server refuses sandboxes whose memory limits add up past the host's memory: on a
    # small host, use a template with a small `memoryMB` (see the module docstring).
    parser.add_argument("--template", default="base")
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    base = os.environ["E2B_API_URL"].rstrip("/")
    key = os.environ["E2B_API_KEY"]
    pid = server_pid(int(base.rsplit(":", 1)[1]))
    api = httpx.Client(base_url=base, headers={"X-API-Key": key}, timeout=120)
    created: list[str] = []
    try:
        for _ in range(args.sandboxes):
            r = api.post("/v2/sandboxes", json={"templateID": args.template, "timeout": 3600})
            r.raise_for_status()
            created.append(r.json()["sandboxID"])
        time.sleep(args.settle)
        before, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(args.window)
        spent, elapsed = cpu_seconds(pid) - before, time.monotonic() - t0
        print(f"server CPU with {len(created)} idle sandboxes: {spent:.3f} s over {elapsed:.1f} s "
              f"= {100 * spent / elapsed:.3f} % of one core")
        probe = created[0] if created else None
        if probe is None:
            r = api.post("/v2/sandboxes", json={"templateID": args.template, "timeout": 600})
            r.raise_for_status()
            probe = r.json()["sandboxID"]
            created.append(probe)
        print(f"| endpoint | requests | concurrency | requests/s | p50 ms |")
        print(f"|---|--:|--:|--:|--:|")
        for name, url, auth in (
            ("GET /health", f"{base}/health", None),
            ("GET /sandboxes/{id}", f"{base}/sandboxes/{probe}", key),
        ):
            ab(url, min(2000, args.requests), args.concurrency, auth)  # warm-up
            rps, p50 = ab(url, args.requests, args.concurrency, auth)
            print(f"| `{name}` | {args.requests} | {args.concurrency} | {rps:.0f} | {p50:.0f} |")
    finally:
        for sandbox_id in created:
            api.delete(f"/sandboxes/{sandbox_id}")


if __name__ == "__main__":
    main()
