#!/usr/bin/env python3
"""Pause and resume latency against a running server, through its REST API (one HTTP
round trip each, as the SDK makes them), next to create.

    E2B_API_URL=http://127.0.0.1:3000 E2B_SANDBOX_URL=http://127.0.0.1:3000 \\
    E2B_API_KEY=e2b_... python3 scripts/bench-pause.py [--iterations 30] [--from-disk 10]

With `--from-disk N` it also pauses each sandbox N times until the server has checkpointed it
to disk (run the server with a short `--pause-grace-secs`, e.g. 1) and times the checkpoint
(as the server logs it) and the resume that restores it.

With `--large-mb N` it adds a sandbox holding N MiB (of a template `bench-large-<N>` it builds
from `base` with room for it) and, for comparison, times writing and reading N MiB on the
data directory's disk with `dd` (written with fdatasync, read with O_DIRECT: `--data-dir`).

With `--snapshots N` it also takes N snapshots of each sandbox (`POST .../snapshots`, the
sandbox running on), starts a sandbox from each (`POST /v2/sandboxes` with the snapshot's ID,
which restores its processes) and forks it N times with `count` 1.
"""

from __future__ import annotations

import argparse
import functools
import os
import subprocess
import time

import httpx
from e2b import Sandbox
import bench_common

# Milliseconds with 2 decimals.
summary = functools.partial(bench_common.summary, digits=2)


def timed_post(api: httpx.Client, path: str, expect: int, body=None):
    """POSTs `body` to `path` and checks the answer's status is `expect`; the answer and the
    milliseconds it took."""
    t = time.perf_counter()
    r = api.post(path, json=body)
    ms = (time.perf_counter() - t) * 1000
    assert r.status_code == expect, r.text
    return r, ms


def pause_ms(api: httpx.Client, sandbox_id: str) -> float:
    return timed_post(api, f"/sandboxes/{sandbox_id}/pause", 204)[1]


def resume_ms(api: httpx.Client, sandbox_id: str) -> float:
    return timed_post(api, f"/v2/sandboxes/{sandbox_id}/connect", 201, {"timeout": 300})[1]


def cycle(api: httpx.Client, sandbox_id: str, n: int):
    pauses, resumes = [], []
    for _ in range(n):
        pauses.append(pause_ms(api, sandbox_id))
        resumes.append(resume_ms(api, sandbox_id))
    return pauses, resumes


def checkpoint_ms(api: httpx.Client, sandbox_id: str, seen: int):
    """The duration of the sandbox's checkpoint number `seen` + 1, once the server logged it."""
    r = api.get(f"/v2/sandboxes/{sandbox_id}/logs")
    if r.status_code != 200:
        return None
    done = [e for e in r.json()["logs"] if e.get("message") == "sandbox checkpointed to disk"]
    if len(done) <= seen:
        return None
    return float(done[seen]["fields"]["ms"])


def from_disk(api: httpx.Client, sandbox_id: str, n: int):
    dumps, restores = [], []
    for i in range(n):
        pause_ms(api, sandbox_id)
        deadline = time.monotonic() + 120
        while (ms := checkpoint_ms(api, sandbox_id, i)) is None:
            assert time.monotonic() < deadline, "the server did not checkpoint the sandbox"
            time.sleep(0.05)
        dumps.append(ms)
        restores.append(resume_ms(api, sandbox_id))
    return dumps, restores


def create_ms(api: httpx.Client, template_id: str) -> float:
    """Times a create of a sandbox of `template_id` (a template or a snapshot), then kills it."""
    r, ms = timed_post(api, "/v2/sandboxes", 201, {"templateID": template_id, "timeout": 60})
    api.delete(f"/sandboxes/{r.json()['sandboxID']}")
    return ms


def snapshots(api: httpx.Client, sandbox_id: str, n: int):
    takes, creates, forks = [], [], []
    made = []
    try:
        for _ in range(n):
            r, ms = timed_post(api, f"/sandboxes/{sandbox_id}/snapshots", 201, {})
            takes.append(ms)
            snapshot_id = r.json()["snapshotID"]
            made.append(snapshot_id.split(":")[0])
            creates.append(create_ms(api, snapshot_id))
            r, ms = timed_post(api, f"/sandboxes/{sandbox_id}/fork", 201, {"count": 1, "timeout": 60})
            assert r.json()[0].get("sandbox"), r.text
            forks.append(ms)
            api.delete(f"/sandboxes/{r.json()[0]['sandbox']['sandboxID']}")
    finally:
        for template_id in made:
            api.delete(f"/templates/{template_id}")
    return takes, creates, forks


def large_template(api: httpx.Client, mb: int) -> str:
    """A template from `base` whose sandboxes may hold `mb` MiB; built once."""
    name = f"bench-large-{mb}"
    if api.get(f"/templates/aliases/{name}").status_code == 200:
        return name
    r = api.post("/v3/templates", json={"name": name, "memoryMB": mb + 512, "cpuCount": 2})
    assert r.status_code == 202, r.text
    template_id, build_id = r.json()["templateID"], r.json()["buildID"]
    r = api.post(f"/v2/templates/{template_id}/builds/{build_id}", json={"fromTemplate": "base", "steps": []})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 600
    while True:
        status = api.get(f"/templates/{template_id}/builds/{build_id}/status").json()["status"]
        if status == "ready":
            return name
        assert status != "error" and time.monotonic() < deadline, f"build of {name}: {status}"
        time.sleep(0.5)


def disk_write_read_ms(directory: str, mb: int) -> tuple:
    path = os.path.join(directory, ".bench-dd")
    try:
        t = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mb}", "conv=fdatasync"],
                       check=True, capture_output=True)
        write = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"], check=True, capture_output=True)
        return write, (time.perf_counter() - t) * 1000
    finally:
        if os.path.exists(path):
            os.remove(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--from-disk", type=int, default=0, help="checkpoint cycles per sandbox")
    parser.add_argument("--snapshots", type=int, default=0, help="snapshots (and forks) per sandbox")
    parser.add_argument("--large-mb", type=int, default=0, help="also a sandbox holding this many MiB")
    parser.add_argument("--data-dir", default="", help="where the server keeps checkpoints, for the dd comparison")
    args = parser.parse_args()
    api = httpx.Client(
        base_url=os.environ["E2B_API_URL"],
        headers={"X-API-Key": os.environ["E2B_API_KEY"]},
        timeout=60,
    )
    rows = []
    creates = [create_ms(api, "base") for _ in range(args.iterations)]
    rows.append(summary("create (`POST /v2/sandboxes`)", creates))
    hold = "python3 -c 'import time; b = bytearray({} << 20); [b.__setitem__(i, 1) for i in range(0, len(b), 4096)]; time.sleep(3600)'"
    cases = [("idle", "base", 0), ("100 MiB resident", "base", 100)]
    if args.large_mb:
        cases.append((f"{args.large_mb} MiB resident", large_template(api, args.large_mb), args.large_mb))
    for label, template, resident_mb in cases:
        sbx = Sandbox.create(template, timeout=300)
        try:
            if resident_mb:
                sbx.commands.run(hold.format(resident_mb), background=True)
                # Touching every page takes about a second per 200 MiB here.
                time.sleep(2 + resident_mb / 200)
            pauses, resumes = cycle(api, sbx.sandbox_id, args.iterations)
            rows.append(summary(f"pause, {label}", pauses))
            rows.append(summary(f"resume (`connect`), {label}", resumes))
            if args.from_disk:
                dumps, restores = from_disk(api, sbx.sandbox_id, args.from_disk)
                rows.append(summary(f"checkpoint to disk (server side), {label}", dumps))
                rows.append(summary(f"resume from disk (`connect`), {label}", restores))
            if args.snapshots:
                takes, starts, forks = snapshots(api, sbx.sandbox_id, args.snapshots)
                rows.append(summary(f"snapshot (`POST .../snapshots`), {label}", takes))
                rows.append(summary(f"create from the snapshot, {label}", starts))
                rows.append(summary(f"fork, count 1, {label}", forks))
        finally:
            sbx.kill()
    if args.large_mb and args.data_dir:
        writes, reads = [], []
        for _ in range(3):
            w, r = disk_write_read_ms(args.data_dir, args.large_mb)
            writes.append(w)
            reads.append(r)
        rows.append(summary(f"dd write {args.large_mb} MiB (fdatasync), data disk", writes))
        rows.append(summary(f"dd read {args.large_mb} MiB (O_DIRECT), data disk", reads))
    print("| measurement | n | p50 ms | p95 ms |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
