"""The checkpoint path as a hostile tenant meets it, with only an API key and the SDK: what a
sandbox holds when it is paused to disk or snapshotted (a FIFO, terminals, a file passed in
from another sandbox) never blocks the node, never becomes the server's terminal and is
never reopened on the host. The suite's server is started as a session leader (as systemd
starts it), the case where a terminal opened without O_NOCTTY would become its own.

Skipped, with the server's reason, when the server found no usable CRIU."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
from e2b import Sandbox, SandboxException, Volume

from e2e_util import require_checkpoints, unique, wait_until
from test_checkpoint import header_of


@pytest.fixture(scope="module")
def checkpoints(sandbar):
    require_checkpoints(sandbar)
    return sandbar


def gone(sandbar, sandbox_id: str) -> bool:
    with sandbar.client(timeout=10) as api:
        return api.get(f"/sandboxes/{sandbox_id}").status_code == 404


def logs_of(sandbar, sandbox_id: str) -> str:
    with sandbar.client(timeout=10) as api:
        r = api.get(f"/v2/sandboxes/{sandbox_id}/logs", params={"limit": 1000})
    assert r.status_code == 200, r.text
    return r.text


def server_is_whole(sandbar) -> None:
    """The server still runs, leads no session and has no controlling terminal."""
    assert sandbar.proc.poll() is None, "the server process ended\n" + sandbar.log_tail()
    pid = sandbar.pid
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # After the command name: state, ppid, pgrp, session, tty_nr.
    session, tty_nr = int(fields[3]), int(fields[4])
    assert session != pid, "the serving process leads its session"
    assert tty_nr == 0, f"the server has a controlling terminal ({tty_nr:#x})"
    with sandbar.client(timeout=10) as api:
        assert api.get("/health").status_code in (200, 204)


FIFO_HOLDER = (
    "mkfifo /tmp/trust.fifo && exec 3<>/tmp/trust.fifo 4</tmp/trust.fifo 5>/tmp/trust.fifo "
    "&& echo $$ > /tmp/fifo-holder && exec sleep 100000"
)


def test_a_fifo_held_across_pause_to_disk_blocks_neither_the_dump_nor_the_reaper(checkpoints, make_sandbox):
    sbx = make_sandbox()
    sbx.commands.run(f"bash -c '{FIFO_HOLDER}'", background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/fifo-holder").exit_code == 0, timeout=10,
               message="the FIFO to be held")
    holder = sbx.files.read("/tmp/fifo-holder").strip()
    assert sbx.pause() is True
    short = make_sandbox(timeout=10)
    created = time.monotonic()
    wait_until(lambda: header_of(checkpoints, sbx.sandbox_id).exists(), timeout=40,
               message="the sandbox holding a FIFO to be checkpointed")
    # The reaper went on ending sandboxes meanwhile.
    wait_until(lambda: gone(checkpoints, short.sandbox_id), timeout=30,
               message="the 10 s sandbox created after the pause to be ended")
    assert time.monotonic() - created < 30
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    # The same process, still holding the FIFO: a write finds its reader at once.
    assert resumed.commands.run(f"kill -0 {holder}", user="root").exit_code == 0
    wrote = resumed.commands.run("timeout 5 sh -c 'echo ping > /tmp/trust.fifo'", user="root")
    assert wrote.exit_code == 0, wrote
    server_is_whole(checkpoints)


PTY_HOLDER = r"""
import os, time
master, slave = os.openpty()
open('/tmp/pty-ready', 'w').write(os.ttyname(slave))
while not os.path.exists('/tmp/pty-go'):
    time.sleep(0.05)
# What a terminal's owner sends its session: quit, interrupt, then a hang-up by closing.
os.write(master, b'\x1c\x03\x1a')
os.close(master)
os.close(slave)
open('/tmp/pty-done', 'w').write('sent')
"""


def test_a_terminal_held_across_snapshot_pause_and_resume_never_reaches_the_server(checkpoints, make_sandbox):
    from e2b import PtySize

    sbx = make_sandbox()
    sbx.files.write("/tmp/pty_holder.py", PTY_HOLDER)
    sbx.commands.run("python3 /tmp/pty_holder.py", background=True)
    wait_until(lambda: sbx.commands.run("test -s /tmp/pty-ready").exit_code == 0, timeout=10,
               message="the terminal to be held")
    # And a terminal of the SDK's own, held by the agent.
    terminal = sbx.pty.create(PtySize(rows=24, cols=80))
    try:
        snapshot = sbx.create_snapshot()
        assert snapshot.snapshot_id
    except SandboxException as e:
        # Refusing is allowed; failing the server is not.
        assert "409" in str(e) or "cannot be checkpointed" in str(e), e
    server_is_whole(checkpoints)
    assert sbx.pause() is True
    wait_until(lambda: header_of(checkpoints, sbx.sandbox_id).exists(), timeout=40,
               message="the sandbox holding terminals to be checkpointed")
    resumed = Sandbox.connect(sbx.sandbox_id, timeout=120)
    resumed.commands.run("touch /tmp/pty-go")
    wait_until(lambda: resumed.commands.run("test -s /tmp/pty-done").exit_code == 0, timeout=10,
               message="the held terminal to be signalled and closed")
    resumed.pty.kill(terminal.pid)
    time.sleep(1)
    server_is_whole(checkpoints)
    assert resumed.commands.run("echo still").stdout == "still\n"


PASSER = r"""
import os, socket, sys
path, size = sys.argv[1], int(sys.argv[2])
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, 'wb') as f:
    f.write(b'B' * size)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind('/mnt/shared/pass.sock')
listener.listen(1)
open('/tmp/passer-ready', 'w').write('1')
conn, _ = listener.accept()
fd = os.open(path, os.O_RDONLY)
socket.send_fds(conn, [b'x'], [fd])
conn.close()
listener.close()
os.close(fd)
os.unlink(path)
open('/tmp/passer-done', 'w').write('1')
"""

TAKER = r"""
import os, socket, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect('/mnt/shared/pass.sock')
_, fds, _, _ = socket.recv_fds(s, 1, 1)
s.close()
open('/tmp/taker-ready', 'w').write(str(fds[0]))
while not os.path.exists('/tmp/taker-go'):
    time.sleep(0.05)
open('/tmp/taker-read', 'wb').write(os.pread(fds[0], 4096, 0))
"""


def test_a_descriptor_passed_from_another_sandbox_is_never_reopened_on_the_host(
        checkpoints, make_sandbox, monkeypatch):
    monkeypatch.setenv("E2B_VOLUME_API_URL", checkpoints.url)
    secret_dir = Path(f"/tmp/sandbar-e2e-secret-{uuid.uuid4().hex[:8]}")
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret.txt"
    secret_text = b"HOST-SECRET-" + uuid.uuid4().hex.encode()
    secret.write_bytes(secret_text)
    os.chmod(secret, 0o600)
    vol = Volume.create(unique("pass"))
    made = []
    try:
        b = make_sandbox(volume_mounts={"/mnt/shared": vol})
        a = make_sandbox(volume_mounts={"/mnt/shared": vol})
        made += [a, b]
        for s in (a, b):
            s.commands.run("chmod 1777 /mnt/shared", user="root")
        b.files.write("/tmp/passer.py", PASSER)
        a.files.write("/tmp/taker.py", TAKER)
        # B's file sits at the path of the host's file, with the same size.
        b.commands.run(f"python3 /tmp/passer.py {secret} {len(secret_text)}", background=True, user="root")
        wait_until(lambda: b.commands.run("test -s /tmp/passer-ready").exit_code == 0, timeout=10)
        a.commands.run("python3 /tmp/taker.py", background=True, user="root")
        wait_until(lambda: a.commands.run("test -s /tmp/taker-ready").exit_code == 0, timeout=10,
                   message="the descriptor to be passed")
        wait_until(lambda: b.commands.run("test -s /tmp/passer-done").exit_code == 0, timeout=10)

        # A copy of its memory is refused (a sandbox with volumes cannot be copied with its
        # memory at all), naming no path.
        with checkpoints.client(timeout=60) as api:
            r = api.post(f"/sandboxes/{a.sandbox_id}/snapshots", json={})
        assert r.status_code == 409, r.text
        assert str(secret_dir) not in r.text

        # A pause stays in memory; the sandbox's log and /health say why.
        assert a.pause() is True
        wait_until(lambda: "cannot be checkpointed" in logs_of(checkpoints, a.sandbox_id), timeout=30,
                   message="the refused checkpoint in the sandbox's log")
        assert not header_of(checkpoints, a.sandbox_id).exists()
        log = logs_of(checkpoints, a.sandbox_id)
        assert "a file from outside the sandbox" in log and str(secret_dir) not in log, log
        with checkpoints.client(timeout=10) as api:
            health = api.get("/health")
        assert health.status_code == 200 and "stays in memory" in health.text, health.text

        resumed = Sandbox.connect(a.sandbox_id, timeout=120)
        resumed.commands.run("touch /tmp/taker-go")
        wait_until(lambda: resumed.commands.run("test -s /tmp/taker-read").exit_code == 0, timeout=10)
        read = resumed.files.read("/tmp/taker-read", format="bytes")
        assert read == b"B" * len(secret_text), read
        assert secret_text not in read
        assert str(secret_dir) not in checkpoints.log_tail(400)
        server_is_whole(checkpoints)
    finally:
        # The volume goes once no sandbox mounts it.
        for s in made:
            try:
                s.kill()
            except Exception:  # noqa: BLE001 - teardown must not mask the result
                pass
        try:
            Volume.destroy(vol.volume_id)
        except Exception:  # noqa: BLE001 - teardown must not mask the result
            pass
        shutil.rmtree(secret_dir, ignore_errors=True)
