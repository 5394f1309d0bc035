"""Sandboxes outlive the server process: restarts (kill -9 and SIGTERM) keep them, the reaper still applies.

conftest.py moves these tests to the end of the run because they restart the server.
"""

import time
from datetime import datetime, timezone

import httpx
import pytest
from e2b import Sandbox, SandboxNotFoundException, SandboxQuery

from e2e_util import COUNTER, ENVD_PORT, read_count, require_checkpoints, sandbox_cgroup_dirs, unique, wait_until


def _now():
    return datetime.now(timezone.utc)


def _listed(tag):
    p = Sandbox.list(query=SandboxQuery(metadata={"restart-tag": tag}))
    ids = set()
    while p.has_next:
        ids.update(s.sandbox_id for s in p.next_items())
    return ids


def _gone(sid):
    try:
        Sandbox.get_info(sid)
        return False
    except SandboxNotFoundException:
        return True


def test_kill9_restart_keeps_sandboxes_and_timeouts_still_apply(make_sandbox, sandbar):
    tag = unique("restart9")
    long = make_sandbox(timeout=60, metadata={"restart-tag": tag})
    short = make_sandbox(timeout=20, metadata={"restart-tag": tag})
    long.files.write("/home/user/persist.txt", "survives kill -9")
    bg = long.commands.run("sleep 1234567", background=True)
    short_end = short.get_info().end_at
    long_end = long.get_info().end_at

    sandbar.restart(kill9=True)

    remaining = (short_end - _now()).total_seconds()
    assert remaining > 3, f"the restart took too long; the 20 s sandbox has {remaining:.1f}s left"

    assert _listed(tag) == {long.sandbox_id, short.sandbox_id}
    assert long.files.read("/home/user/persist.txt") == "survives kill -9"
    assert long.commands.run("echo alive").stdout == "alive\n"
    assert short.commands.run("echo alive too").stdout == "alive too\n"
    # processes started before the restart are still there and still known to the agent
    assert bg.pid in [p.pid for p in long.commands.list()]
    # the timeouts were kept
    assert abs((long.get_info().end_at - long_end).total_seconds()) <= 1
    assert abs((short.get_info().end_at - short_end).total_seconds()) <= 1
    # the proxy knows the sandboxes again
    r = httpx.get(
        sandbar.url + "/health",
        headers={"E2b-Sandbox-Id": long.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)},
        timeout=10,
    )
    assert r.status_code == 204

    # the reaper kills the short one once its end time has passed
    wait_s = max(0.0, (short_end - _now()).total_seconds()) + 3
    time.sleep(wait_s)
    wait_until(lambda: _gone(short.sandbox_id), timeout=15, message="the 20 s sandbox to be reaped")
    assert short.is_running() is False
    assert _listed(tag) == {long.sandbox_id}
    wait_until(
        lambda: not sandbox_cgroup_dirs(short.sandbox_id),
        timeout=15,
        message="the reaped sandbox's cgroups to go away",
    )
    # the long one is untouched
    assert long.is_running() is True
    assert long.commands.run("cat /home/user/persist.txt").stdout == "survives kill -9"
    assert long.kill() is True
    assert short.kill() is False


def test_restart_keeps_sandboxes_paused_without_memory(make_sandbox, sandbar):
    tag = unique("restartfiles")
    sbx = make_sandbox(timeout=120, metadata={"restart-tag": tag})
    sbx.files.write("/home/user/shelved.txt", "kept on disk")
    assert sbx.pause(mode="filesystem") is True

    sandbar.restart(kill9=True)

    assert _listed(tag) == {sbx.sandbox_id}
    assert sbx.get_info().state.value == "paused"
    assert not sandbox_cgroup_dirs(sbx.sandbox_id)
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert resumed.files.read("/home/user/shelved.txt") == "kept on disk"
    assert resumed.kill() is True


def test_kill9_while_checkpointed_then_resume(make_sandbox, sandbar):
    from test_checkpoint import header_of, wait_checkpointed

    require_checkpoints(sandbar)
    tag = unique("restartckpt")
    sbx = make_sandbox(timeout=120, metadata={"restart-tag": tag})
    sbx.commands.run(COUNTER, background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    before = read_count(sbx)
    assert sbx.pause() is True
    wait_checkpointed(sandbar, sbx.sandbox_id)

    sandbar.restart(kill9=True)

    assert _listed(tag) == {sbx.sandbox_id}
    assert sbx.get_info().state.value == "paused"
    assert header_of(sandbar, sbx.sandbox_id).exists()
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    after = read_count(resumed)
    assert before <= after < before + 40, (before, after)
    wait_until(lambda: read_count(resumed) > after + 5, timeout=10)
    assert resumed.kill() is True


def test_a_checkpoint_whose_namespaces_died_keeps_its_files(make_sandbox, sandbar):
    """A host reboot ends the namespaces a checkpoint is restored into: the memory is lost
    then, not the sandbox. It stays paused with its files and boots afresh on them."""
    import subprocess

    from test_checkpoint import header_of, wait_checkpointed

    require_checkpoints(sandbar)
    sbx = make_sandbox(timeout=120)
    sbx.files.write("/home/user/kept.txt", "kept across the reboot")
    sbx.commands.run(COUNTER, background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    assert sbx.pause() is True
    wait_checkpointed(sandbar, sbx.sandbox_id)

    def as_after_a_reboot():
        # What a reboot leaves of the kept namespaces: the files their bind mounts were on.
        for kind in ("net", "user"):
            kept = sandbar.data_dir / "checkpoints" / f"{sbx.sandbox_id}.{kind}"
            while subprocess.run(["umount", str(kept)], capture_output=True).returncode == 0:
                pass

    _restart_killed_after(sandbar, as_after_a_reboot)

    assert sbx.get_info().state.value == "paused"
    assert not header_of(sandbar, sbx.sandbox_id).exists()
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert resumed.files.read("/home/user/kept.txt") == "kept across the reboot"
    # Booted afresh: the counter did not come back.
    assert "count.new" not in resumed.commands.run("ps -eo args").stdout
    assert resumed.kill() is True
    assert not sandbox_cgroup_dirs(sbx.sandbox_id)


def _restart_killed_after(sandbar, change) -> None:
    """Stops the server with kill -9, calls `change` while it is down, and starts it again."""
    sandbar.stop(kill9=True)
    change()
    sandbar.start()
    sandbar.wait_healthy(timeout=60)
    sandbar.wait_base_template(timeout=120)


def _restart_as_if_killed_mid_checkpoint(sandbar, sandbox_id: str) -> None:
    """Stops the server with kill -9, records the sandbox as it would be had the server died
    during a checkpoint (`status = checkpointing`), and starts it again."""
    import sqlite3

    def record_checkpointing():
        db = sqlite3.connect(sandbar.data_dir / "sandbar.db")
        try:
            db.execute("UPDATE sandboxes SET status = 'checkpointing' WHERE id = ?", (sandbox_id,))
            db.commit()
        finally:
            db.close()

    _restart_killed_after(sandbar, record_checkpointing)


def test_crash_mid_checkpoint_is_resolved_either_way(make_sandbox, sandbar):
    from test_checkpoint import header_of, wait_checkpointed

    require_checkpoints(sandbar)
    # Died before the dump ended the processes: the partial checkpoint goes, the sandbox is
    # still frozen in memory.
    alive = make_sandbox(timeout=120)
    alive.commands.run(COUNTER, background=True)
    wait_until(lambda: alive.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    assert alive.pause() is True
    partial = sandbar.data_dir / "checkpoints" / alive.sandbox_id
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "partial.img").write_bytes(b"x")
    _restart_as_if_killed_mid_checkpoint(sandbar, alive.sandbox_id)
    assert not (partial / "partial.img").exists()
    resumed = Sandbox.connect(alive.sandbox_id, timeout=60)
    after = read_count(resumed)
    wait_until(lambda: read_count(resumed) > after + 5, timeout=10)

    # Died after the dump, before recording it: the complete checkpoint is adopted.
    done = make_sandbox(timeout=120)
    done.files.write("/home/user/kept.txt", "on disk")
    assert done.pause() is True
    wait_checkpointed(sandbar, done.sandbox_id)
    _restart_as_if_killed_mid_checkpoint(sandbar, done.sandbox_id)
    assert header_of(sandbar, done.sandbox_id).exists()
    assert done.get_info().state.value == "paused"
    again = Sandbox.connect(done.sandbox_id, timeout=60)
    assert again.files.read("/home/user/kept.txt") == "on disk"
    assert resumed.kill() is True and again.kill() is True


def test_sigterm_restart_keeps_sandboxes(make_sandbox, sandbar):
    tag = unique("restart15")
    sbx = make_sandbox(timeout=120, metadata={"restart-tag": tag})
    sbx.files.write("/home/user/graceful.txt", "survives SIGTERM")
    end = sbx.get_info().end_at

    sandbar.restart(kill9=False)

    assert _listed(tag) == {sbx.sandbox_id}
    assert sbx.files.read("/home/user/graceful.txt") == "survives SIGTERM"
    assert sbx.commands.run("echo still here").stdout == "still here\n"
    assert abs((sbx.get_info().end_at - end).total_seconds()) <= 1
    # new sandboxes can be created after the restart
    other = make_sandbox(timeout=60)
    assert other.commands.run("echo new").stdout == "new\n"
    assert sbx.kill() is True


def test_sandbox_expiring_while_server_is_down_is_reaped(make_sandbox, sandbar):
    tag = unique("restartdown")
    sbx = make_sandbox(timeout=6, metadata={"restart-tag": tag})
    keeper = make_sandbox(timeout=120, metadata={"restart-tag": tag})
    end = sbx.get_info().end_at
    downtime = max(0.0, (end - _now()).total_seconds()) + 2
    sandbar.restart(kill9=True, downtime=downtime)

    wait_until(lambda: _gone(sbx.sandbox_id), timeout=15, message="the expired sandbox to be reaped after start")
    assert _listed(tag) == {keeper.sandbox_id}
    assert keeper.commands.run("echo ok").stdout == "ok\n"
    wait_until(
        lambda: not sandbox_cgroup_dirs(sbx.sandbox_id),
        timeout=15,
        message="the expired sandbox's cgroups to go away",
    )


def test_killed_sandbox_stays_dead_after_restart(make_sandbox, sandbar):
    """A sandbox killed through the API stays dead across a restart."""
    sbx = make_sandbox(timeout=120)
    sid = sbx.sandbox_id
    assert sbx.kill() is True
    sandbar.restart(kill9=True)
    assert _gone(sid)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sid)


def test_paused_sandbox_survives_kill9_and_resumes(make_sandbox, sandbar):
    sbx = make_sandbox(timeout=300)
    sbx.files.write("/home/user/kept.txt", "kept")
    sbx.commands.run(COUNTER, background=True)
    time.sleep(0.5)
    before = read_count(sbx)
    assert sbx.pause() is True
    sandbar.restart(kill9=True)
    with sandbar.client() as api:
        r = api.get(f"/sandboxes/{sbx.sandbox_id}")
        assert r.status_code == 200 and r.json()["state"] == "paused", r.text
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    after = read_count(resumed)
    assert before <= after < before + 40, (before, after)
    assert resumed.files.read("/home/user/kept.txt") == "kept"


def test_snapshot_survives_kill9_and_starts_sandboxes(make_sandbox, sandbar):
    require_checkpoints(sandbar, "snapshot memory")
    source = make_sandbox(timeout=300)
    source.files.write("/home/user/kept.txt", "kept")
    source.commands.run(COUNTER, background=True)
    time.sleep(0.5)
    snapshot = source.create_snapshot()
    try:
        sandbar.restart(kill9=True)
        # Nothing of a snapshot lives in the kernel: it starts sandboxes after any restart.
        copy = make_sandbox(template=snapshot.snapshot_id, timeout=120)
        first = read_count(copy)
        wait_until(lambda: read_count(copy) > first, timeout=10,
                   message="the restored counter to go on")
        assert copy.files.read("/home/user/kept.txt") == "kept"
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0])
