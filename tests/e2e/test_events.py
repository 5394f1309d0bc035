"""Sandbox lifecycle events at /events/sandboxes, as E2B serves them: every change a client
made through the SDK is recorded in order with its sandbox's metadata, the ended run's
execution on `paused` and `killed`, and stays readable after the sandbox is gone; filters and
paging are the API's; a second team sees none of the first one's; bad parameters get a 400
with a clear message."""

import json
import time

import httpx
from e2b import Sandbox

from e2e_util import sandbar_cli, unique

CREATED = "sandbox.lifecycle.created"
UPDATED = "sandbox.lifecycle.updated"
PAUSED = "sandbox.lifecycle.paused"
RESUMED = "sandbox.lifecycle.resumed"
KILLED = "sandbox.lifecycle.killed"
# Written when a paused sandbox goes to disk after the server's pause grace (3 s in this
# suite): a slow run may see it between a pause and the resume, a quick one not.
CHECKPOINTED = "sandbox.lifecycle.checkpointed"


def _types(events: list[dict]) -> list[str]:
    return [e["type"] for e in events if e["type"] != CHECKPOINTED]


def _events(sandbar, path: str, key: str | None = None, **params) -> httpx.Response:
    return httpx.get(
        f"{sandbar.url}{path}", headers={"X-API-Key": key or sandbar.api_key}, params=params, timeout=30
    )


def _wait_types(sandbar, sandbox_id: str, wanted: list[str]) -> list[dict]:
    """The sandbox's events, oldest first, once their types are `wanted` (events are written
    a few milliseconds after the change)."""
    deadline = time.monotonic() + 15
    while True:
        reply = _events(sandbar, f"/events/sandboxes/{sandbox_id}", orderAsc="true", limit=100)
        assert reply.status_code == 200, reply.text
        events = reply.json()
        if _types(events) == wanted or time.monotonic() > deadline:
            assert _types(events) == wanted
            return [e for e in events if e["type"] != CHECKPOINTED]
        time.sleep(0.1)


def test_a_sandboxs_life_is_recorded_in_order_and_outlives_it(sandbar):
    marker = unique("events")
    sbx = Sandbox.create(timeout=120, metadata={"suite": marker})
    try:
        sbx.set_timeout(180)
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert sbx.commands.run("echo awake").stdout.strip() == "awake"
    finally:
        sbx.kill()
    events = _wait_types(sandbar, sbx.sandbox_id, [CREATED, UPDATED, PAUSED, RESUMED, KILLED])
    for e in events:
        assert e["version"] == "v2"
        assert e["sandboxId"] == sbx.sandbox_id
        assert e["eventData"]["sandbox_metadata"] == {"suite": marker}
        assert e["sandboxTemplateId"] and e["sandboxTeamId"]
        assert e["timestamp"].endswith("Z")
    assert len({e["id"] for e in events}) == len(events)
    stamps = [e["timestamp"] for e in events]
    assert stamps == sorted(stamps)
    # The ended run is told on `paused` and `killed`, and only there.
    for e in events:
        execution = e["eventData"].get("execution")
        if e["type"] in (PAUSED, KILLED):
            assert execution["vcpu_count"] >= 1 and execution["memory_mb"] >= 128, e
            assert execution["execution_time"] >= 0
        else:
            assert execution is None, e

    # Newest first by default; limit, offset and types as the API's.
    newest = _events(sandbar, f"/events/sandboxes/{sbx.sandbox_id}").json()
    assert _types(newest) == [KILLED, RESUMED, PAUSED, UPDATED, CREATED]
    page = _events(sandbar, f"/events/sandboxes/{sbx.sandbox_id}", limit=2, offset=1).json()
    assert len(page) == 2 and page[0]["type"] == RESUMED, page
    reply = httpx.get(
        f"{sandbar.url}/events/sandboxes/{sbx.sandbox_id}",
        headers={"X-API-Key": sandbar.api_key},
        params=[("types", PAUSED), ("types", KILLED), ("orderAsc", "true")],
    )
    assert [e["type"] for e in reply.json()] == [PAUSED, KILLED]
    # The team's feed has it too.
    team = _events(sandbar, "/events/sandboxes", limit=100).json()
    assert {e["id"] for e in events} <= {e["id"] for e in team}


def test_another_team_sees_none_and_bad_parameters_are_refused(sandbar, sandbox):
    # Its own team sees its `created` event (the fixture may have done more since).
    deadline = time.monotonic() + 15
    while CREATED not in [e["type"] for e in _events(sandbar, f"/events/sandboxes/{sandbox.sandbox_id}", limit=100).json()]:
        assert time.monotonic() < deadline, "no created event"
        time.sleep(0.1)
    other = json.loads(sandbar_cli(sandbar, "team", "create", unique("eventsteam")))
    reply = _events(sandbar, f"/events/sandboxes/{sandbox.sandbox_id}", key=other["apiKey"])
    assert reply.status_code == 200 and reply.json() == []
    reply = _events(sandbar, "/events/sandboxes", key=other["apiKey"], limit=100)
    assert all(e["sandboxTeamId"] == other["teamID"] for e in reply.json()), reply.json()
    assert sandbox.sandbox_id not in reply.text

    for params, words in (
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"offset": -1}, "offset"),
        ({"orderAsc": "maybe"}, "orderAsc"),
        ({"types": "sandbox.lifecycle.exploded"}, "unknown event type"),
    ):
        reply = _events(sandbar, "/events/sandboxes", **params)
        assert reply.status_code == 400, (params, reply.text)
        body = reply.json()
        assert body["code"] == 400 and words in body["message"], (params, body)
    assert _events(sandbar, "/events/sandboxes", key="e2b_" + "0" * 40).status_code == 401
