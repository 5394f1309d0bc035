"""A first start interrupted while it builds `base` leaves nothing behind and the next start builds it.

The module runs its own server on a fresh data dir under /var/tmp (its own port), so it holds
the machine-wide e2e lock itself; conftest.py runs it before any test that uses the shared
server. It interrupts the base build once with SIGINT and once with kill -9: no process of the
build outlives the server, nothing stays mounted under the data dir, and the third start builds
`base` and runs a command in a sandbox of it. It needs the Debian mirror the normal base build
uses (about 3-5 minutes in all).
"""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Dict, List

import pytest

from e2e_util import (
    BASE_ROOT,
    SANDBAR_BIN,
    SandbarServer,
    acquire_run_lock,
    all_pids,
    free_port,
    mounts_under,
    private_binaries,
    read_or_empty,
    readlink_or_empty,
    restore_environ,
    unmount_under,
    wait_until,
)

# The mmdebstrap phase the build is interrupted in: by then it has mounted /proc, /sys and
# /dev parts inside the root it builds.
BUILD_RUNNING = "base: installing essential packages"
BUILD_WAIT_S = 600


def build_processes(data_dir: Path) -> Dict[int, str]:
    """Processes of a base build in `data_dir`: mmdebstrap and unshare name the data dir on
    their command line, what they start runs chrooted into it or in their PID namespace."""
    found = {}
    own_pidns = readlink_or_empty("/proc/self/ns/pid")
    for pid in all_pids():
        cmd = read_or_empty(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
        root = readlink_or_empty(f"/proc/{pid}/root")
        cwd = readlink_or_empty(f"/proc/{pid}/cwd")
        if str(data_dir) in cmd or root.startswith(str(data_dir)) or cwd.startswith(str(data_dir)):
            if pid != os.getpid():
                found[pid] = cmd or "(no command line)"
    # Anything in the PID namespace of a build process found above is part of the build.
    namespaces = {readlink_or_empty(f"/proc/{p}/ns/pid") for p in found} - {own_pidns, ""}
    if namespaces:
        for pid in all_pids():
            if readlink_or_empty(f"/proc/{pid}/ns/pid") in namespaces:
                found.setdefault(pid, read_or_empty(f"/proc/{pid}/cmdline").replace("\0", " ").strip())
    return found


def build_pid_namespaces(data_dir: Path) -> set:
    own = readlink_or_empty("/proc/self/ns/pid")
    return {
        ns
        for ns in (readlink_or_empty(f"/proc/{p}/ns/pid") for p in build_processes(data_dir))
        if ns and ns != own
    }


def processes_in(namespaces: set) -> Dict[int, str]:
    return {
        pid: read_or_empty(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
        for pid in all_pids()
        if readlink_or_empty(f"/proc/{pid}/ns/pid") in namespaces
    }


class FirstStart:
    def __init__(self):
        self.data_dir = Path(f"/var/tmp/sandbar-e2e-first-start-{uuid.uuid4().hex[:10]}")
        self.log_path = Path("/tmp/sandbar-e2e-logs") / f"first-start-{self.data_dir.name}.log"
        self.binary, _ = private_binaries(SANDBAR_BIN)
        self.server = SandbarServer(
            self.binary,
            self.data_dir,
            self.log_path,
            free_port(),
            extra_args=["--base-disk-mb", "512", "--disk-pool-gb", "2"],
        )

    def log(self) -> str:
        return read_or_empty(str(self.log_path))

    def log_since_start(self) -> str:
        text = self.log()
        marker = f"===== sandbar start #{self.server.starts} "
        return text[text.rfind(marker):] if marker in text else text

    def wait_for_build(self) -> None:
        deadline = time.monotonic() + BUILD_WAIT_S
        while BUILD_RUNNING not in self.log_since_start():
            proc = self.server.proc
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"sandbar exited with {proc.returncode}\n{self.server.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no '{BUILD_RUNNING}' within {BUILD_WAIT_S}s\n{self.server.log_tail()}")
            time.sleep(0.5)

    def cleanup(self) -> List[str]:
        problems = []
        self.server.stop_in_teardown(problems)
        for pid in build_processes(self.data_dir):
            try:
                os.kill(pid, signal.SIGKILL)
                problems.append(f"killed a leftover process {pid}")
            except OSError:
                pass
        time.sleep(0.5)
        left = unmount_under(self.data_dir)
        if left:
            problems.append(f"mounts under {self.data_dir} could not be removed: {left}")
        else:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        shutil.rmtree(self.binary.parent, ignore_errors=True)
        return problems


@pytest.fixture(scope="module")
def first_start():
    if os.geteuid() != 0:
        pytest.skip("needs root")
    if not SANDBAR_BIN.is_file():
        pytest.skip(f"no sandbar binary at {SANDBAR_BIN}")
    lock = acquire_run_lock(Path("/var/tmp"))
    fs = FirstStart()
    try:
        yield fs
    finally:
        problems = fs.cleanup()
        lock.close()
        assert not problems, "; ".join(problems)


def build_mounts(data_dir: Path) -> List[str]:
    """What the build's processes see mounted in the root it builds (their own mount table)."""
    partial = str(data_dir / "templates" / f".{BASE_ROOT}.partial")
    for pid in build_processes(data_dir):
        inside = [p for p in mounts_under(Path(partial), f"/proc/{pid}/mountinfo") if p != partial]
        if inside:
            return inside
    return []


def interrupt_and_check(fs: FirstStart, sig: int) -> None:
    fs.server.start()
    fs.wait_for_build()
    namespaces = build_pid_namespaces(fs.data_dir)
    assert namespaces, f"the base build runs in a PID namespace of its own: {build_processes(fs.data_dir)}"
    # Interrupt it with /proc and /sys mounted in the root it builds, where they would be left.
    inside = wait_until(lambda: build_mounts(fs.data_dir), timeout=120, message="the build's mounts")
    assert any(p.endswith("/proc") for p in inside), inside
    assert not mounts_under(fs.data_dir / "templates"), "the build's mounts must not reach the host"
    proc = fs.server.proc
    assert proc is not None
    proc.send_signal(sig)
    rc = proc.wait(timeout=60)
    if sig == signal.SIGINT:
        assert rc == 0, f"sandbar exited with {rc} on SIGINT\n{fs.server.log_tail()}"
    fs.server.stop()
    wait_until(
        lambda: not processes_in(namespaces) and not build_processes(fs.data_dir),
        timeout=15,
        message=f"the build's processes to end after {signal.Signals(sig).name}",
    )
    assert not mounts_under(fs.data_dir / "templates"), mounts_under(fs.data_dir / "templates")
    # The pool stays mounted after kill -9 (the next start finds it); nothing else may be.
    others = [p for p in mounts_under(fs.data_dir) if p != str(fs.data_dir / "sandboxes")]
    assert not others, f"mounts left under the data dir: {others}"


def test_interrupted_base_builds_leave_nothing_and_the_next_start_builds_base(first_start):
    fs = first_start
    interrupt_and_check(fs, signal.SIGINT)
    assert (fs.data_dir / "templates" / f".{BASE_ROOT}.partial").is_dir(), "the interrupted build left its root"

    interrupt_and_check(fs, signal.SIGKILL)
    assert "removed an interrupted build of 'base'" in fs.log_since_start()

    fs.server.start()
    fs.server.wait_healthy(timeout=60)
    fs.server.load_api_key()
    fs.server.wait_base_template(timeout=BUILD_WAIT_S)
    assert "removed an interrupted build of 'base'" in fs.log_since_start()
    assert not mounts_under(fs.data_dir / "templates")

    from e2b import Sandbox

    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    os.environ.update(
        {
            "E2B_API_URL": fs.server.url,
            "E2B_SANDBOX_URL": fs.server.url,
            "E2B_API_KEY": fs.server.api_key,
            "E2B_DOMAIN": fs.server.domain,
        }
    )
    try:
        sbx = Sandbox.create(timeout=60)
        try:
            assert sbx.commands.run("echo built && id -un").stdout == "built\nuser\n"
        finally:
            sbx.kill()
    finally:
        restore_environ(saved)
