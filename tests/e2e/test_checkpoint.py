"""Pausing to disk: a sandbox paused with its memory is checkpointed with CRIU once the pause
grace (3 s in this suite) has passed; its processes end and its memory goes back to the host.
Resuming restores it: same processes, PIDs, files and environment.

Skipped, with the server's reason, when the server found no usable CRIU (scripts/install-criu.sh
installs it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from e2b import PtySize, Sandbox, SandboxException

from e2e_util import COUNTER, read_count, require_checkpoints, sandbox_cgroup_dirs, wait_until


@pytest.fixture(scope="module")
def checkpoints(sandbar):
    require_checkpoints(sandbar)
    return sandbar


def header_of(sandbar, sandbox_id: str) -> Path:
    return sandbar.data_dir / "checkpoints" / sandbox_id / "header"


def memory_used(sandbox_id: str) -> int:
    for d in sandbox_cgroup_dirs(sandbox_id):
        for name in ("memory.usage_in_bytes", "memory.current"):
            f = Path(d) / name
            if f.exists():
                return int(f.read_text())
    raise AssertionError(f"no memory cgroup for {sandbox_id}")


def host_anon_memory() -> int:
    """The host's anonymous memory, the kind a sandbox's processes hold. MemAvailable would
    be the natural measure, but on a VM that hands freed pages back to its hypervisor (free
    page reporting, as on this one) freed memory does not show up in it."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("AnonPages:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no AnonPages in /proc/meminfo")


def wait_checkpointed(sandbar, sandbox_id: str) -> None:
    wait_until(lambda: header_of(sandbar, sandbox_id).exists(), timeout=30,
               message="the paused sandbox to be checkpointed")
    # Its processes are gone and its memory with them (a little page cache may stay).
    wait_until(lambda: memory_used(sandbox_id) < 4 << 20, timeout=10, message="its memory to be freed")


def pids(sbx) -> list:
    out = sbx.commands.run("ps -eo pid,args --no-headers").stdout
    # The counter's `sleep` and `mv` are new processes every tick (caught as `[sleep]` while
    # they exit, before their memory and arguments are gone, or as `[sleep] <defunct>` until
    # the shell waits for them), and `ps` is this command's own.
    tick = ("ps -eo", "sleep 0.05", "/tmp/count", "[sleep]", "[mv]")
    return sorted(l.strip() for l in out.splitlines() if not any(t in l for t in tick))


def test_counter_files_and_pids_survive_two_checkpoints(checkpoints, make_sandbox):
    sbx = make_sandbox(envs={"KEPT": "yes"})
    sbx.files.write("/home/user/note.txt", "before")
    sbx.commands.run(COUNTER, background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    for cycle in range(2):
        before = read_count(sbx)
        processes = pids(sbx)
        assert sbx.pause() is True
        wait_checkpointed(checkpoints, sbx.sandbox_id)
        time.sleep(0.5)
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
        assert not header_of(checkpoints, sbx.sandbox_id).exists()
        after = read_count(resumed)
        # The counter goes on from where it stopped, in the same process.
        assert before <= after < before + 40, (cycle, before, after)
        wait_until(lambda: read_count(resumed) > after + 5, timeout=10)
        assert pids(resumed) == processes
        assert resumed.files.read("/home/user/note.txt") == "before"
        assert resumed.commands.run("echo $KEPT").stdout == "yes\n"
        resumed.files.write("/home/user/note.txt", "before")


def test_open_command_streams_end_at_the_pause_and_attach_again(checkpoints, make_sandbox):
    # The agent's end of a client's open stream was made in the host's network namespace, so
    # CRIU could not dump it and the sandbox stayed in memory. The pause now ends the streams;
    # the processes run on and are attached to again after the resume.
    sbx = make_sandbox()
    counter = sbx.commands.run(COUNTER, background=True, timeout=0)
    terminal = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
    sbx.pty.send_stdin(terminal.pid, b"export MARK=kept-in-the-shell\n")
    wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
    before = read_count(sbx)
    assert sbx.pause() is True
    wait_checkpointed(checkpoints, sbx.sandbox_id)
    with pytest.raises(SandboxException):
        counter.wait()

    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert read_count(resumed) >= before
    wait_until(lambda: read_count(resumed) > before + 5, timeout=10, message="the counter to go on")
    # The same shell, with what was typed into it before the pause.
    shell = resumed.pty.connect(terminal.pid, timeout=30)
    resumed.pty.send_stdin(terminal.pid, b"echo mark=$MARK; exit\n")
    typed = bytearray()
    shell.wait(on_pty=typed.extend)
    assert b"mark=kept-in-the-shell" in typed, typed
    # The counter's stream can be taken up again, and it ends when the counter does.
    attached = resumed.commands.connect(counter.pid, timeout=30)
    assert resumed.commands.kill(counter.pid) is True
    with pytest.raises(SandboxException):
        attached.wait()
    # With no stream open the next pause goes to disk as before.
    assert resumed.pause() is True
    wait_checkpointed(checkpoints, sbx.sandbox_id)


def test_memory_is_freed_while_checkpointed(checkpoints, make_sandbox):
    held = 300 << 20
    sbx = make_sandbox()
    sbx.commands.run(
        f"python3 -c 'import time; b = bytearray({held}); b[::4096] = b\"x\" * len(b[::4096]); time.sleep(3600)'",
        background=True,
    )
    wait_until(lambda: memory_used(sbx.sandbox_id) > held, timeout=20, message="300 MiB in use")
    holding = host_anon_memory()
    assert sbx.pause() is True
    wait_checkpointed(checkpoints, sbx.sandbox_id)
    # The host sees it too (the images sit in reclaimable page cache at most). Half of it, so
    # that other activity on the host cannot fail the check.
    assert holding - host_anon_memory() > held // 2, (holding, host_anon_memory())
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    assert memory_used(sbx.sandbox_id) > held
    assert "bytearray" in resumed.commands.run("ps -eo args").stdout


def test_traffic_restores_a_checkpointed_sandbox(checkpoints, make_sandbox):
    sbx = make_sandbox(timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    sbx.files.write("/home/user/woken.txt", "from disk")
    wait_checkpointed(checkpoints, sbx.sandbox_id)
    with checkpoints.client() as api:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
    # The SDK's next call through the edge restores it.
    assert sbx.files.read("/home/user/woken.txt") == "from disk"
    with checkpoints.client() as api:
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "running"


def test_a_checkpointed_sandbox_can_be_killed(checkpoints, make_sandbox):
    sbx = make_sandbox()
    assert sbx.pause() is True
    wait_checkpointed(checkpoints, sbx.sandbox_id)
    assert sbx.kill() is True
    assert not (checkpoints.data_dir / "checkpoints" / sbx.sandbox_id).exists()
    assert not sandbox_cgroup_dirs(sbx.sandbox_id)


def test_a_sandbox_with_a_volume_is_checkpointed_and_keeps_it(checkpoints, make_sandbox):
    # The volume is named to CRIU as an external mount: its files stay in the volume, and the
    # restore binds it back id-mapped as before.
    from e2b import Volume

    from e2e_util import host_mounts_mentioning, unique

    vol = Volume.create(unique("ckvol"))
    try:
        sbx = make_sandbox(volume_mounts={"/mnt/v": vol})
        sbx.commands.run("echo kept > /mnt/v/f", user="user")
        # A process holding a file of the volume open across the checkpoint.
        sbx.commands.run("exec 3>>/mnt/v/log; while true; do echo tick >&3; sleep 0.2; done",
                         background=True, user="user")
        sbx.commands.run(COUNTER, background=True)
        wait_until(lambda: sbx.commands.run("test -s /tmp/count").exit_code == 0, timeout=10)
        before = read_count(sbx)
        assert sbx.pause() is True
        wait_checkpointed(checkpoints, sbx.sandbox_id)
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
        assert read_count(resumed) >= before
        assert resumed.commands.run("cat /mnt/v/f").stdout == "kept\n"
        ticks = resumed.commands.run("wc -l < /mnt/v/log").stdout
        wait_until(lambda: resumed.commands.run("wc -l < /mnt/v/log").stdout != ticks, timeout=10,
                   message="the writer to go on appending to the volume")
        # The sandbox user still owns what it writes there.
        resumed.commands.run("echo again > /mnt/v/g", user="user")
        assert resumed.commands.run("stat -c %U /mnt/v/g").stdout.strip() == "user"
        # A copy of its memory cannot take the volume along: refused, the sandbox runs on.
        with checkpoints.client() as api:
            r = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={})
            assert r.status_code == 409 and "volume" in r.json()["message"], r.text
        assert resumed.commands.run("cat /mnt/v/f").stdout == "kept\n"
        resumed.kill()
        assert host_mounts_mentioning(sbx.sandbox_id) == []
    finally:
        Volume.destroy(vol.volume_id)


def test_open_tcp_connections_end_and_the_server_goes_on(checkpoints, make_sandbox):
    # An established connection is not kept across a checkpoint: it comes back closed, while
    # the listening server inside goes on accepting new ones.
    sbx = make_sandbox(timeout=120)
    sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp", background=True)
    wait_until(lambda: sbx.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/").stdout == "200",
               timeout=15, message="the server inside to answer")
    holder = (
        "import socket, time\n"
        "s = socket.create_connection(('127.0.0.1', 8000))\n"
        "open('/tmp/held', 'w').write('open')\n"
        "while True:\n"
        "    if s.recv(1) == b'':\n"
        "        open('/tmp/held', 'w').write('closed')\n"
        "        break\n"
    )
    sbx.files.write("/tmp/holder.py", holder)
    sbx.commands.run("python3 /tmp/holder.py", background=True)
    wait_until(lambda: sbx.commands.run("cat /tmp/held 2>/dev/null").stdout == "open", timeout=10,
               message="the connection to be open")
    assert sbx.pause() is True
    wait_checkpointed(checkpoints, sbx.sandbox_id)
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    wait_until(lambda: resumed.commands.run("cat /tmp/held").stdout == "closed", timeout=10,
               message="the held connection to end")
    out = resumed.commands.run("curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/").stdout
    assert out == "200"


THREADS = (
    "import threading, time\n"
    "counts = [0, 0, 0]\n"
    "def work(i):\n"
    "    while True:\n"
    "        counts[i] += 1\n"
    "        time.sleep(0.02)\n"
    "for i in range(3):\n"
    "    threading.Thread(target=work, args=(i,), daemon=True).start()\n"
    "while True:\n"
    "    open('/tmp/threads.new', 'w').write(' '.join(map(str, counts)))\n"
    "    __import__('os').replace('/tmp/threads.new', '/tmp/threads')\n"
    "    time.sleep(0.05)\n"
)


def thread_counts(sbx) -> list:
    return [int(n) for n in sbx.commands.run("cat /tmp/threads").stdout.split()]


def test_a_multi_threaded_process_survives_a_checkpoint_and_a_snapshot(checkpoints, make_sandbox):
    sbx = make_sandbox(timeout=120)
    sbx.files.write("/tmp/threads.py", THREADS)
    sbx.commands.run("python3 /tmp/threads.py", background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/threads").exit_code == 0, timeout=10)
    before = thread_counts(sbx)
    assert sbx.pause() is True
    wait_checkpointed(checkpoints, sbx.sandbox_id)
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    after = thread_counts(resumed)
    assert all(a >= b for a, b in zip(after, before)), (before, after)
    # Every thread runs on in the restored process, and in a copy of it.
    wait_until(lambda: all(n > a for n, a in zip(thread_counts(resumed), after)), timeout=10,
               message="every thread to go on counting")
    snapshot = resumed.create_snapshot()
    try:
        copy = make_sandbox(template=snapshot.snapshot_id, timeout=60)
        first = thread_counts(copy)
        wait_until(lambda: all(n > f for n, f in zip(thread_counts(copy), first)), timeout=10,
                   message="every thread of the copy to count")
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0])


def test_a_connection_from_the_host_left_open_across_the_pause_does_not_block_the_checkpoint(
        checkpoints, make_sandbox, sandbar):
    import socket

    sbx = make_sandbox()
    sbx.files.write("/home/user/kept.txt", "kept")
    # A connection to the agent that nothing on the edge knows of, open while the sandbox is
    # frozen: the agent's end of it belongs to the host's network namespace.
    stray = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stray.connect(str(sandbar.data_dir / "run" / f"{sbx.sandbox_id}.sock"))
    try:
        assert sbx.pause() is True
    finally:
        stray.close()
    wait_checkpointed(sandbar, sbx.sandbox_id)
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert resumed.files.read("/home/user/kept.txt") == "kept"
    assert resumed.kill() is True
