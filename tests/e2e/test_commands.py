"""Running commands in a sandbox through the envd process service."""

import time

import pytest
from e2b import (
    CommandExitException,
    NotFoundException,
    PtySize,
    SandboxException,
)

from e2e_util import wait_until


def _ps_args(sbx):
    return sbx.commands.run("ps -eo args=", user="root").stdout


def test_python_prints_42(sandbox):
    r = sandbox.commands.run('python3 -c "print(6*7)"')
    assert r.stdout == "42\n"
    assert r.stderr == ""
    assert r.exit_code == 0


def test_nonzero_exit_raises_with_code_and_stderr(sandbox):
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run("echo partial; echo 'went wrong' >&2; exit 3")
    e = ei.value
    assert e.exit_code == 3
    assert e.stdout == "partial\n"
    assert e.stderr == "went wrong\n"

    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run("false")
    assert ei.value.exit_code == 1

    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run("this-command-does-not-exist-e2e")
    assert ei.value.exit_code == 127
    assert "not found" in ei.value.stderr


def test_stdout_and_stderr_are_separate(sandbox):
    r = sandbox.commands.run("echo out; echo err >&2; echo out2")
    assert r.stdout == "out\nout2\n"
    assert r.stderr == "err\n"


def test_streaming_callbacks_and_large_output(sandbox):
    chunks = []
    r = sandbox.commands.run("seq 1 50000", on_stdout=chunks.append)
    expected = "".join(f"{i}\n" for i in range(1, 50001))
    assert r.stdout == expected
    assert "".join(chunks) == expected

    errs = []
    sandbox.commands.run("echo to-err >&2", on_stderr=errs.append)
    assert "".join(errs) == "to-err\n"


def test_unicode_output(sandbox):
    r = sandbox.commands.run("printf 'h\\xc3\\xa9llo \\xe2\\x9c\\x93\\n'")
    assert r.stdout == "héllo ✓\n"


def test_envs_from_create_and_per_command(make_sandbox):
    sbx = make_sandbox(envs={"E2E_GLOBAL": "g1", "E2E_SHARED": "from-create"})
    assert sbx.commands.run("echo $E2E_GLOBAL").stdout == "g1\n"
    r = sbx.commands.run('echo "$E2E_LOCAL|$E2E_SHARED|$E2E_GLOBAL"', envs={"E2E_LOCAL": "x y", "E2E_SHARED": "override"})
    assert r.stdout == "x y|override|g1\n"
    # per-command envs do not stick
    assert sbx.commands.run('echo "[$E2E_LOCAL]"').stdout == "[]\n"
    # create-time envs are visible to other users too
    assert sbx.commands.run("echo $E2E_GLOBAL", user="root").stdout == "g1\n"


def test_cwd(sandbox):
    assert sandbox.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"
    sandbox.commands.run("mkdir -p /home/user/work/sub")
    assert sandbox.commands.run("pwd", cwd="/home/user/work/sub").stdout == "/home/user/work/sub\n"
    with pytest.raises(SandboxException):
        sandbox.commands.run("pwd", cwd="/definitely/not/here")


def test_users(sandbox):
    assert sandbox.commands.run("whoami").stdout == "user\n"
    assert sandbox.commands.run("echo $HOME").stdout == "/home/user\n"
    assert sandbox.commands.run("whoami", user="root").stdout == "root\n"
    assert sandbox.commands.run("id -u", user="root").stdout == "0\n"
    assert sandbox.commands.run("id -u").stdout.strip() != "0"
    # the default user cannot write to root-owned places
    with pytest.raises(CommandExitException):
        sandbox.commands.run("touch /root/nope")
    # ...but root can
    sandbox.commands.run("touch /root/yes", user="root")


def test_passwordless_sudo(sandbox):
    sandbox.commands.run("sudo -n true")
    assert sandbox.commands.run("sudo -n whoami").stdout == "root\n"


def test_background_kill_and_list(sandbox):
    h = sandbox.commands.run("sleep 987654", background=True)
    assert h.pid > 0
    procs = sandbox.commands.list()
    mine = [p for p in procs if p.pid == h.pid]
    assert mine, f"pid {h.pid} not in commands.list(): {procs}"
    assert mine[0].cmd == "/bin/bash"
    assert any("sleep 987654" in a for a in mine[0].args), mine[0].args
    assert "sleep 987654" in _ps_args(sandbox)

    assert h.kill() is True
    with pytest.raises(CommandExitException):
        h.wait()
    wait_until(
        lambda: h.pid not in [p.pid for p in sandbox.commands.list()],
        timeout=10,
        message="killed command to leave commands.list()",
    )
    wait_until(lambda: "sleep 987654" not in _ps_args(sandbox), timeout=10, message="sleep to be gone")
    assert sandbox.commands.kill(h.pid) is False


def test_commands_kill_by_pid(sandbox):
    h = sandbox.commands.run("sleep 876543", background=True)
    assert sandbox.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()


def test_background_wait_gets_output(sandbox):
    h = sandbox.commands.run("sleep 1; echo done-bg", background=True)
    r = h.wait()
    assert r.stdout == "done-bg\n"
    assert r.exit_code == 0


def test_stdin(sandbox):
    h = sandbox.commands.run("cat", background=True, stdin=True)
    h.send_stdin("hello stdin\n")
    sandbox.commands.send_stdin(h.pid, b"second line\n")
    h.close_stdin()
    r = h.wait()
    assert r.stdout == "hello stdin\nsecond line\n"
    assert r.exit_code == 0


def test_stdin_closed_by_default(sandbox):
    # without stdin=True the command must see EOF at once instead of hanging
    r = sandbox.commands.run("cat; echo after-cat", timeout=15)
    assert r.stdout == "after-cat\n"


def test_pty(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=30)
    assert h.pid > 0
    # The quotes keep the typed text (echoed back by the terminal) different
    # from the command's output.
    sandbox.pty.send_stdin(h.pid, b"echo hel''lo; stty size; tty\n")
    sandbox.pty.send_stdin(h.pid, b"exit\n")
    data = bytearray()
    r = h.wait(on_pty=data.extend)
    out = data.decode("utf-8", "replace")
    assert "hello" in out.replace("hel''lo", ""), out
    assert "24 80" in out, out
    assert "/dev/pts/" in out, out
    assert r.exit_code == 0


def test_pty_resize_and_kill(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=30)
    sandbox.pty.resize(h.pid, PtySize(rows=40, cols=100))
    sandbox.pty.send_stdin(h.pid, b"stty size\n")
    time.sleep(1)
    assert sandbox.pty.kill(h.pid) is True
    data = bytearray()
    try:
        h.wait(on_pty=data.extend)
    except CommandExitException:
        pass
    assert "40 100" in data.decode("utf-8", "replace")


def test_command_timeout_kills_process(sandbox):
    start = time.monotonic()
    with pytest.raises(SandboxException):
        sandbox.commands.run("sleep 1017", timeout=2)
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"timeout=2 took {elapsed:.1f}s"
    wait_until(
        lambda: "sleep 1017" not in _ps_args(sandbox),
        timeout=10,
        message="the timed-out command to be killed",
    )
    # the sandbox still works
    assert sandbox.commands.run("echo ok").stdout == "ok\n"


def test_connect_to_running_command(sandbox):
    h = sandbox.commands.run("for i in 1 2 3 4; do echo tick$i; sleep 1; done", background=True)
    h.disconnect()
    h2 = sandbox.commands.connect(h.pid, timeout=30)
    assert h2.pid == h.pid
    r = h2.wait()
    assert "tick4" in r.stdout
    assert r.exit_code == 0


def test_connect_to_unknown_pid_raises(sandbox):
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999999, timeout=10).wait()


def test_many_commands_in_parallel(sandbox):
    handles = [sandbox.commands.run(f"sleep 1; echo job{i}", background=True) for i in range(8)]
    outs = sorted(h.wait().stdout for h in handles)
    assert outs == sorted(f"job{i}\n" for i in range(8))
