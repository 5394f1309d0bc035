"""Template builds as two tenants see them when one of them hogs the build queue.

- Team A starts three builds whose one `RUN` step sleeps for a day; team B's one-step
  `RUN echo hi` build is still ready within 60 s (one build per team runs at once, and the
  host has at least two build slots).
- Team A cancels its builds with `DELETE /templates/{id}/builds/{buildID}`, running and
  waiting alike: each ends with status `error` and a log line saying it was cancelled, and
  the running one's sleeping process and build sandbox (its cgroup) are gone; team B's
  `DELETE` of A's build is a 404.
- A step longer than the step limit fails its build naming the step and the limit, and
  leaves no process or build sandbox: the shared server is restarted with
  `--build-step-timeout-secs 5` for that test and with its usual options after it.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import httpx
import pytest

from e2e_util import build_log_messages, sandbar_cli, sandbox_cgroup_dirs, unique, wait_until

CANCELLED = "the build was cancelled by request"
STEP_LIMIT_S = 5


def _team(sandbar, name: str) -> dict:
    return json.loads(sandbar_cli(sandbar, "team", "create", unique(name), "--requests-per-minute", "0"))


class Tenant:
    """One team's view of the raw build API; deletes the templates it made when closed."""

    def __init__(self, sandbar, team: dict):
        self.team = team
        self.api = httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=60)
        self.templates: List[str] = []

    def start(self, command: str) -> Tuple[str, str]:
        r = self.api.post("/v3/templates", json={"name": unique("queue")})
        assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
        template_id, build_id = r.json()["templateID"], r.json()["buildID"]
        self.templates.append(template_id)
        r = self.api.post(
            f"/v2/templates/{template_id}/builds/{build_id}",
            json={"fromTemplate": "base", "steps": [{"type": "RUN", "args": [command], "force": True}]},
        )
        assert r.status_code == 202, f"POST build: {r.status_code} {r.text}"
        return template_id, build_id

    def status(self, template_id: str, build_id: str) -> dict:
        r = self.api.get(f"/templates/{template_id}/builds/{build_id}/status", params={"limit": 100})
        assert r.status_code == 200, f"{r.status_code} {r.text}"
        return r.json()

    def ended(self, template_id: str, build_id: str) -> Optional[dict]:
        s = self.status(template_id, build_id)
        return s if s["status"] in ("ready", "error") else None

    def close(self) -> None:
        for template_id in self.templates:
            self.api.delete(f"/templates/{template_id}")
        self.api.close()


@pytest.fixture
def tenants(sandbar):
    made = [Tenant(sandbar, _team(sandbar, "queue-a")), Tenant(sandbar, _team(sandbar, "queue-b"))]
    yield made
    for t in made:
        t.close()


def _sleeper() -> str:
    """A command no other process on the host runs, so its processes are found by it."""
    return f"sleep {100000 + random.randrange(1, 99999)}"


def _processes_running(command: str) -> Dict[int, str]:
    """Host processes whose command line is `command`, with the sandbox whose cgroup holds
    them (Sandbar names each sandbox's cgroup `sandbar/<sandbox ID>`)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            if cmdline != command:
                continue
            lines = (entry / "cgroup").read_text().splitlines()
        except OSError:
            continue
        sandbox = ""
        for line in lines:
            parts = line.split(":", 2)[-1].split("/")
            if "sandbar" in parts and parts.index("sandbar") + 1 < len(parts):
                sandbox = parts[parts.index("sandbar") + 1]
                break
        found[int(entry.name)] = sandbox
    return found


def test_one_team_s_sleeping_builds_neither_delay_another_team_nor_outlive_a_cancel(sandbar, base_template, tenants):
    a, b = tenants
    sleeper = _sleeper()
    a_builds = [a.start(sleeper) for _ in range(3)]
    # A's first build runs its step before B asks: B then meets a queue A already holds.
    wait_until(lambda: _processes_running(sleeper), timeout=30, interval=0.1, message="A's first step to run")

    started = time.monotonic()
    b_template, b_build = b.start("echo hi")
    status = wait_until(lambda: b.ended(b_template, b_build), timeout=60, interval=0.25, message="B's build to end")
    ready_in = time.monotonic() - started
    print(f"\n[e2e] B's one-step build ended ({status['status']}) {ready_in:.1f} s after it was started")
    assert status["status"] == "ready", status
    assert "hi" in build_log_messages(b.status(b_template, b_build)), build_log_messages(status)

    # Only one of A's builds runs; the others wait for it.
    running = _processes_running(sleeper)
    assert len(running) == 1, f"{len(running)} of A's steps run at once: {running}"
    (build_sandbox,) = running.values()
    assert build_sandbox and sandbox_cgroup_dirs(build_sandbox), f"no cgroup of a sandbox holds the step: {running}"
    for template_id, build_id in a_builds:
        assert a.status(template_id, build_id)["status"] == "building"

    # Another team cannot cancel A's build, or even learn that it exists.
    template_id, build_id = a_builds[0]
    r = b.api.delete(f"/templates/{template_id}/builds/{build_id}")
    assert r.status_code == 404, f"{r.status_code} {r.text}"
    assert r.json()["code"] == 404

    started = time.monotonic()
    for template_id, build_id in a_builds:
        r = a.api.delete(f"/templates/{template_id}/builds/{build_id}")
        assert r.status_code == 204, f"DELETE build: {r.status_code} {r.text}"
    cancelled_in = time.monotonic() - started
    for template_id, build_id in a_builds:
        s = a.status(template_id, build_id)
        assert s["status"] == "error", s
        assert s["reason"]["message"] == CANCELLED, s
        assert CANCELLED in build_log_messages(s), build_log_messages(s)
    r = a.api.delete(f"/templates/{a_builds[0][0]}/builds/{a_builds[0][1]}")
    assert r.status_code == 409, f"a second cancel: {r.status_code} {r.text}"

    wait_until(lambda: not _processes_running(sleeper), timeout=15, interval=0.1, message="A's step to end")
    wait_until(
        lambda: not sandbox_cgroup_dirs(build_sandbox),
        timeout=15,
        interval=0.1,
        message=f"the build sandbox {build_sandbox}'s cgroups to go",
    )
    gone_in = time.monotonic() - started
    print(f"[e2e] three builds cancelled in {cancelled_in:.2f} s; the build sandbox gone {gone_in:.2f} s after the first cancel")


@pytest.fixture
def short_step_limit(sandbar):
    usual = list(sandbar.extra_args)
    sandbar.extra_args = usual + ["--build-step-timeout-secs", str(STEP_LIMIT_S)]
    try:
        sandbar.restart()
        yield
    finally:
        sandbar.extra_args = usual
        sandbar.restart()


def test_a_step_past_the_step_limit_fails_its_build_and_leaves_nothing(sandbar, short_step_limit, tenants):
    a, _ = tenants
    sleeper = _sleeper()
    started = time.monotonic()
    template_id, build_id = a.start(sleeper)
    wait_until(lambda: _processes_running(sleeper), timeout=30, interval=0.1, message="the step to run")
    (build_sandbox,) = _processes_running(sleeper).values()
    assert build_sandbox and sandbox_cgroup_dirs(build_sandbox), "no cgroup of a sandbox holds the step"
    status = wait_until(lambda: a.ended(template_id, build_id), timeout=STEP_LIMIT_S + 30, interval=0.25, message="the build to end")
    took = time.monotonic() - started
    print(f"\n[e2e] a build whose step sleeps ended ({status['status']}) after {took:.1f} s with a {STEP_LIMIT_S} s step limit")
    expected = f"step 1 (RUN {sleeper}) exceeded the {STEP_LIMIT_S} s step limit"
    assert status["status"] == "error", status
    assert status["reason"]["message"] == expected, status
    assert expected in build_log_messages(a.status(template_id, build_id))
    assert took >= STEP_LIMIT_S
    assert not _processes_running(sleeper), "the step's process outlived its build"
    wait_until(
        lambda: not sandbox_cgroup_dirs(build_sandbox),
        timeout=15,
        interval=0.1,
        message=f"the build sandbox {build_sandbox}'s cgroups to go",
    )
