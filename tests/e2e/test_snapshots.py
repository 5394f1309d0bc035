"""Snapshots and forks of running sandboxes, driven with the official Python SDK:
`create_snapshot` copies a sandbox's files and processes into a template while it runs on,
`Sandbox.create(snapshot_id)` starts sandboxes with those processes already running (each with
its own host ids, network, token and environment), `fork` does both at once, and
`list_snapshots`/`delete_snapshot` manage them.

Skipped, with the server's reason, when the server found no usable CRIU (the files-only
snapshot test runs anyway)."""

from __future__ import annotations

import time

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxException

from e2e_util import COUNTER, read_count, require_checkpoints, unique, wait_until

SERVER = "python3 -m http.server 8000 --bind 0.0.0.0 --directory /home/user/www"


@pytest.fixture(scope="module")
def criu(sandbar):
    require_checkpoints(sandbar, "snapshot memory")
    return sandbar


def exit_code(sbx, cmd: str) -> int:
    try:
        return sbx.commands.run(cmd).exit_code
    except CommandExitException as e:
        return e.exit_code


def counting(sbx) -> bool:
    first = read_count(sbx)
    time.sleep(0.3)
    return read_count(sbx) > first


def host_id_base(sbx) -> int:
    return int(sbx.commands.run("cat /proc/self/uid_map").stdout.split()[1])


def snapshot_dirs(sandbar) -> set:
    root = sandbar.data_dir / "snapshots"
    return {p.name for p in root.iterdir()} if root.exists() else set()


def busy_source(make_sandbox):
    """A sandbox with a counter in the background, a web server, a file and an env var."""
    sbx = make_sandbox(envs={"FROM_SOURCE": "yes"})
    sbx.files.write("/home/user/www/index.html", "served from the snapshot")
    sbx.files.write("/home/user/note.txt", "before the snapshot")
    sbx.commands.run(COUNTER, background=True)
    sbx.commands.run(SERVER, background=True)
    wait_until(lambda: exit_code(sbx, "test -s /tmp/count") == 0, timeout=10)
    return sbx


def test_a_sandbox_made_from_a_snapshot_runs_the_snapshotted_processes(criu, make_sandbox):
    source = busy_source(make_sandbox)
    before = read_count(source)
    snapshot = source.create_snapshot()
    assert snapshot.snapshot_id.endswith(":default") and snapshot.names
    try:
        # The source runs on, and what it does next is not in the snapshot.
        assert counting(source)
        source.files.write("/home/user/note.txt", "after the snapshot")

        copy = make_sandbox(template=snapshot.snapshot_id, envs={"FROM_COPY": "1"})
        assert copy.sandbox_id != source.sandbox_id
        # The counter goes on from where the snapshot caught it, in the restored process.
        after = read_count(copy)
        assert before <= after, (before, after)
        assert counting(copy)
        assert copy.files.read("/home/user/note.txt") == "before the snapshot"
        assert source.files.read("/home/user/note.txt") == "after the snapshot"
        # The restored web server answers on the copy's own address.
        body = wait_until(lambda: _fetch(criu.url + "/index.html", copy.get_host(8000)), timeout=15,
                          message="the restored web server")
        assert body == "served from the snapshot"
        # Its own host ids, and its own environment: the agent was handed the new sandbox.
        assert host_id_base(copy) != host_id_base(source)
        # New processes get the environment the copy was created with, not the source's.
        assert copy.commands.run("echo $FROM_SOURCE:$FROM_COPY").stdout.strip() == ":1"
        # The copy writes files as its own user, on its own disk.
        copy.files.write("/home/user/mine.txt", "copy")
        assert copy.commands.run("stat -c %U /home/user/mine.txt").stdout.strip() == "user"
        assert exit_code(source, "test -e /home/user/mine.txt") == 1
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0])


def test_a_snapshot_is_taken_while_a_client_holds_a_command_stream(criu, make_sandbox):
    # The stream ends at the snapshot (its agent-side socket cannot be dumped); the command runs
    # on in the source and in the copy.
    source = make_sandbox()
    counter = source.commands.run(COUNTER, background=True, timeout=0)
    wait_until(lambda: exit_code(source, "test -s /tmp/count") == 0, timeout=10)
    snapshot = source.create_snapshot()
    try:
        with pytest.raises(SandboxException):
            counter.wait()
        assert counting(source)
        assert counter.pid in [p.pid for p in source.commands.list()]
        copy = make_sandbox(template=snapshot.snapshot_id)
        assert counting(copy)
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0])


def test_the_copy_answers_only_its_own_token(criu, sandbar, make_sandbox):
    source = busy_source(make_sandbox)
    snapshot = source.create_snapshot()
    try:
        copy = make_sandbox(template=snapshot.snapshot_id)
        url = f"{sandbar.url}/envs"
        for sbx, token, expected in (
            (copy, source._envd_access_token, 401),
            (copy, copy._envd_access_token, 200),
            (source, source._envd_access_token, 200),
        ):
            r = httpx.get(url, headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
                                        "X-Access-Token": token}, timeout=10)
            assert r.status_code == expected, (sbx.sandbox_id, r.status_code, r.text)
        # `/init` hands an agent its sandbox; clients may not call it, token or not.
        r = httpx.post(f"{sandbar.url}/init", json={"accessToken": "mine"},
                       headers={"E2b-Sandbox-Id": copy.sandbox_id, "E2b-Sandbox-Port": "49983",
                                "X-Access-Token": copy._envd_access_token}, timeout=10)
        assert r.status_code == 403, r.text
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0])


def test_snapshots_are_listed_named_and_deleted(criu, sandbar, make_sandbox):
    source = make_sandbox()
    name = unique("snap")
    source.files.write("/home/user/v.txt", "one")
    first = source.create_snapshot(name=name)
    # Named in the team's namespace: `<team slug>/<name>:default`.
    namespace, _, rest = first.snapshot_id.partition("/")
    assert namespace and rest == f"{name}:default", first.snapshot_id
    source.files.write("/home/user/v.txt", "two")
    second = source.create_snapshot(name=name)
    assert second.snapshot_id == first.snapshot_id
    unnamed = source.create_snapshot()
    try:
        listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=source.sandbox_id).next_items()]
        assert first.snapshot_id in listed and unnamed.snapshot_id in listed
        by_name = Sandbox.list_snapshots(name=name).next_items()
        assert [s.snapshot_id for s in by_name] == [first.snapshot_id]
        # A name gets the newest copy.
        assert make_sandbox(template=name).files.read("/home/user/v.txt") == "two"
        # Snapshots are templates for creates and deletes, but listed apart from them.
        with sandbar.client() as c:
            templates = c.get("/templates").json()
        assert all(name not in (t.get("aliases") or []) for t in templates)
    finally:
        before = snapshot_dirs(sandbar)
        assert Sandbox.delete_snapshot(name) is True
        assert Sandbox.delete_snapshot(unnamed.snapshot_id.split(":")[0]) is True
    assert Sandbox.list_snapshots(name=name).next_items() == []
    with sandbar.client() as c:
        r = c.post("/sandboxes", json={"templateID": name})
        assert r.status_code == 404, r.text
    # Their checkpoints are collected with them.
    assert len(snapshot_dirs(sandbar)) <= len(before) - 3


def test_fork_starts_copies_that_run_on_their_own(criu, make_sandbox):
    source = busy_source(make_sandbox)
    results = source.fork(count=3, timeout=60)
    forks = [r for r in results if isinstance(r, Sandbox) or hasattr(r, "sandbox_id")]
    assert len(forks) == 3, results
    try:
        ids = {f.sandbox_id for f in forks}
        assert len(ids) == 3 and source.sandbox_id not in ids
        for i, f in enumerate(forks):
            fork = Sandbox.connect(f.sandbox_id)
            assert counting(fork)
            # A fork starts with the source's settings, its environment included.
            assert fork.commands.run("echo $FROM_SOURCE").stdout.strip() == "yes"
            fork.files.write("/home/user/note.txt", f"fork {i}")
        for i, f in enumerate(forks):
            assert Sandbox.connect(f.sandbox_id).files.read("/home/user/note.txt") == f"fork {i}"
        assert counting(source)
        assert source.files.read("/home/user/note.txt") == "before the snapshot"
        # The fork's copy is no snapshot of the team's.
        assert Sandbox.list_snapshots(sandbox_id=source.sandbox_id).next_items() == []
    finally:
        for f in forks:
            try:
                Sandbox.kill(f.sandbox_id)
            except Exception:  # noqa: BLE001 - best effort
                pass


def test_a_files_only_snapshot_boots_afresh_on_the_files(sandbar, make_sandbox):
    source = make_sandbox()
    source.files.write("/home/user/kept.txt", "kept")
    source.commands.run("sleep 600", background=True)
    with sandbar.client() as c:
        r = c.post(f"/sandboxes/{source.sandbox_id}/snapshots", json={"memory": False})
        assert r.status_code == 201, r.text
        snapshot_id = r.json()["snapshotID"]
    try:
        copy = make_sandbox(template=snapshot_id)
        assert copy.files.read("/home/user/kept.txt") == "kept"
        assert exit_code(copy, "pgrep -x sleep") == 1
    finally:
        Sandbox.delete_snapshot(snapshot_id.split(":")[0])


def test_bad_snapshot_and_fork_requests_get_clear_errors(sandbar, make_sandbox):
    sbx = make_sandbox()
    with sandbar.client() as c:
        r = c.post("/sandboxes/nosuchsandbox/snapshots", json={})
        assert r.status_code == 404 and "nosuchsandbox" in r.json()["message"]
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "Bad Name!"})
        assert r.status_code == 400 and "Bad Name!" in r.json()["message"]
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "base"})
        assert r.status_code == 409 and "base" in r.json()["message"]
        for count in (0, 101):
            r = c.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": count})
            assert r.status_code == 400 and str(count) in r.json()["message"]
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"timeout": -1})
        assert r.status_code == 400
        assert c.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
        assert r.status_code == 409 and "paused" in r.json()["message"]
        r = c.get("/snapshots", params={"limit": 0})
        assert r.status_code == 400


def _fetch(url: str, host: str):
    try:
        r = httpx.get(url, headers={"Host": host}, timeout=3)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None
