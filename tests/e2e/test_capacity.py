"""One server holds a thousand idle sandboxes of the default template, each answering a command,
and a kill -9 of the server loses none of them.

Memory is admitted by what the host has, not by the sandboxes' limits: 1,000 × 512 MiB is far
more than the host's memory, and an idle sandbox uses about 1 MiB. Only the team's concurrency
limit is raised. Bounded: sandboxes are made, checked and killed 16 at a time (a few minutes on
two cores). The count can be lowered with SANDBAR_E2E_CAPACITY for a quick run.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List

import httpx
import pytest

from e2e_util import METRICS_HEADERS, sandbar_cli, unique

COUNT = int(os.environ.get("SANDBAR_E2E_CAPACITY") or 1000)
WORKERS = 16


@pytest.fixture(scope="module")
def crowd(sandbar):
    team = json.loads(sandbar_cli(sandbar, "team", "create", unique("capacity"), "--requests-per-minute", "0"))
    sandbar_cli(sandbar, "team", "set-limits", team["teamID"], "--max-sandboxes", str(COUNT))
    headers = {"X-API-Key": team["apiKey"]}
    made: List[dict] = []
    try:
        yield team, headers, made
    finally:
        def kill(sandbox: dict) -> None:
            httpx.delete(f"{sandbar.url}/sandboxes/{sandbox['sandboxID']}", headers=headers, timeout=60)

        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(kill, made))


def _answers(sandbar, sandbox: dict) -> str:
    """Runs `echo` through the agent as the SDK does (Connect over the edge)."""
    from e2b import Sandbox

    sbx = Sandbox.connect(sandbox["sandboxID"], api_key=sandbox["apiKey"])
    return sbx.commands.run(f"echo {sandbox['sandboxID']}").stdout.strip()


def test_a_thousand_idle_sandboxes_answer_and_survive_a_restart(sandbar, crowd):
    team, headers, made = crowd

    def create(_: int) -> dict:
        r = httpx.post(f"{sandbar.url}/sandboxes", json={"templateID": "base", "timeout": 1800},
                       headers=headers, timeout=120)
        assert r.status_code == 201, r.text
        return {**r.json(), "apiKey": team["apiKey"]}

    started = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        for sandbox in pool.map(create, range(COUNT)):
            made.append(sandbox)
    created_s = time.monotonic() - started
    print(f"\n[capacity] {COUNT} sandboxes created in {created_s:.1f}s")

    with httpx.Client(base_url=sandbar.url, timeout=30) as api:
        metrics = api.get("/metrics", headers=METRICS_HEADERS).text
    promised = next(l for l in metrics.splitlines() if l.startswith("sandbar_memory_promised_bytes "))
    available = next(l for l in metrics.splitlines() if l.startswith("sandbar_memory_available_bytes "))
    print(f"[capacity] {promised}; {available}")

    def check(sandbox: dict) -> None:
        assert _answers(sandbar, sandbox) == sandbox["sandboxID"]

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(check, made))

    sandbar.restart(kill9=True)
    listed = set()
    token = None
    with httpx.Client(base_url=sandbar.url, headers=headers, timeout=60) as api:
        while True:
            params = {"limit": 100, "state": "running"}
            if token:
                params["nextToken"] = token
            r = api.get("/v2/sandboxes", params=params)
            assert r.status_code == 200, r.text
            listed.update(s["sandboxID"] for s in r.json())
            token = r.headers.get("x-next-token")
            if not token:
                break
    assert listed == {s["sandboxID"] for s in made}, f"{len(listed)} of {COUNT} running after the restart"
    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(check, made[:: max(1, COUNT // 100)]))
