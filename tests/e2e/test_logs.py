"""Sandbox logs (lifecycle events and the agent's own lines, readable after the sandbox ends),
team metrics, the list filters and pagination as the SDKs send them, and refreshes."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from e2e_util import unique
from test_js_templates import cli  # noqa: F401 - the npm CLI fixture


def _messages(entries) -> list:
    return [e["message"] for e in entries]


def _wait_for_agent_line(api, sandbox_id: str, timeout: float = 15) -> list:
    """The v2 log once the agent's lines have been read (the server reads them every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        r = api.get(f"/v2/sandboxes/{sandbox_id}/logs")
        assert r.status_code == 200, r.text
        logs = r.json()["logs"]
        if any(e["fields"].get("logger") == "agent" for e in logs):
            return logs
        assert time.monotonic() < deadline, f"no agent line in {logs}"
        time.sleep(0.5)


def test_logs_of_a_live_and_a_killed_sandbox(sandbar, make_sandbox):
    sbx = make_sandbox(timeout=120)
    assert sbx.commands.run("echo hi").stdout.strip() == "hi"
    sbx.set_timeout(150)
    with sandbar.client() as api:
        logs = _wait_for_agent_line(api, sbx.sandbox_id)
        messages = _messages(logs)
        assert messages[0] == "sandbox created", messages
        assert "sandbox started" in messages and "agent started" in messages, messages
        assert "sandbox timeout set" in messages
        agent = [e for e in logs if e["fields"].get("logger") == "agent"]
        started = [e for e in agent if e["message"] == "process started"]
        assert started and started[0]["fields"]["cmd"] == "/bin/bash", agent
        for entry in logs:
            assert set(entry) == {"timestamp", "level", "message", "fields"}
            assert entry["level"] in ("debug", "info", "warn", "error")
            datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00"))

        # v1: the same lines, each also as JSON text with a level and a logger.
        v1 = api.get(f"/sandboxes/{sbx.sandbox_id}/logs").json()
        assert len(v1["logs"]) == len(v1["logEntries"]) >= len(logs)
        first = json.loads(v1["logs"][0]["line"])
        assert first["msg"] == "sandbox created" and first["level"] == "info"
        assert first["logger"] == "lifecycle"

        # Newest first, filtered by level and by text.
        back = api.get(
            f"/v2/sandboxes/{sbx.sandbox_id}/logs", params={"direction": "backward", "limit": 2}
        ).json()["logs"]
        assert len(back) == 2 and back[0]["timestamp"] >= back[1]["timestamp"]
        found = api.get(
            f"/v2/sandboxes/{sbx.sandbox_id}/logs", params={"search": "timeout set"}
        ).json()["logs"]
        assert _messages(found) == ["sandbox timeout set"]
        assert api.get(
            f"/v2/sandboxes/{sbx.sandbox_id}/logs", params={"level": "error"}
        ).json()["logs"] == []

        sbx.kill()
        after = api.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs")
        assert after.status_code == 200, after.text
        assert _messages(after.json()["logs"])[-1] == "sandbox killed"
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404

        missing = api.get("/v2/sandboxes/inosuchsandbox00000000/logs")
        assert missing.status_code == 404
        assert missing.json()["code"] == 404
        bad = api.get(f"/v2/sandboxes/{sbx.sandbox_id}/logs", params={"direction": "up"})
        assert bad.status_code == 400 and "direction" in bad.json()["message"]


def test_cli_sandbox_logs(sandbar, make_sandbox, cli):  # noqa: F811
    sbx = make_sandbox(timeout=120)
    sbx.commands.run("true")
    with sandbar.client() as api:
        _wait_for_agent_line(api, sbx.sandbox_id)
    r = cli("sandbox", "logs", sbx.sandbox_id)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert f"Logs for sandbox {sbx.sandbox_id}" in r.stdout
    assert "sandbox created" in r.stdout and "process started" in r.stdout, r.stdout
    r = cli("sandbox", "logs", sbx.sandbox_id, "--format", "json")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert any(line.get("msg") == "sandbox started" for line in lines), r.stdout


def test_cli_sandbox_list_filters(sandbar, make_sandbox, cli):  # noqa: F811
    group = unique("cli-list")
    since = (datetime.now(timezone.utc) - timedelta(seconds=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    running = make_sandbox(metadata={"group": group})
    paused = make_sandbox(metadata={"group": group})
    assert paused.pause() is True

    def listed(*args: str) -> set:
        r = cli("sandbox", "list", "--metadata", f"group={group}", "--format", "json", *args)
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
        return {s["sandboxId"] for s in json.loads(r.stdout)}

    assert listed() == {running.sandbox_id}
    assert listed("--state", "running,paused", "--limit", "1") in (
        {running.sandbox_id},
        {paused.sandbox_id},
    )
    assert listed("--state", "running,paused", "--template", "base", "--started-after", since) == {
        running.sandbox_id,
        paused.sandbox_id,
    }
    assert listed("--state", "paused", "--template", "no-such-template") == set()


def test_list_filters_and_pages_as_the_sdk_sends_them(sandbar, make_sandbox):
    group = unique("list")
    before = datetime.now(timezone.utc) - timedelta(seconds=1)
    first = make_sandbox(metadata={"group": group, "role": "a b&c"})
    second = make_sandbox(metadata={"group": group, "role": "other"})
    third = make_sandbox(metadata={"group": group, "role": "other"})
    assert third.pause() is True

    def ids(**query) -> set:
        paginator = Sandbox.list(query=SandboxQuery(**query), limit=100)
        found = set()
        while paginator.has_next:
            found |= {s.sandbox_id for s in paginator.next_items()}
        return found

    everyone = {first.sandbox_id, second.sandbox_id, third.sandbox_id}
    assert ids(metadata={"group": group}) == everyone
    assert ids(metadata={"group": group, "role": "a b&c"}) == {first.sandbox_id}
    assert ids(metadata={"group": group}, state=[SandboxState.RUNNING]) == {
        first.sandbox_id,
        second.sandbox_id,
    }
    assert ids(metadata={"group": group}, state=[SandboxState.PAUSED]) == {third.sandbox_id}
    assert (
        ids(metadata={"group": group}, state=[SandboxState.RUNNING, SandboxState.PAUSED])
        == everyone
    )
    assert ids(metadata={"group": group}, template="base") == everyone
    assert ids(metadata={"group": group}, template="no-such-template") == set()
    assert ids(metadata={"group": group}, started_after=before) == everyone
    assert (
        ids(metadata={"group": group}, started_after=datetime.now(timezone.utc) + timedelta(hours=1))
        == set()
    )

    # Two to a page: two pages, the token in x-next-token, nothing twice.
    paginator = Sandbox.list(query=SandboxQuery(metadata={"group": group}), limit=2)
    pages = []
    while paginator.has_next:
        pages.append([s.sandbox_id for s in paginator.next_items()])
    assert [len(p) for p in pages] == [2, 1]
    assert {i for p in pages for i in p} == everyone

    with sandbar.client() as api:
        r = api.get("/v2/sandboxes", params={"limit": 1, "metadata": f"group={group}"})
        assert r.status_code == 200 and r.headers.get("x-next-token")
        assert r.headers["x-total-running"] == "2"
        bad = api.get("/v2/sandboxes", params={"startedAfter": "yesterday"})
        assert bad.status_code == 400 and "startedAfter" in bad.json()["message"]


def test_refresh_keeps_a_sandbox_at_least_15_seconds(sandbar, make_sandbox):
    sbx = make_sandbox(timeout=5)
    with sandbar.client() as api:
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/refreshes")
        assert r.status_code == 204, r.text
        end = api.get(f"/sandboxes/{sbx.sandbox_id}").json()["endAt"]
        left = datetime.fromisoformat(end.replace("Z", "+00:00")) - datetime.now(timezone.utc)
        assert timedelta(seconds=12) < left <= timedelta(seconds=16), left
        too_long = api.post(f"/sandboxes/{sbx.sandbox_id}/refreshes", json={"duration": 3601})
        assert too_long.status_code == 400


def test_team_metrics_count_starts_and_running_sandboxes(sandbar, make_sandbox):
    team_id = json.loads((sandbar.data_dir / "credentials.json").read_text())["teamID"]
    start = int(time.time()) - 1
    make_sandbox()
    make_sandbox()
    end = int(time.time()) + 1
    with sandbar.client() as api:
        points = api.get(f"/teams/{team_id}/metrics", params={"start": start, "end": end})
        assert points.status_code == 200, points.text
        body = points.json()
        assert body and set(body[0]) == {
            "timestamp",
            "timestampUnix",
            "concurrentSandboxes",
            "sandboxStartRate",
        }
        assert max(p["concurrentSandboxes"] for p in body) >= 2
        assert sum(p["sandboxStartRate"] for p in body) * 5 >= 2
        top = api.get(
            f"/teams/{team_id}/metrics/max",
            params={"metric": "concurrent_sandboxes", "start": start, "end": end},
        ).json()
        # Points start on 5-second boundaries: the first may begin before `start`.
        assert top["value"] >= 2 and start - 5 < top["timestampUnix"] <= end
        assert api.get(f"/teams/{team_id}/metrics/max").status_code == 400
        assert api.get(f"/teams/{team_id}/metrics", params={"start": 5, "end": 1}).status_code == 400
        other = api.get("/teams/someone-else/metrics")
        assert other.status_code == 403 and other.json()["code"] == 403


@pytest.mark.parametrize("path", ["/sandboxes/x/logs", "/v2/sandboxes/x/logs"])
def test_logs_need_an_api_key(sandbar, path):
    with sandbar.client(api_key=None) as api:
        assert api.get(path).status_code == 401
