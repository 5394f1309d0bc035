"""Pause and resume: a paused sandbox is frozen with its memory, processes and files, is not
routed to, lists as paused, and comes back as it was through `connect` or `resume`."""

from __future__ import annotations

import time

import pytest
from e2b import Sandbox

from e2e_util import COUNTER, read_count, state_of, wait_until

# The count is written beside and renamed over, so a freeze between the shell's truncate and
# its write can never leave a reader an empty file.


def test_pause_keeps_processes_files_and_env(sandbar, make_sandbox):
    sbx = make_sandbox(envs={"KEPT": "yes"})
    sbx.files.write("/home/user/note.txt", "before pause")
    sbx.commands.run(COUNTER, background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    before = read_count(sbx)

    assert sbx.pause() is True
    assert state_of(sandbar, sbx.sandbox_id) == "paused"
    with sandbar.client() as api:
        listed = api.get("/v2/sandboxes", params={"state": "paused"}).json()
        assert sbx.sandbox_id in [s["sandboxID"] for s in listed], listed
        running = api.get("/v2/sandboxes", params={"state": "running"}).json()
        assert sbx.sandbox_id not in [s["sandboxID"] for s in running], running
    # A second pause is a conflict, which the SDK reports as False.
    assert sbx.pause() is False
    time.sleep(1.0)

    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert state_of(sandbar, sbx.sandbox_id) == "running"
    after = read_count(resumed)
    # Frozen for a second: the counter neither went back nor ran on (20 ticks a second).
    assert before <= after < before + 15, (before, after)
    assert resumed.files.read("/home/user/note.txt") == "before pause"
    assert resumed.commands.run("echo $KEPT").stdout == "yes\n"
    wait_until(lambda: read_count(resumed) > after + 5, timeout=10)


def test_paused_sandbox_is_not_routed_and_can_be_killed(sandbar, make_sandbox):
    sbx = make_sandbox()
    sbx.pause()
    with sandbar.client() as api:
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/pause")
        assert r.status_code == 409, r.text
        # The edge does not reach a frozen agent.
        r = api.get("/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 502, r.text
        r = api.delete(f"/sandboxes/{sbx.sandbox_id}")
        assert r.status_code == 204, r.text
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404


def test_resume_endpoint_and_connect_status_codes(sandbar, make_sandbox):
    sbx = make_sandbox()
    with sandbar.client() as api:
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/resume", json={"timeout": 60})
        assert r.status_code == 409, f"resume of a running sandbox: {r.status_code} {r.text}"
        r = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60})
        assert r.status_code == 200, r.text
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/resume", json={"timeout": 60})
        assert r.status_code == 201, r.text
        assert r.json()["sandboxID"] == sbx.sandbox_id
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        r = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60})
        assert r.status_code == 201, r.text
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/pause", json={"memory": False})
        assert r.status_code == 204, r.text
        r = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60})
        assert r.status_code == 201, r.text
    assert sbx.commands.run("echo alive").stdout == "alive\n"


def test_auto_pause_on_timeout(sandbar, make_sandbox):
    sbx = make_sandbox(timeout=3, lifecycle={"on_timeout": "pause"})
    sbx.commands.run(COUNTER, background=True)
    with sandbar.client() as api:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["lifecycle"]["onTimeout"] == "pause"
    wait_until(lambda: state_of(sandbar, sbx.sandbox_id) == "paused", timeout=15)
    time.sleep(1.5)
    # Past its timeout yet still there, paused; connecting brings it back.
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert read_count(resumed) > 0


def test_many_pause_resume_cycles_never_lose_state(sandbar, make_sandbox):
    sbx = make_sandbox()
    data = bytes(range(256)) * 4096
    sbx.files.write("/home/user/data.bin", data)
    sbx.commands.run(COUNTER, background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    last = 0
    with sandbar.client() as api:
        for _ in range(100):
            assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
            r = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 120})
            assert r.status_code == 201, r.text
            count = read_count(sbx)
            assert count >= last, (count, last)
            last = count
    assert sbx.files.read("/home/user/data.bin", format="bytes") == data


def test_auto_resume_on_traffic(sandbar, make_sandbox):
    sbx = make_sandbox(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sbx.files.write("/home/user/woken.txt", "still here")
    with sandbar.client() as api:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["lifecycle"]["autoResume"] is True
    wait_until(lambda: state_of(sandbar, sbx.sandbox_id) == "paused", timeout=15)
    # The SDK's next call through the edge wakes it.
    assert sbx.files.read("/home/user/woken.txt") == "still here"
    assert state_of(sandbar, sbx.sandbox_id) == "running"


def test_without_auto_resume_traffic_does_not_wake(sandbar, make_sandbox):
    sbx = make_sandbox()
    sbx.pause()
    with sandbar.client() as api:
        r = api.get("/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 502, r.text
    assert state_of(sandbar, sbx.sandbox_id) == "paused"
