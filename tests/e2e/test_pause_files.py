"""Pausing without memory (`memory: false`, the SDK's `pause(mode="filesystem")` and
`autoPauseMemory: false`): the sandbox's processes end and its memory, network slot and
concurrency slot go back to the host; only its files are kept. Resuming boots it again on
them, with the same ID, access token, environment and metadata."""

from __future__ import annotations

import json
import subprocess

import httpx
from e2b import Sandbox

from e2e_util import checkpoints_off, sandbox_cgroup_dirs, state_of, unique, wait_until

COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /home/user/count.new; "
    "mv -f /home/user/count.new /home/user/count; sleep 0.05; done"
)


def detail(sandbar, sandbox_id: str) -> dict:
    with sandbar.client() as api:
        r = api.get(f"/sandboxes/{sandbox_id}")
        assert r.status_code == 200, r.text
        return r.json()


def test_pause_without_memory_keeps_files_but_not_processes(sandbar, make_sandbox):
    sbx = make_sandbox(envs={"KEPT": "yes"}, metadata={"kind": "files"})
    sbx.files.write("/home/user/note.txt", "before pause")
    sbx.commands.run(COUNTER, background=True)
    wait_until(lambda: sbx.commands.run("test -s /home/user/count").exit_code == 0, timeout=10)
    before = detail(sandbar, sbx.sandbox_id)
    assert sandbox_cgroup_dirs(sbx.sandbox_id)

    assert sbx.pause(mode="filesystem") is True
    assert state_of(sandbar, sbx.sandbox_id) == "paused"
    # Its processes and cgroups are gone: no memory is held for it.
    wait_until(lambda: not sandbox_cgroup_dirs(sbx.sandbox_id), timeout=10)
    assert (sandbar.data_dir / "sandboxes" / sbx.sandbox_id / "upper").is_dir()
    with sandbar.client() as api:
        listed = api.get("/v2/sandboxes", params={"state": "paused"}).json()
        assert sbx.sandbox_id in [s["sandboxID"] for s in listed], listed
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause", json={"memory": False}).status_code == 409
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 409
        # Not reachable while paused.
        r = api.get("/health", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 502, r.text

    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert resumed.sandbox_id == sbx.sandbox_id
    after = detail(sandbar, sbx.sandbox_id)
    assert after["state"] == "running"
    assert after["envdAccessToken"] == before["envdAccessToken"]
    assert after["metadata"] == {"kind": "files"}
    assert resumed.files.read("/home/user/note.txt") == "before pause"
    assert resumed.commands.run("echo $KEPT").stdout == "yes\n"
    # Booted again: the counter's loop is gone, its last count is still on disk.
    ps = resumed.commands.run("ps -eo args").stdout
    assert "count.new" not in ps, ps
    last = resumed.files.read("/home/user/count").strip()
    assert int(last) > 0
    # The old handle (the SDK object made before the pause) works again too.
    assert sbx.commands.run("echo back").stdout == "back\n"
    # And it pauses again, both ways.
    assert resumed.pause(mode="filesystem") is True
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert resumed.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert resumed.files.read("/home/user/note.txt") == "before pause"


def test_auto_pause_without_memory(sandbar, make_sandbox):
    sbx = make_sandbox(timeout=3, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    sbx.files.write("/home/user/kept.txt", "kept")
    wait_until(lambda: state_of(sandbar, sbx.sandbox_id) == "paused", timeout=20)
    wait_until(lambda: not sandbox_cgroup_dirs(sbx.sandbox_id), timeout=10)
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert resumed.files.read("/home/user/kept.txt") == "kept"


def test_auto_pause_memory_false_is_validated(sandbar):
    with sandbar.client() as api:
        r = api.post(
            "/sandboxes",
            json={"templateID": "base", "timeout": 30, "autoPause": True, "autoPauseMemory": False,
                  "autoResume": {"enabled": True}},
        )
        assert r.status_code == 400, r.text
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 30, "autoPauseMemory": False})
        assert r.status_code == 400, r.text


def test_paused_without_memory_frees_the_team_slot_and_delete_removes_its_disk(sandbar):
    def cli(*args: str) -> str:
        done = subprocess.run(
            [str(sandbar.binary), *args, "--data-dir", str(sandbar.data_dir)],
            capture_output=True, text=True, timeout=60,
        )
        assert done.returncode == 0, f"sandbar {' '.join(args)}: {done.stderr}"
        return done.stdout

    team = json.loads(cli("team", "create", unique("files")))
    cli("team", "set-limits", team["teamID"], "--max-sandboxes", "1")
    key = team["apiKey"]
    headers = {"X-API-Key": key}
    made = []

    def kill(sandbox_id: str) -> None:
        httpx.delete(f"{sandbar.url}/sandboxes/{sandbox_id}", headers=headers, timeout=30)

    try:
        first = Sandbox.create(api_key=key, timeout=60)
        made.append(first.sandbox_id)
        first.files.write("/home/user/a.txt", "a")
        assert first.pause(mode="filesystem") is True
        # The paused sandbox holds no slot: a second one fits the limit of 1.
        second = Sandbox.create(api_key=key, timeout=60)
        made.append(second.sandbox_id)
        # Resuming needs a slot like a create.
        r = httpx.post(f"{sandbar.url}/v2/sandboxes/{first.sandbox_id}/connect", headers=headers,
                       json={"timeout": 60}, timeout=60)
        assert r.status_code == 429, r.text
        assert state_of_with(sandbar, first.sandbox_id, headers) == "paused"
        kill(second.sandbox_id)
        r = httpx.post(f"{sandbar.url}/v2/sandboxes/{first.sandbox_id}/connect", headers=headers,
                       json={"timeout": 60}, timeout=60)
        assert r.status_code == 201, r.text
        assert first.files.read("/home/user/a.txt") == "a"

        # Deleting a sandbox paused without memory removes its files.
        assert first.pause(mode="filesystem") is True
        disk = sandbar.data_dir / "sandboxes" / first.sandbox_id
        assert disk.is_dir()
        r = httpx.delete(f"{sandbar.url}/sandboxes/{first.sandbox_id}", headers=headers, timeout=30)
        assert r.status_code == 204, r.text
        assert not disk.exists()
        r = httpx.get(f"{sandbar.url}/sandboxes/{first.sandbox_id}", headers=headers, timeout=30)
        assert r.status_code == 404
    finally:
        for sandbox_id in made:
            kill(sandbox_id)


def state_of_with(sandbar, sandbox_id: str, headers: dict) -> str:
    r = httpx.get(f"{sandbar.url}/sandboxes/{sandbox_id}", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["state"]


def test_resume_without_memory_boots_a_memory_paused_sandbox_afresh(sandbar, make_sandbox):
    sbx = make_sandbox(envs={"KEPT": "yes"})
    sbx.files.write("/home/user/note.txt", "kept")
    sbx.commands.run("sleep 600", background=True)
    with sandbar.client() as api:
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        # Running is a no-op either way; paused with memory, `memory: false` drops the memory.
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 120, "memory": False})
        assert r.status_code == 201, r.text
        assert r.json()["envdAccessToken"] == sbx._envd_access_token
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 120, "memory": False})
        assert r.status_code == 200, r.text
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.read("/home/user/note.txt") == "kept"
    assert resumed.commands.run("echo $KEPT").stdout.strip() == "yes"
    assert "sleep 600" not in resumed.commands.run("ps -eo args").stdout
    # The same from a checkpoint on disk (where the server takes them).
    if checkpoints_off(sandbar):
        return
    resumed.commands.run("sleep 700", background=True)
    with sandbar.client() as api:
        assert api.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
        header = sandbar.data_dir / "checkpoints" / sbx.sandbox_id / "header"
        wait_until(header.exists, timeout=30, message="the checkpoint")
        r = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 120, "memory": False})
        assert r.status_code == 201, r.text
    assert not header.exists()
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.files.read("/home/user/note.txt") == "kept"
    assert "sleep 700" not in again.commands.run("ps -eo args").stdout
