"""Conflicting calls on one sandbox: an extend just as a batch of sandboxes expires wins over
the reaper, two connects on one paused sandbox both succeed, a kill during a pause, a resume
or a snapshot answers 204 and the sandbox is gone, and a snapshot is deleted by its own
`<template>:default` ID. About 15 s."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from e2b import NotFoundException, Sandbox

from e2e_util import CREATED_IDS

BATCH = 8
ROUNDS = 3
EXPIRY_S = 2


def _status(api, sandbox_id: str) -> int:
    return api.get(f"/sandboxes/{sandbox_id}").status_code


def _create(api, timeout: int = 60) -> str:
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": timeout})
    assert r.status_code == 201, r.text
    sandbox_id = r.json()["sandboxID"]
    CREATED_IDS.add(sandbox_id)
    return sandbox_id


def _together(*calls):
    """Runs `calls` at the same moment, each in its own thread; their results in order."""
    start = threading.Barrier(len(calls))

    def run(call):
        start.wait()
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(run, c) for c in calls]]


def test_an_extend_as_a_batch_expires_keeps_its_sandbox(sandbar):
    """Each round gives 8 sandboxes the same 2 s end and, just around it, connects to one and
    sets a new timeout on two others while the reaper works through the batch: every extend
    that was answered with success leaves its sandbox running; one that lost answers 404."""
    kept_total = lost_total = 0
    with sandbar.client() as api:
        for _ in range(ROUNDS):
            with ThreadPoolExecutor(4) as pool:
                ids = list(pool.map(lambda _: _create(api), range(BATCH)))
            # One end for the whole batch, set within a few milliseconds.
            for sandbox_id in ids:
                r = api.post(f"/sandboxes/{sandbox_id}/timeout", json={"timeout": EXPIRY_S})
                assert r.status_code == 204, r.text
            expires = time.monotonic() + EXPIRY_S
            extended = {}

            def connect(sandbox_id, at):
                time.sleep(max(0.0, at - time.monotonic()))
                try:
                    Sandbox.connect(sandbox_id, timeout=60)
                    extended[sandbox_id] = True
                except NotFoundException:
                    extended[sandbox_id] = False

            def set_timeout(sandbox_id, at):
                time.sleep(max(0.0, at - time.monotonic()))
                try:
                    Sandbox.set_timeout(sandbox_id, 60)
                    extended[sandbox_id] = True
                except NotFoundException:
                    extended[sandbox_id] = False

            # Spread over the reaper's half-second round, from just before the end on.
            targets = ids[-3:]
            with ThreadPoolExecutor(3) as pool:
                futures = [
                    pool.submit(connect, targets[0], expires - 0.05),
                    pool.submit(set_timeout, targets[1], expires + 0.15),
                    pool.submit(set_timeout, targets[2], expires + 0.4),
                ]
                for f in futures:
                    f.result()
            # Two more reaper rounds: anything it still meant to stop is stopped by then.
            time.sleep(1.5)
            for sandbox_id in ids:
                status = _status(api, sandbox_id)
                if extended.get(sandbox_id):
                    assert status == 200, f"{sandbox_id} was extended, then stopped anyway"
                    sbx = Sandbox.connect(sandbox_id, timeout=30)
                    assert sbx.commands.run("echo alive").stdout == "alive\n"
                else:
                    assert status == 404, f"{sandbox_id} outlived its timeout: {status}"
            kept_total += sum(1 for v in extended.values() if v)
            lost_total += sum(1 for v in extended.values() if not v)
            for sandbox_id in ids:
                api.delete(f"/sandboxes/{sandbox_id}")
    print(f"extends kept their sandbox {kept_total} times, lost to the reaper {lost_total} times")
    assert kept_total > 0


@pytest.mark.parametrize("memory", [True, False], ids=["memory", "files"])
def test_two_connects_on_a_paused_sandbox_both_succeed(sandbar, memory):
    with sandbar.client() as api:
        sandbox_id = _create(api)
        try:
            r = api.post(f"/sandboxes/{sandbox_id}/pause", json={"memory": memory})
            assert r.status_code == 204, r.text
            connect = lambda: api.post(f"/v2/sandboxes/{sandbox_id}/connect", json={"timeout": 60})
            first, second = _together(connect, connect)
            statuses = sorted([first.status_code, second.status_code])
            # One resumed it (201); the other waited for that and found it running (200).
            assert statuses == [200, 201], (first.text, second.text)
            sbx = Sandbox.connect(sandbox_id, timeout=60)
            assert sbx.commands.run("echo alive").stdout == "alive\n"
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")


def _snapshots_of(api, sandbox_id: str):
    r = api.get("/snapshots", params={"sandboxID": sandbox_id})
    assert r.status_code == 200, r.text
    return [s["snapshotID"] for s in r.json()]


@pytest.mark.parametrize("transition", ["pause", "resume", "snapshot"])
def test_a_kill_during_a_transition_answers_204(sandbar, transition):
    with sandbar.client() as api:
        for delay in (0.0, 0.01, 0.05):
            sandbox_id = _create(api)
            if transition == "resume":
                assert api.post(f"/sandboxes/{sandbox_id}/pause", json={"memory": False}).status_code == 204
            start = {
                "pause": lambda: api.post(f"/sandboxes/{sandbox_id}/pause"),
                "resume": lambda: api.post(f"/v2/sandboxes/{sandbox_id}/connect", json={"timeout": 60}),
                "snapshot": lambda: api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"memory": False}),
            }[transition]

            def kill():
                time.sleep(delay)
                return api.delete(f"/sandboxes/{sandbox_id}")

            _, killed = _together(start, kill)
            assert killed.status_code == 204, f"kill {delay}s into a {transition}: {killed.status_code} {killed.text}"
            assert _status(api, sandbox_id) == 404
            for snapshot_id in _snapshots_of(api, sandbox_id):
                assert Sandbox.delete_snapshot(snapshot_id) is True


def test_a_snapshot_is_deleted_by_its_own_id(sandbar):
    with sandbar.client() as api:
        sandbox_id = _create(api)
        try:
            r = api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"memory": False})
            assert r.status_code == 201, r.text
            snapshot_id = r.json()["snapshotID"]
            template_id, tag = snapshot_id.split(":")
            assert tag == "default"
            assert _snapshots_of(api, sandbox_id) == [snapshot_id]
            assert Sandbox.delete_snapshot(snapshot_id) is True
            assert _snapshots_of(api, sandbox_id) == []
            assert api.get(f"/templates/{template_id}").status_code == 404
            assert Sandbox.delete_snapshot(snapshot_id) is False
        finally:
            api.delete(f"/sandboxes/{sandbox_id}")
