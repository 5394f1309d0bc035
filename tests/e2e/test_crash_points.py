"""The server dies at each step of a pause, checkpoint, resume, restore and snapshot.

The server is armed with SANDBAR_CRASH_AT=<point> and aborts the moment it reaches that point,
as a `kill -9` there would; CRIU, when it is working, runs on. After a restart every sandbox
must be whole, either running or paused with a complete checkpoint, with its counter never
gone back and its files as they were, and nothing left behind: no CRIU process, no host mount,
no half-made snapshot.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import Sandbox

from e2e_util import (
    COUNTER,
    DATA_DIR,
    host_mounts_mentioning,
    read_count,
    require_checkpoints,
    sandbox_cgroup_dirs,
    state_of,
    wait_until,
)
from test_checkpoint import header_of, wait_checkpointed


@pytest.fixture(scope="module")
def crashable(sandbar):
    require_checkpoints(sandbar)
    yield sandbar
    # Whatever happened, the next module gets an unarmed server.
    if sandbar.extra_env or sandbar.proc is None or sandbar.proc.poll() is not None:
        sandbar.extra_env = {}
        sandbar.stop(kill9=True)
        sandbar.start()
        sandbar.wait_healthy(timeout=60)
        sandbar.wait_base_template(timeout=120)


def arm(sandbar, point: str) -> None:
    """Restarts the server set to abort at `point`."""
    sandbar.extra_env = {"SANDBAR_CRASH_AT": point}
    sandbar.restart()


def expect_crash_and_restart(sandbar, point: str) -> None:
    """Waits for the armed server to abort at `point`, then starts it unarmed."""
    proc = sandbar.proc
    wait_until(lambda: proc.poll() is not None, timeout=60, message=f"the server to abort at {point}")
    assert f"crash point {point} reached" in Path(sandbar.log_path).read_text(errors="replace"), (
        f"the server died elsewhere than at {point}\n" + sandbar.log_tail()
    )
    sandbar.extra_env = {}
    sandbar.stop()
    sandbar.start()
    sandbar.wait_healthy(timeout=180)
    sandbar.wait_base_template(timeout=120)


def criu_processes() -> list:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"criu") and str(DATA_DIR).encode() in b" ".join(args):
            found.append(int(proc.name))
    return found


def armed_counting_sandbox(crashable, make_sandbox, point: str):
    """Restarts the server set to abort at `point` (see arm), then makes a sandbox on it that
    holds a file and counts in /tmp/count; the sandbox and its count so far."""
    arm(crashable, point)
    sbx = make_sandbox(timeout=300)
    sbx.files.write("/home/user/kept.bin", bytes(range(256)) * 64)
    sbx.commands.run(COUNTER, background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    return sbx, read_count(sbx)


def state_after_crash(crashable, point: str, sandbox_id: str) -> str:
    """Waits for the armed server to abort at `point` and starts it unarmed (see
    expect_crash_and_restart); no CRIU process is left then. The sandbox's state after."""
    expect_crash_and_restart(crashable, point)
    assert criu_processes() == []
    return state_of(crashable, sandbox_id)


def assert_whole_and_running(sbx_id: str, before: int) -> Sandbox:
    """Connects (resuming it if paused) and checks the counter went on from where it was and
    the file is unchanged."""
    sbx = Sandbox.connect(sbx_id, timeout=120)
    now = read_count(sbx)
    assert now >= before, (now, before)
    wait_until(lambda: read_count(sbx) > now, timeout=10, message="the counter to go on")
    assert sbx.files.read("/home/user/kept.bin", format="bytes") == bytes(range(256)) * 64
    return sbx


def assert_nothing_left(sbx: Sandbox) -> None:
    sandbox_id = sbx.sandbox_id
    assert sbx.kill() is True
    assert criu_processes() == []
    wait_until(lambda: not sandbox_cgroup_dirs(sandbox_id), timeout=10, message="its cgroups to go")
    assert host_mounts_mentioning(sandbox_id) == []
    assert not (DATA_DIR / "checkpoints" / sandbox_id).exists()


def test_crash_after_freezing_leaves_it_running(crashable, make_sandbox):
    sbx, before = armed_counting_sandbox(crashable, make_sandbox, "pause.frozen")
    with pytest.raises(Exception):
        sbx.pause()
    expect_crash_and_restart(crashable, "pause.frozen")
    # Not recorded paused: thawed again, as the store says.
    assert state_of(crashable, sbx.sandbox_id) == "running"
    assert_nothing_left(assert_whole_and_running(sbx.sandbox_id, before))


def test_crash_during_a_pause_without_memory_keeps_the_files(crashable, make_sandbox):
    sbx, _ = armed_counting_sandbox(crashable, make_sandbox, "pause.released")
    with pytest.raises(Exception):
        sbx.pause(mode="filesystem")
    expect_crash_and_restart(crashable, "pause.released")
    # Not taken for dead: the pause is finished, the files kept.
    assert state_of(crashable, sbx.sandbox_id) == "paused"
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert resumed.files.read("/home/user/kept.bin", format="bytes") == bytes(range(256)) * 64
    assert_nothing_left(resumed)


def test_crash_after_thawing_leaves_it_paused(crashable, make_sandbox):
    sbx, before = armed_counting_sandbox(crashable, make_sandbox, "resume.thawed")
    assert sbx.pause() is True
    with pytest.raises(Exception):
        Sandbox.connect(sbx.sandbox_id, timeout=120)
    expect_crash_and_restart(crashable, "resume.thawed")
    # Not recorded running: frozen again, as the store says.
    assert state_of(crashable, sbx.sandbox_id) == "paused"
    assert_nothing_left(assert_whole_and_running(sbx.sandbox_id, before))


@pytest.mark.parametrize("point", ["checkpoint.dumping", "checkpoint.dumped"])
def test_crash_during_a_checkpoint_finishes_it(crashable, make_sandbox, point):
    sbx, before = armed_counting_sandbox(crashable, make_sandbox, point)
    assert sbx.pause() is True
    # The checkpoint starts after the pause grace, in the background.
    assert state_after_crash(crashable, point, sbx.sandbox_id) == "paused"
    # The dump ran to its end on its own and was sealed at the restart.
    wait_checkpointed(crashable, sbx.sandbox_id)
    assert_nothing_left(assert_whole_and_running(sbx.sandbox_id, before))


@pytest.mark.parametrize("point", ["restore.restoring", "restore.restored"])
def test_crash_during_a_restore_finishes_it(crashable, make_sandbox, point):
    sbx, before = armed_counting_sandbox(crashable, make_sandbox, point)
    assert sbx.pause() is True
    wait_checkpointed(crashable, sbx.sandbox_id)
    with pytest.raises(Exception):
        Sandbox.connect(sbx.sandbox_id, timeout=120)
    # The restore ran to its end on its own: the sandbox runs, its checkpoint spent.
    assert state_after_crash(crashable, point, sbx.sandbox_id) == "running"
    assert not header_of(crashable, sbx.sandbox_id).exists()
    sbx = assert_whole_and_running(sbx.sandbox_id, before)
    # It pauses and resumes like any other afterwards.
    again = read_count(sbx)
    assert sbx.pause() is True
    wait_checkpointed(crashable, sbx.sandbox_id)
    assert_nothing_left(assert_whole_and_running(sbx.sandbox_id, again))


@pytest.mark.parametrize("point", ["snapshot.dumping", "snapshot.copied"])
def test_crash_during_a_snapshot_leaves_it_running_and_no_snapshot(crashable, make_sandbox, point):
    snapshots_dir = DATA_DIR / "snapshots"
    snapshot_dirs = set(snapshots_dir.iterdir()) if snapshots_dir.exists() else set()
    sbx, before = armed_counting_sandbox(crashable, make_sandbox, point)
    with pytest.raises(Exception):
        sbx.create_snapshot()
    # Held still for the dump when the server died: thawed again at the restart.
    assert state_after_crash(crashable, point, sbx.sandbox_id) == "running"
    with crashable.client() as api:
        listed = api.get("/snapshots", params={"sandboxID": sbx.sandbox_id})
        assert listed.status_code == 200 and listed.json() == [], listed.text
    # The half-made copy is collected at the restart.
    now = set(snapshots_dir.iterdir()) if snapshots_dir.exists() else set()
    assert now <= snapshot_dirs, now - snapshot_dirs
    sbx = assert_whole_and_running(sbx.sandbox_id, before)
    # And it can be snapshotted afterwards.
    snapshot = sbx.create_snapshot()
    Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0])
    time.sleep(0.1)
    assert_nothing_left(sbx)
