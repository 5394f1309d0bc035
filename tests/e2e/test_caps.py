"""Caps on what a team keeps, reached as a tenant, and the rotation of agent logs on the host.

A fresh team gets small caps through `sandbar team set-limits`; each is then reached through
the API with the team's own key or access token: snapshots, templates, tags per template,
volumes and API keys past their count answer 429, volume bytes past theirs 507 (and snapshot
memory images too, where the server can snapshot memory), each with the API's error body
naming the team, the limit and its value. A sandbox whose agent writes far more than the
rotation size keeps at most the current log and one previous copy on the host, and its logs
stay readable through the API. About 60 s.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Dict

import httpx
import pytest
from e2b import Sandbox

from e2e_util import AGENT_LOG_ROTATE_MB, sandbar_cli, unique

ENVD_PORT = 49983
MIB = 1 << 20
# The node rotates an agent log past this (crates/node/src/runtime/agent_log.rs).
ROTATE_AT = AGENT_LOG_ROTATE_MB * MIB


@pytest.fixture(scope="module")
def team(sandbar) -> Dict[str, str]:
    made = json.loads(sandbar_cli(sandbar, "team", "create", unique("caps")))
    sandbar_cli(
        sandbar, "team", "set-limits", made["teamID"],
        "--max-snapshots", "1", "--max-templates", "1", "--max-tags-per-template", "1",
        "--max-volumes", "1", "--max-volume-mb", "1", "--max-api-keys", "2",
    )
    return made


@pytest.fixture
def team_sandbox(sandbar, team):
    sbx = Sandbox.create(api_key=team["apiKey"], timeout=300)
    yield sbx
    httpx.delete(f"{sandbar.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": team["apiKey"]}, timeout=30)


def _api(sandbar, team, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, sandbar.url + path, headers={"X-API-Key": team["apiKey"]}, timeout=60, **kwargs)


def _assert_refused(reply: httpx.Response, team, status: int, limit: str) -> None:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body["code"] == status, body
    expected = f"team {team['teamID']} has reached its limit of {limit}"
    assert body["message"].startswith(expected), body


def test_the_operator_sees_each_cap(sandbar, team):
    shown = json.loads(sandbar_cli(sandbar, "team", "show", team["teamID"]))
    assert (
        shown["maxSnapshots"], shown["maxTemplates"], shown["maxTagsPerTemplate"],
        shown["maxVolumes"], shown["maxVolumeMB"], shown["maxApiKeys"],
    ) == (1, 1, 1, 1, 1, 2), shown
    # Untouched caps keep their defaults.
    assert shown["maxSnapshotMB"] == 20480, shown
    listed = sandbar_cli(sandbar, "team", "list")
    line = next(line for line in listed.splitlines() if line.startswith(team["teamID"]))
    assert "max-snapshots=1" in line and "max-api-keys=2" in line, line


def test_snapshots_past_the_count_answer_429(sandbar, team, team_sandbox):
    path = f"/sandboxes/{team_sandbox.sandbox_id}/snapshots"
    first = _api(sandbar, team, "POST", path, json={"memory": False})
    assert first.status_code == 201, first.text
    try:
        _assert_refused(_api(sandbar, team, "POST", path, json={"memory": False}), team, 429, "1 snapshots")
        # The sandbox runs on, untouched by the refusal.
        assert team_sandbox.commands.run("echo still").stdout.strip() == "still"
    finally:
        snapshot_id = first.json()["snapshotID"]
        gone = _api(sandbar, team, "DELETE", f"/templates/{snapshot_id.replace(':', '%3A')}")
        assert gone.status_code == 204, gone.text


def test_snapshot_memory_past_the_bytes_answers_507(sandbar, team, team_sandbox):
    sandbar_cli(sandbar, "team", "set-limits", team["teamID"], "--max-snapshot-mb", "4")
    # An idle sandbox's memory image is under 1 MiB: a process holding 8 MiB makes it larger.
    team_sandbox.commands.run(
        "python3 -c 'import os, time; x = os.urandom(8 << 20); time.sleep(600)'", background=True
    )
    time.sleep(1)
    try:
        reply = _api(sandbar, team, "POST", f"/sandboxes/{team_sandbox.sandbox_id}/snapshots", json={})
        if reply.status_code == 501:
            pytest.skip(f"this server cannot snapshot memory: {reply.text}")
        # Taken, measured, and not kept.
        _assert_refused(reply, team, 507, "4 MiB of snapshot memory images")
        assert "this would add" in reply.json()["message"]
        listed = _api(sandbar, team, "GET", "/snapshots")
        assert listed.json() == [], listed.text
    finally:
        sandbar_cli(sandbar, "team", "set-limits", team["teamID"], "--max-snapshot-mb", "20480")
        for snapshot in _api(sandbar, team, "GET", "/snapshots").json():
            _api(sandbar, team, "DELETE", f"/templates/{snapshot['snapshotID'].replace(':', '%3A')}")


def test_templates_and_tags_past_their_counts_answer_429(sandbar, team):
    name = unique("capped")
    first = _api(sandbar, team, "POST", "/v3/templates", json={"name": name})
    assert first.status_code == 202, first.text
    template_id = first.json()["templateID"]
    try:
        _assert_refused(
            _api(sandbar, team, "POST", "/v3/templates", json={"name": unique("second")}),
            team, 429, "1 templates",
        )
        _assert_refused(
            _api(sandbar, team, "POST", "/v3/templates", json={"name": name, "tags": ["a", "b"]}),
            team, 429, "1 tags per template",
        )
    finally:
        gone = _api(sandbar, team, "DELETE", f"/templates/{template_id}")
        assert gone.status_code == 204, gone.text


def test_volumes_past_their_count_and_bytes_answer_429_and_507(sandbar, team):
    made = _api(sandbar, team, "POST", "/volumes", json={"name": unique("vol")})
    assert made.status_code == 201, made.text
    volume = made.json()
    try:
        _assert_refused(_api(sandbar, team, "POST", "/volumes", json={"name": unique("vol")}), team, 429, "1 volumes")
        content = f"{sandbar.url}/volumecontent/{volume['volumeID']}/file"
        bearer = {"Authorization": f"Bearer {volume['token']}"}
        small = httpx.put(content, params={"path": "/small"}, headers=bearer, content=b"x" * 4096, timeout=60)
        assert small.status_code == 201, small.text
        big = httpx.put(content, params={"path": "/big"}, headers=bearer, content=b"x" * (2 * MIB), timeout=60)
        _assert_refused(big, team, 507, "1 MiB of volumes")
        missing = httpx.get(content, params={"path": "/big"}, headers=bearer, timeout=60)
        assert missing.status_code == 404, missing.text
    finally:
        gone = _api(sandbar, team, "DELETE", f"/volumes/{volume['volumeID']}")
        assert gone.status_code == 204, gone.text


def test_api_keys_past_the_count_answer_429(sandbar, team):
    bearer = {"Authorization": f"Bearer {team['accessToken']}"}
    made = httpx.post(f"{sandbar.url}/api-keys", headers=bearer, json={"name": "second"}, timeout=30)
    assert made.status_code == 201, made.text
    try:
        refused = httpx.post(f"{sandbar.url}/api-keys", headers=bearer, json={"name": "third"}, timeout=30)
        _assert_refused(refused, team, 429, "2 API keys")
        # The refused key does not exist.
        listed = httpx.get(f"{sandbar.url}/api-keys", headers=bearer, timeout=30).json()
        assert sorted(k["name"] for k in listed) == ["default", "second"], listed
    finally:
        gone = httpx.delete(f"{sandbar.url}/api-keys/{made.json()['id']}", headers=bearer, timeout=30)
        assert gone.status_code == 204, gone.text


def _start(sandbar, sbx: Sandbox, cmd: str) -> None:
    """One `process.Process/Start` by hand: the agent logs the command's path as it starts it."""
    body = json.dumps({"process": {"cmd": cmd, "args": []}}).encode()
    reply = httpx.post(
        sandbar.url + "/process.Process/Start",
        content=b"\x00" + struct.pack(">I", len(body)) + body,
        headers={
            "E2b-Sandbox-Id": sbx.sandbox_id,
            "E2b-Sandbox-Port": str(ENVD_PORT),
            "X-Access-Token": sbx._envd_access_token,
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
        },
        timeout=60,
    )
    assert reply.status_code == 200 and b'"end"' in reply.content, reply.content[-300:]


def _on_disk(*paths: Path) -> int:
    return sum(p.stat().st_size for p in paths if p.exists())


def test_agent_logs_rotate_on_the_host(sandbar, team):
    # The flood takes minutes on a loaded host: more than the other tests' sandboxes live.
    sbx = Sandbox.create(api_key=team["apiKey"], timeout=1800)
    try:
        _flood_and_check(sandbar, team, sbx)
    finally:
        httpx.delete(f"{sandbar.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-Key": team["apiKey"]}, timeout=30)


def _flood_and_check(sandbar, team, sbx: Sandbox) -> None:
    # A program at a path of nearly PATH_MAX bytes: each start writes a log line that long.
    parts = [f"{n:02d}" + "d" * 248 for n in range(15)]
    program = "/tmp/" + "/".join(parts) + "/t"
    sbx.commands.run(f"mkdir -p {program.rsplit('/', 1)[0]} && ln -s /bin/true {program}")
    logs_dir = sandbar.data_dir / "logs"
    current = logs_dir / f"{sbx.sandbox_id}.log"
    previous = logs_dir / f"{sbx.sandbox_id}.log.1"
    assert current.exists()

    # Four times the rotation size in paths alone (each log line carries more than its path),
    # so what the two files keep is well under what was written even when the previous file
    # grew for a whole read interval past the rotation size.
    starts = (4 * ROTATE_AT) // len(program)
    peak = 0
    began = time.monotonic()
    with ThreadPoolExecutor(max_workers=4) as pool:
        for n, _ in enumerate(pool.map(lambda _: _start(sandbar, sbx, program), range(starts))):
            if n % 100 == 0:
                peak = max(peak, _on_disk(current, previous))
    elapsed = time.monotonic() - began
    written = starts * len(program)
    # The node rotates where it reads the log, every 2 s: once it read again, the current
    # file is under the rotation size.
    deadline = time.monotonic() + 15
    while current.stat().st_size > ROTATE_AT and time.monotonic() < deadline:
        time.sleep(0.5)
    assert previous.exists(), "the log was never rotated"
    sizes = (current.stat().st_size, previous.stat().st_size)
    peak = max(peak, sum(sizes))
    rate = written / elapsed
    print(
        f"agent log: ~{written} B written in {elapsed:.1f} s ({starts} starts, {rate / MIB:.1f} MiB/s); "
        f"on disk: current {sizes[0]} B, previous {sizes[1]} B; peak {peak} B"
    )
    assert sizes[0] <= ROTATE_AT, sizes
    assert sum(sizes) < written - ROTATE_AT, (sizes, written)
    # Twice the rotation size, and what the agent writes between two reads (2 s apart,
    # 3 s allowed) in each of the two files.
    assert peak <= 2 * (ROTATE_AT + 3 * rate), (peak, rate)

    # The API still reads the sandbox's log, its newest lines included.
    sbx.commands.run("echo done")
    reply = _api(sandbar, team, "GET", f"/v2/sandboxes/{sbx.sandbox_id}/logs", params={"limit": 5, "search": "process started"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["logs"], reply.text
