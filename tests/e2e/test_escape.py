"""Escape probes: code running as root inside a sandbox tries to reach the host, the server
and other sandboxes, and every probe asserts on what it observes (an errno, a uid, a byte
count), never only on "nothing crashed". docs/security.md lists each probe and what it shows.

Probes that only read share two module-wide sandboxes (`box`, `box2`); probes that could
change a sandbox if they succeeded (mounts, namespaces, exhaustion, deep trees) get fresh ones.
The only network peers are 127.0.0.0/8, the sandboxes themselves and the host end of their
own links.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import random
import re
import secrets
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox

from e2e_util import DATA_DIR, REPO_ROOT, created_sandbox, sandbox_cgroup_dirs, wait_until

SANDBOX_IDS = 65536

# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def run(sbx, cmd, user="root", timeout=60):
    """Run a shell command in the sandbox; (exit code, stdout, stderr), never raising on exit codes."""
    try:
        r = sbx.commands.run(cmd, user=user, timeout=timeout)
        return r.exit_code, r.stdout, r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout, e.stderr


def py_cmd(code, *args):
    return "python3 - " + " ".join(shlex.quote(str(a)) for a in args) + " <<'PYPROBE'\n" + code + "\nPYPROBE"


def py_json(sbx, code, *args, user="root", timeout=60):
    """Run a python script in the sandbox and parse the JSON on the last line of its output."""
    rc, out, err = run(sbx, py_cmd(code, *args), user=user, timeout=timeout)
    lines = [l for l in out.splitlines() if l.strip()]
    assert rc == 0 and lines, f"probe script failed (exit {rc}): {out[-2000:]} {err[-2000:]}"
    return json.loads(lines[-1])


def host_pids_running(argv):
    """Host PIDs whose command line is exactly `argv`."""
    want = "\0".join(argv) + "\0"
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline") as f:
                if f.read() == want:
                    found.append(int(d))
        except OSError:
            pass
    return found


def status_ids(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no {field} line in /proc/{pid}/status")


def id_map(sbx, which):
    rc, out, err = run(sbx, f"cat /proc/self/{which}")
    assert rc == 0, err
    return [tuple(int(x) for x in l.split()) for l in out.splitlines() if l.strip()]


def start_tagged_sleep(sbx, user="root"):
    """A `sleep` in the sandbox with a unique argument; returns (handle, argv, host pid)."""
    arg = f"{random.randint(5000, 9000)}.{random.randint(100000, 999999)}"
    handle = sbx.commands.run(f"exec sleep {arg}", background=True, user=user)
    argv = ["sleep", arg]
    pids = wait_until(lambda: host_pids_running(argv), timeout=15, message=f"host to see sleep {arg}")
    assert len(pids) == 1, pids
    return handle, argv, pids[0]


def host_statvfs(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_favail


def create_raw(sandbar, track, disk_mb=None, timeout=300):
    """Create through plain HTTP (so that `diskSizeMB` can be asked for); returns (sandbox, disk MB in effect)."""
    body = {"templateID": "base", "timeout": timeout}
    if disk_mb is not None:
        body["diskSizeMB"] = disk_mb
    with sandbar.client() as c:
        r = c.post("/sandboxes", json=body)
        assert r.status_code == 201, f"POST /sandboxes -> {r.status_code} {r.text}"
        sid = r.json()["sandboxID"]
        track(sid)
        info = c.get(f"/sandboxes/{sid}")
        assert info.status_code == 200, info.text
    return Sandbox.connect(sid), int(info.json()["diskSizeMB"])


@pytest.fixture(scope="module")
def box(sandbar):
    """A sandbox shared by the probes that only look."""
    with created_sandbox(timeout=900) as sbx:
        yield sbx


@pytest.fixture(scope="module")
def box2(sandbar):
    """A second shared sandbox, the neighbour."""
    with created_sandbox(timeout=900) as sbx:
        yield sbx


# --------------------------------------------------------------------------
# user namespace
# --------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["uid_map", "gid_map"])
def test_ids_map_to_an_unprivileged_host_range(box, which):
    m = id_map(box, which)
    assert len(m) == 1, f"/proc/self/{which} inside: {m}"
    inside, outside, count = m[0]
    assert (inside, count) == (0, SANDBOX_IDS), f"/proc/self/{which} inside: {m}"
    assert outside >= SANDBOX_IDS, f"sandbox id 0 is host id {outside}: /proc/self/{which} {m}"


def test_two_sandboxes_have_disjoint_host_ranges(box, box2):
    for which in ("uid_map", "gid_map"):
        a, b = id_map(box, which), id_map(box2, which)
        ra = [(o, o + n) for _, o, n in a]
        rb = [(o, o + n) for _, o, n in b]
        overlap = [(x, y) for x in ra for y in rb if x[0] < y[1] and y[0] < x[1]]
        assert not overlap, f"{which}: sandboxes share host ids: A {a}, B {b}"


def test_sandbox_root_is_an_unprivileged_host_user(box):
    uid_base = id_map(box, "uid_map")[0][1]
    gid_base = id_map(box, "gid_map")[0][1]
    handle, argv, pid = start_tagged_sleep(box, user="root")
    try:
        uids = status_ids(pid, "Uid")
        gids = status_ids(pid, "Gid")
        assert uids == [uid_base] * 4, f"sandbox root runs as host uids {uids} (uid_map base {uid_base})"
        assert gids == [gid_base] * 4, f"sandbox root runs as host gids {gids} (gid_map base {gid_base})"
        assert min(uids + gids) >= SANDBOX_IDS, f"host uids {uids}, gids {gids}"
    finally:
        handle.kill()


# --------------------------------------------------------------------------
# the host's files and processes
# --------------------------------------------------------------------------


def test_mount_tables_name_no_host_path(box):
    needles = {str(DATA_DIR), os.path.realpath(DATA_DIR), str(REPO_ROOT), "sandbar-e2e-bin"}
    for table in ("/proc/self/mounts", "/proc/self/mountinfo"):
        rc, out, err = run(box, f"cat {table}")
        assert rc == 0 and out.strip(), err
        leaks = [l for l in out.splitlines() if any(n in l for n in needles)]
        assert not leaks, f"{table} inside names host paths:\n" + "\n".join(leaks)


def test_host_hostname_is_not_the_sandboxes(box):
    host_file = Path("/etc/hostname").read_text().strip() if Path("/etc/hostname").exists() else None
    rc, inside_file, _ = run(box, "cat /etc/hostname")
    _, inside_uts, _ = run(box, "uname -n")
    assert rc == 0 and inside_file.strip() and inside_uts.strip()
    assert inside_uts.strip() != socket.gethostname(), f"the sandbox's hostname is the host's: {inside_uts!r}"
    if host_file:
        assert inside_file.strip() != host_file, f"the sandbox's /etc/hostname is the host's: {host_file!r}"


PROC_LISTING = r"""
import json, os
pids = sorted(int(d) for d in os.listdir('/proc') if d.isdigit())
def read(p):
    try:
        return open(p, 'rb').read().replace(b'\0', b' ').decode(errors='replace').strip()
    except OSError as e:
        return 'error ' + str(e.errno)
print(json.dumps({'pids': pids, 'comm1': read('/proc/1/comm'), 'cmdline1': read('/proc/1/cmdline')}))
"""


def test_proc_lists_only_the_sandboxes_processes(sandbox, sandbar):
    got = py_json(sandbox, PROC_LISTING)
    pids = got["pids"]
    assert 1 in pids, got
    assert "agent" in got["comm1"] or "agent" in got["cmdline1"], f"PID 1 is not the agent: {got}"
    # the agent, the shell that runs the probe, python itself
    assert len(pids) <= 6, f"/proc inside lists {len(pids)} processes: {pids}"
    for host_pid in (os.getpid(), sandbar.pid):
        assert host_pid not in pids or host_pid <= 6, f"host pid {host_pid} is listed inside"


def test_agent_command_line_names_no_host_path(box):
    rc, out, err = run(box, "tr '\\0' ' ' < /proc/1/cmdline")
    assert rc == 0 and out.strip(), err
    needles = [str(DATA_DIR), str(REPO_ROOT), "sandbar-e2e-bin"]
    assert not [n for n in needles if n in out], f"PID 1's command line inside names a host path: {out!r}"


AGENT_PROC = r"""
import errno, json, os
res = {}
def attempt(name, f):
    try:
        v = f()
        res[name] = 'OK ' + repr(v)[:300]
    except OSError as e:
        res[name] = errno.errorcode.get(e.errno, str(e.errno))
def open_close(path, flags):
    os.close(os.open(path, flags))
attempt('ls /proc/1/fd', lambda: os.listdir('/proc/1/fd'))
attempt('readlink /proc/1/exe', lambda: os.readlink('/proc/1/exe'))
attempt('ls /proc/1/root', lambda: os.listdir('/proc/1/root'))
attempt('ls /proc/1/cwd', lambda: os.listdir('/proc/1/cwd'))
attempt('read /proc/1/environ', lambda: open('/proc/1/environ', 'rb').read())
attempt('open /proc/1/mem', lambda: open_close('/proc/1/mem', os.O_RDONLY))
attempt('ls /proc/1/map_files', lambda: os.listdir('/proc/1/map_files'))
attempt('open /proc/1/exe for writing', lambda: open_close('/proc/1/exe', os.O_WRONLY))
print(json.dumps(res))
"""


def test_agent_proc_entries_are_closed_to_sandbox_root(box):
    res = py_json(box, AGENT_PROC)
    opened = {k: v for k, v in res.items() if v not in ("EACCES", "EPERM")}
    assert not opened, f"sandbox root reached the agent through /proc/1: {opened}"


# --------------------------------------------------------------------------
# the agent and links
# --------------------------------------------------------------------------

MAGIC_TARGETS = ["/proc/self/fd/2", "/proc/self/fd/1", "/proc/self/exe", "/proc/1/root/etc/passwd"]


def plant_link(sbx, target):
    link = f"/home/user/magic-{secrets.token_hex(5)}"
    rc, _, err = run(sbx, f"ln -s {shlex.quote(target)} {link}")
    assert rc == 0, err
    return link


@pytest.mark.parametrize("via", ["planted link", "direct path"])
@pytest.mark.parametrize("target", MAGIC_TARGETS)
def test_agent_refuses_to_read_through_magic_links(box, target, via):
    path = plant_link(box, target) if via == "planted link" else target
    try:
        try:
            content = box.files.read(path, format="bytes", request_timeout=15)
        except Exception as e:  # noqa: BLE001 - any refusal by the SDK counts
            refusal = repr(e)
        else:
            pytest.fail(f"files.read({path!r} -> {target}) returned {len(content)} bytes: {bytes(content[:300])!r}")
        assert refusal
    finally:
        if via == "planted link":
            run(box, f"rm -f {path}")


def host_agent_logs(sandbox_id):
    """Host files the agent writes its own output to."""
    cands = [DATA_DIR / "logs" / f"{sandbox_id}.log", DATA_DIR / "sandboxes" / sandbox_id / "agent.log"]
    return [p for p in cands if p.exists()]


def test_agent_refuses_to_write_through_a_descriptor_link(box):
    link = plant_link(box, "/proc/self/fd/2")
    marker = "sbx-escape-" + secrets.token_hex(8)
    try:
        try:
            box.files.write(link, marker + "\n", request_timeout=15)
        except Exception as e:  # noqa: BLE001
            refusal = repr(e)
        else:
            refusal = None
        leaked = [str(p) for p in host_agent_logs(box.sandbox_id) if marker in p.read_text(errors="replace")]
        assert not leaked, f"the write through {link} -> /proc/self/fd/2 landed in host files {leaked}"
        assert refusal, f"files.write through {link} -> /proc/self/fd/2 was accepted"
    finally:
        run(box, f"rm -f {link}")
    # the agent still reads and writes ordinary files
    box.files.write("/home/user/after-refusal.txt", marker)
    assert box.files.read("/home/user/after-refusal.txt") == marker


HARD_LINKS = r"""
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
res = {}
for i, src in enumerate(sys.argv[1:]):
    dst = f'/tmp/hardlink-probe-{i}'
    try:
        os.link(src, dst)
        res['link ' + src] = 'LINKED'
        os.unlink(dst)
    except OSError as e:
        res['link ' + src] = errno.errorcode.get(e.errno, str(e.errno))
# linkat(AT_SYMLINK_FOLLOW) through the agent's magic links
for src in ('/proc/1/exe', '/proc/1/fd/2', '/proc/self/fd/0'):
    dst = b'/tmp/hardlink-probe-follow'
    ctypes.set_errno(0)
    r = libc.linkat(-100, src.encode(), -100, dst, 0x400)
    if r == 0:
        res['linkat follow ' + src] = 'LINKED'
        os.unlink(dst)
    else:
        e = ctypes.get_errno()
        res['linkat follow ' + src] = errno.errorcode.get(e, str(e))
# positive control: an ordinary hard link inside the sandbox
open('/tmp/hardlink-src', 'w').write('x')
os.link('/tmp/hardlink-src', '/tmp/hardlink-dst')
res['control'] = os.stat('/tmp/hardlink-dst').st_nlink
os.unlink('/tmp/hardlink-dst'); os.unlink('/tmp/hardlink-src')
res['data dir visible'] = os.path.exists(sys.argv[1])
print(json.dumps(res))
"""


def test_no_hard_link_to_host_files(box):
    sources = [str(DATA_DIR / "credentials.json"), str(DATA_DIR / "sandbar.db"), str(REPO_ROOT / "Cargo.toml")]
    res = py_json(box, HARD_LINKS, *sources)
    assert res.pop("control") == 2, res
    assert res.pop("data dir visible") is False, res
    linked = {k: v for k, v in res.items() if v == "LINKED"}
    assert not linked, f"hard links to host files were made: {linked}"
    for src in sources:
        assert res[f"link {src}"] == "ENOENT", res
    # following the agent's links needs ptrace access to it; fd 0 of the probe itself is a pipe
    assert res["linkat follow /proc/1/exe"] in ("EACCES", "EPERM"), res
    assert res["linkat follow /proc/1/fd/2"] in ("EACCES", "EPERM"), res


def test_ordinary_symlinks_still_read(box):
    token = secrets.token_hex(12)
    box.files.write("/home/user/link-target.txt", token)
    run(box, "ln -sfn link-target.txt /home/user/rel-link && ln -sfn /home/user/link-target.txt /home/user/abs-link"
        " && ln -sfn /etc/hostname /home/user/etc-link")
    try:
        assert box.files.read("/home/user/rel-link") == token
        assert box.files.read("/home/user/abs-link") == token
        _, hostname, _ = run(box, "cat /etc/hostname")
        assert box.files.read("/home/user/etc-link") == hostname
    finally:
        run(box, "rm -f /home/user/rel-link /home/user/abs-link /home/user/etc-link /home/user/link-target.txt")


ENVIRON_SCAN = r"""
import glob, json
out = []
for p in glob.glob('/proc/[0-9]*/environ'):
    try:
        out.append(open(p, 'rb').read().decode(errors='replace'))
    except OSError:
        pass
print(json.dumps(out))
"""


def test_no_server_secrets_inside(box, sandbar):
    secrets_ = {sandbar.api_key}
    try:
        creds = json.loads((DATA_DIR / "credentials.json").read_text())
        secrets_ |= {v for v in creds.values() if isinstance(v, str) and len(v) >= 20}
    except (OSError, ValueError):
        pass
    seen = []
    for user in ("root", "user"):
        _, env, _ = run(box, "env", user=user)
        seen.append(env)
    seen.extend(py_json(box, ENVIRON_SCAN))
    for path in ("/proc/self/environ", "/proc/1/environ"):
        try:
            seen.append(bytes(box.files.read(path, format="bytes", request_timeout=15)).decode(errors="replace"))
        except Exception:  # noqa: BLE001 - refusing is fine
            pass
    text = "\n".join(seen)
    assert not [s for s in secrets_ if s in text], "a server credential is visible inside the sandbox"
    assert "SANDBAR_" not in text, [l for l in text.splitlines() if "SANDBAR_" in l][:5]


FD_LISTING = r"""
import json, os
fds = {}
for fd in os.listdir('/proc/self/fd'):
    try:
        fds[fd] = os.readlink(f'/proc/self/fd/{fd}')
    except FileNotFoundError:
        pass  # the descriptor listdir itself used, closed by now
    except OSError as e:
        fds[fd] = 'error ' + str(e.errno)
print(json.dumps({'fds': fds, 'cwd': os.getcwd(), 'root': os.readlink('/proc/self/root')}))
"""


def test_commands_inherit_no_host_descriptors(box):
    got = py_json(box, FD_LISTING)
    extra = {fd: t for fd, t in got["fds"].items() if fd not in ("0", "1", "2")}
    assert not extra, f"a command started by the agent holds descriptors {extra}"
    assert got["root"] == "/", got


CHROOT_ESCAPE = r"""
import errno, json, os, sys
before = os.stat('/')
os.makedirs('/tmp/chroot-probe', exist_ok=True)
keep = os.open('/', os.O_RDONLY)
try:
    os.chroot('/tmp/chroot-probe')
    chrooted = 'yes'
except OSError as e:
    chrooted = errno.errorcode.get(e.errno, str(e.errno))
os.fchdir(keep)
for _ in range(100):
    os.chdir('..')
try:
    os.chroot('.')
except OSError:
    pass
after = os.stat('/')
print(json.dumps({'chroot': chrooted, 'same root': (before.st_dev, before.st_ino) == (after.st_dev, after.st_ino),
                  'data dir visible': os.path.exists(sys.argv[1]), 'listing': sorted(os.listdir('/'))}))
"""


def test_chroot_dot_dot_escape_stays_inside(box):
    res = py_json(box, CHROOT_ESCAPE, str(DATA_DIR))
    assert res["same root"], f"walking up from a chroot left the sandbox's root: {res}"
    assert res["data dir visible"] is False, res


# --------------------------------------------------------------------------
# mounts, namespaces and dangerous system calls
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cmd", ["mount -t tmpfs none /mnt", "mount --bind / /mnt", "umount /proc", "umount -l /sys"]
)
def test_mount_commands_fail(sandbox, cmd):
    _, before, _ = run(sandbox, "cat /proc/self/mountinfo")
    rc, out, err = run(sandbox, cmd)
    _, after, _ = run(sandbox, "cat /proc/self/mountinfo")
    assert rc != 0, f"{cmd!r} succeeded: {out} {err}"
    assert before == after, f"{cmd!r} changed the mount table"


# Each probe runs in a child of its own, so one that succeeds (a new namespace, a mount)
# cannot change what the next one sees. Prints {name: [return value, errno name or null]}.
SYSCALL_PROBES = r'''
import ctypes, errno, json, os, signal, struct

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
AT_FDCWD = -100
CLONE = {
    "user": 0x10000000, "mnt": 0x00020000, "net": 0x40000000, "pid": 0x20000000,
    "uts": 0x04000000, "ipc": 0x08000000, "cgroup": 0x02000000, "time": 0x00000080,
}


def sc(nr, *args):
    conv = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *conv)
    e = ctypes.get_errno()
    return r, (errno.errorcode.get(e, str(e)) if r < 0 else None)


def fd_result(res):
    if res[0] >= 0:
        try:
            os.close(res[0])
        except OSError:
            pass
    return res


def forked(res):
    if res[0] == 0:
        os._exit(0)
    if res[0] > 0:
        try:
            os.waitpid(res[0], 0)
        except OSError:
            pass
    return res


def buf(size, *fields):
    b = ctypes.create_string_buffer(size)
    for fmt, off, val in fields:
        struct.pack_into(fmt, b, off, val)
    return b


def setns(ns):
    try:
        fd = os.open(f"/proc/self/ns/{ns}", os.O_RDONLY)
    except OSError as e:
        return -1, "open:" + errno.errorcode.get(e.errno, str(e.errno))
    try:
        return sc(308, fd, 0)
    finally:
        os.close(fd)


def vm_readv():
    local = ctypes.create_string_buffer(8)
    liov = buf(16, ("<Q", 0, ctypes.addressof(local)), ("<Q", 8, 8))
    riov = buf(16, ("<Q", 0, 0x400000), ("<Q", 8, 8))
    return sc(310, 1, liov, 1, riov, 1, 0)


PROBES = {
    "mount": lambda: sc(165, b"none", b"/mnt", b"tmpfs", 0, None),
    "umount2": lambda: sc(166, b"/mnt", 2),
    "fsopen": lambda: fd_result(sc(430, b"tmpfs", 0)),
    "fspick": lambda: fd_result(sc(433, AT_FDCWD, b"/", 0)),
    "open_tree_clone": lambda: fd_result(sc(428, AT_FDCWD, b"/", 1)),
    "move_mount": lambda: sc(429, AT_FDCWD, b"/proc", AT_FDCWD, b"/mnt", 0),
    "mount_setattr": lambda: sc(442, AT_FDCWD, b"/tmp", 0, buf(32), 32),
    **{f"unshare_{n}": (lambda f=f: sc(272, f)) for n, f in CLONE.items()},
    "clone_newuser": lambda: forked(sc(56, CLONE["user"] | signal.SIGCHLD, 0, 0, 0, 0)),
    "clone3_newuser": lambda: forked(sc(435, buf(88, ("<Q", 0, CLONE["user"]), ("<Q", 32, signal.SIGCHLD)), 88)),
    **{f"setns_{n}": (lambda n=n: setns(n)) for n in ("user", "mnt", "net", "pid", "uts", "ipc", "cgroup")},
    "add_key": lambda: sc(248, b"user", b"sbx-probe", b"v", 1, -2),
    "keyctl": lambda: sc(250, 0, -1, 1),
    "request_key": lambda: sc(249, b"user", b"sbx-probe-none", None, 0),
    "init_module": lambda: sc(175, buf(64), 64, b""),
    "finit_module": lambda: sc(313, -1, b"", 0),
    "delete_module": lambda: sc(176, b"sbx_probe_none", 0),
    "kexec_file_load": lambda: sc(320, -1, -1, 0, b"", 0),
    "bpf_map_create": lambda: fd_result(sc(321, 0, buf(128, ("<I", 0, 2), ("<I", 4, 4), ("<I", 8, 4), ("<I", 12, 1)), 128)),
    "perf_event_open": lambda: fd_result(
        sc(298, buf(128, ("<I", 0, 1), ("<I", 4, 128), ("<Q", 40, 1 | 1 << 5 | 1 << 6)), 0, -1, -1, 0)
    ),
    "io_uring_setup": lambda: fd_result(sc(425, 8, buf(120))),
    "userfaultfd": lambda: fd_result(sc(323, 1 | os.O_CLOEXEC)),
    "x32_getpid": lambda: sc(0x40000000 | 39),
    "syslog_read": lambda: sc(103, 3, ctypes.create_string_buffer(4096), 4096),
    "reboot_cad_off": lambda: sc(169, 0xFEE1DEAD, 672274793, 0, None),
    "swapon": lambda: sc(167, b"/nonexistent-swap", 0),
    "open_by_handle_at": lambda: fd_result(sc(304, AT_FDCWD, buf(16, ("<I", 0, 8), ("<i", 4, 1)), 0)),
    "ptrace_seize_agent": lambda: sc(101, 0x4206, 1, 0, 0),
    "process_vm_readv_agent": vm_readv,
}


def run_isolated(name):
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        try:
            res = list(PROBES[name]())
        except Exception as e:
            res = [-1, "python:" + type(e).__name__ + ":" + str(e)]
        os.write(wfd, json.dumps(res).encode())
        os._exit(0)
    os.close(wfd)
    data = b""
    while True:
        chunk = os.read(rfd, 4096)
        if not chunk:
            break
        data += chunk
    os.close(rfd)
    os.waitpid(pid, 0)
    return json.loads(data) if data else [-1, "child died"]


names = [n for n in (os.environ.get("PROBES") or ",".join(PROBES)).split(",") if n]
print(json.dumps({name: run_isolated(name) for name in names}))
'''

MOUNT_CALLS = ["mount", "umount2", "fsopen", "fspick", "open_tree_clone", "move_mount", "mount_setattr"]
NAMESPACE_CALLS = (
    [f"unshare_{n}" for n in ("user", "mnt", "net", "pid", "uts", "ipc", "cgroup", "time")]
    + ["clone_newuser", "clone3_newuser"]
    + [f"setns_{n}" for n in ("user", "mnt", "net", "pid", "uts", "ipc", "cgroup")]
)
KERNEL_CALLS = [
    "add_key", "keyctl", "request_key", "init_module", "finit_module", "delete_module", "kexec_file_load",
    "bpf_map_create", "perf_event_open", "io_uring_setup", "userfaultfd", "x32_getpid", "syslog_read",
    "reboot_cad_off", "swapon", "open_by_handle_at", "ptrace_seize_agent", "process_vm_readv_agent",
]
# Probes whose system call may simply not exist in the host's kernel (no module support, no
# kexec, no x32 ABI). They are harmless on the host, so the host is asked first; where the
# kernel itself answers ENOSYS the probe cannot show anything and is skipped.
HOST_CHECKED = ["init_module", "finit_module", "delete_module", "kexec_file_load", "x32_getpid"]
# setns into one's own user namespace is EINVAL whatever the privileges.
EXTRA_ERRNOS = {"setns_user": {"EINVAL"}}


@pytest.fixture(scope="module")
def syscall_results(sandbar):
    with created_sandbox(timeout=300) as sbx:
        return py_json(sbx, SYSCALL_PROBES, timeout=120)


@pytest.fixture(scope="module")
def host_missing_syscalls():
    env = dict(os.environ, PROBES=",".join(HOST_CHECKED))
    out = subprocess.run([sys.executable, "-c", SYSCALL_PROBES], env=env, capture_output=True, text=True, timeout=60)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {name for name, (_, err) in res.items() if err == "ENOSYS"}


@pytest.mark.parametrize("name", MOUNT_CALLS + NAMESPACE_CALLS + KERNEL_CALLS)
def test_forbidden_system_call_fails(syscall_results, host_missing_syscalls, name):
    if name in host_missing_syscalls:
        pytest.skip(f"the host kernel has no {name} (ENOSYS outside any sandbox)")
    r, err = syscall_results[name]
    allowed = {"EPERM", "ENOSYS"} | EXTRA_ERRNOS.get(name, set())
    assert r == -1 and err in allowed, f"{name} inside the sandbox returned {r} ({err}); expected -1 with {sorted(allowed)}"


@pytest.mark.parametrize(
    "args", ["-U true", "-m true", "-n true", "-p -f true", "-i true", "-u true", "-C true", "-r true"]
)
def test_unshare_command_fails(box, args):
    rc, out, err = run(box, f"unshare {args}")
    assert rc != 0, f"unshare {args} succeeded: {out} {err}"
    assert "Operation not permitted" in err or "Function not implemented" in err, err


RAW_SOCKETS = r"""
import errno, json, socket
res = {}
for name, args in (('inet raw icmp', (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
                   ('inet raw', (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)),
                   ('inet6 raw', (socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_RAW)),
                   ('packet raw', (socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))),
                   ('packet dgram', (socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(3)))):
    try:
        socket.socket(*args).close()
        res[name] = 'OPENED'
    except OSError as e:
        res[name] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(res))
"""


def test_no_raw_or_packet_sockets(box):
    res = py_json(box, RAW_SOCKETS)
    bad = {k: v for k, v in res.items() if v not in ("EPERM", "EACCES", "EAFNOSUPPORT")}
    assert not bad, f"sandbox root opened raw sockets: {res}"


@pytest.mark.parametrize("node", ["b 8 0", "c 1 1", "c 1 2", "c 10 200"])
def test_mknod_fails(box, node):
    path = f"/tmp/node-{secrets.token_hex(4)}"
    rc, out, err = run(box, f"mknod {path} {node}; rc=$?; ls -l {path} 2>/dev/null; rm -f {path}; exit $rc")
    assert rc != 0, f"mknod {node} succeeded: {out} {err}"
    assert "Operation not permitted" in err, err


# Character devices a sandbox may have: mem's null, zero, full, random, urandom; tty, console,
# ptmx; the ptys of its own devpts (majors 136-143).
ALLOWED_CHAR_DEVICES = {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 1), (5, 2)}
ALLOWED_DEV_NAMES = {
    "null", "zero", "full", "random", "urandom", "tty", "console", "ptmx", "pts", "shm", "fd",
    "stdin", "stdout", "stderr", "core", "mqueue",
}

DEV_LISTING = r"""
import json, os, stat
nodes = {}
for d, dirs, files in os.walk('/dev'):
    for n in files + dirs:
        p = os.path.join(d, n)
        st = os.lstat(p)
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            nodes[p] = ['c' if stat.S_ISCHR(st.st_mode) else 'b', os.major(st.st_rdev), os.minor(st.st_rdev)]
print(json.dumps({'names': sorted(os.listdir('/dev')), 'nodes': nodes}))
"""


def test_dev_holds_only_harmless_devices(box):
    got = py_json(box, DEV_LISTING)
    extra_names = sorted(set(got["names"]) - ALLOWED_DEV_NAMES)
    assert not extra_names, f"/dev lists {extra_names}"
    bad = {
        p: n
        for p, n in got["nodes"].items()
        if n[0] == "b" or not ((n[1], n[2]) in ALLOWED_CHAR_DEVICES or 136 <= n[1] <= 143)
    }
    assert not bad, f"device nodes in /dev beyond the harmless ones: {bad}"


# --------------------------------------------------------------------------
# /proc, /sys and cgroups
# --------------------------------------------------------------------------

OPEN_FOR_WRITING = r"""
import errno, json, os, stat, sys
res = {}
for p in sys.argv[1:]:
    try:
        fd = os.open(p, os.O_WRONLY)
    except OSError as e:
        res[p] = errno.errorcode.get(e.errno, str(e.errno))
        continue
    st = os.fstat(fd)
    os.close(fd)
    # masked with /dev/null: writes vanish
    res[p] = 'dev-null' if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3) else 'OPENED'
print(json.dumps(res))
"""

# Opened for writing and closed again, never written: a probe that succeeded changes nothing.
KERNEL_TUNABLES = [
    "/proc/sys/kernel/hostname",
    "/proc/sys/vm/drop_caches",
    "/sys/kernel/mm/transparent_hugepage/enabled",
    "/proc/sysrq-trigger",
    "/proc/sys/kernel/core_pattern",
    "/proc/sys/kernel/modprobe",
    "/proc/sys/fs/inotify/max_user_instances",
    "/proc/sys/net/ipv4/ip_forward",
    "/sys/kernel/uevent_helper",
    "/sys/power/state",
]


@pytest.mark.parametrize("path", KERNEL_TUNABLES)
def test_kernel_tunables_are_not_writable(box, path):
    if not os.path.exists(path):
        pytest.skip(f"the host kernel has no {path}")
    res = py_json(box, OPEN_FOR_WRITING, path)
    assert res[path] in ("EROFS", "EACCES", "EPERM", "ENOENT", "dev-null"), f"{path} opened for writing: {res[path]}"


CGROUP_WRITABLE = r"""
import errno, json, os
mounts = [l.split()[1] for l in open('/proc/self/mounts') if l.split()[2] in ('cgroup', 'cgroup2')]
roots = sorted(set(mounts + ['/sys/fs/cgroup']))
opened, tried = [], 0
for root in roots:
    for d, dirs, files in os.walk(root):
        for n in files:
            if tried >= 3000:
                break
            p = os.path.join(d, n)
            tried += 1
            try:
                os.close(os.open(p, os.O_WRONLY))
                opened.append(p)
            except OSError:
                pass
print(json.dumps({'mounts': mounts, 'tried': tried, 'opened': opened[:50]}))
"""


def test_cgroup_files_are_not_writable(box):
    res = py_json(box, CGROUP_WRITABLE)
    assert not res["opened"], f"cgroup files open for writing inside ({res['mounts']}): {res['opened']}"


MASKED_READ = r"""
import errno, json, os, sys
p = sys.argv[1]
if not os.path.lexists(p):
    r = 'absent'
elif os.path.isdir(p):
    try:
        r = 'entries %d' % len(os.listdir(p))
    except OSError as e:
        r = errno.errorcode.get(e.errno, str(e.errno))
else:
    try:
        with open(p, 'rb') as f:
            r = 'bytes %d' % len(f.read(65536))
    except OSError as e:
        r = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(r))
"""

MASKED_PATHS = [
    "/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/kpageflags",
    "/proc/kpagecount", "/proc/slabinfo", "/proc/config.gz", "/sys/firmware", "/sys/devices/virtual/powercap",
    "/sys/kernel/debug", "/sys/kernel/security",
]


@pytest.mark.parametrize("path", MASKED_PATHS)
def test_host_kernel_details_are_masked(box, path):
    if not os.path.exists(path):
        pytest.skip(f"the host kernel has no {path}")
    r = py_json(box, MASKED_READ, path)
    assert r in ("absent", "bytes 0", "entries 0", "EACCES", "EPERM", "EIO", "EINVAL", "ENOENT"), f"{path} inside: {r}"


def test_proc_cmdline_is_not_the_hosts(box):
    host = Path("/proc/cmdline").read_text().strip()
    assert host, "the host has an empty kernel command line; nothing to compare"
    rc, inside, _ = run(box, "cat /proc/cmdline 2>/dev/null; true")
    assert inside.strip() != host, "the sandbox reads the host's kernel command line"


BOOT_ID = "/proc/sys/kernel/random/boot_id"

# Prints {probe: errno name, or "ok" if the call succeeded}.
BOOT_ID_PROBES = r"""
import ctypes, errno, json, os
libc = ctypes.CDLL(None, use_errno=True)
path = b"/proc/sys/kernel/random/boot_id"
def call(fn):
    ctypes.set_errno(0)
    rc = fn()
    return "ok" if rc == 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
def opened(flags):
    try:
        os.close(os.open(path, flags))
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
MS_BIND, MS_REMOUNT, MNT_DETACH = 4096, 32, 2
print(json.dumps({
    "open for writing": opened(os.O_WRONLY),
    "umount2": call(lambda: libc.umount2(path, 0)),
    "lazy umount2": call(lambda: libc.umount2(path, MNT_DETACH)),
    "remount writable": call(lambda: libc.mount(None, path, None, MS_BIND | MS_REMOUNT, None)),
    "bind over it": call(lambda: libc.mount(b"/etc/hostname", path, None, MS_BIND, None)),
}))
"""


def test_the_boot_id_is_the_sandboxes_and_stays_so(sandbox):
    host = Path(BOOT_ID).read_text().strip()
    _, before, _ = run(sandbox, f"cat {BOOT_ID}; cat /proc/self/mountinfo")
    own = before.splitlines()[0]
    assert own and own != host, f"the sandbox reads the host's boot id: {own!r}"
    bind = [l for l in before.splitlines() if f" {BOOT_ID} " in l]
    # One read-only bind of a file of its own filesystem: no host path, nothing else shows it.
    assert len(bind) == 1 and bind[0].split(" ")[3] == "/boot_id" and " ro," in bind[0], bind
    results = py_json(sandbox, BOOT_ID_PROBES)
    assert all(r != "ok" for r in results.values()), results
    for cmd in (
        f"echo 00000000-0000-4000-8000-000000000000 > {BOOT_ID}",
        f"umount {BOOT_ID}",
        f"umount -l {BOOT_ID}",
        f"mount -o remount,rw,bind {BOOT_ID}",
        f"unshare -m sh -c 'umount {BOOT_ID}; cat {BOOT_ID}'",
        f"sudo -u user sh -c 'echo x > {BOOT_ID}'",
    ):
        rc, out, err = run(sandbox, cmd)
        assert rc != 0 and host not in out, f"{cmd!r}: {rc} {out} {err}"
    _, after, _ = run(sandbox, f"cat {BOOT_ID}; cat /proc/self/mountinfo; ls -a /dev")
    assert after.startswith(before), "the boot id or the mount table changed"
    assert ".boot-id" not in after, "the boot id's staging mount point is left in /dev"


# --------------------------------------------------------------------------
# capabilities, signals, OOM score, core dumps
# --------------------------------------------------------------------------

CAPS = {
    "SYS_ADMIN": 21, "NET_ADMIN": 12, "SYS_PTRACE": 19, "SYS_MODULE": 16, "MKNOD": 27,
    "NET_RAW": 13, "AUDIT_WRITE": 29, "SYS_RAWIO": 17, "SYS_TIME": 25, "SYS_BOOT": 22,
}


@pytest.fixture(scope="module")
def cap_sets(box):
    def parse(text):
        return {l.split(":")[0]: int(l.split()[1], 16) for l in text.splitlines() if l.startswith("Cap")}

    _, direct, _ = run(box, "grep ^Cap /proc/self/status")
    _, via_sudo, _ = run(box, "sudo grep ^Cap /proc/self/status", user="user")
    return {"root": parse(direct), "sudo": parse(via_sudo)}


@pytest.mark.parametrize("cap", sorted(CAPS))
def test_root_lacks_capability(cap_sets, cap):
    bit = 1 << CAPS[cap]
    for who, sets in cap_sets.items():
        assert sets, f"no capability sets read for {who}"
        held = [s for s in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh") if sets.get(s, 0) & bit]
        assert not held, f"{who} inside holds CAP_{cap} in {held}: " + ", ".join(f"{k}={v:016x}" for k, v in sets.items())


KILL_PROBE = r"""
import errno, json, os, sys
res = {}
for arg in sys.argv[1:]:
    pid = int(arg)
    if os.path.exists(f'/proc/{pid}'):
        res[arg] = 'is a sandbox pid'
        continue
    out = []
    for sig in (0, 9):
        try:
            os.kill(pid, sig)
            out.append('DELIVERED')
        except OSError as e:
            out.append(errno.errorcode.get(e.errno, str(e.errno)))
    res[arg] = out
print(json.dumps(res))
"""


def test_signals_do_not_reach_the_host_or_neighbours(box, box2, sandbar):
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    neighbour, _, neighbour_pid = start_tagged_sleep(box2)
    try:
        targets = [sandbar.pid, os.getpid(), victim.pid, neighbour_pid]
        res = py_json(box, KILL_PROBE, *targets)
        for pid in targets:
            r = res[str(pid)]
            if r == "is a sandbox pid":
                continue  # the number happens to exist inside; it is not the host's process
            assert r == ["ESRCH", "ESRCH"], f"signals to host pid {pid} from the sandbox: {r}"
        # the agent's own process API cannot reach host PIDs either
        for pid in (sandbar.pid, victim.pid):
            try:
                killed = box.commands.kill(pid)
            except Exception:  # noqa: BLE001 - refusing is fine
                killed = False
            assert killed is False, f"commands.kill({pid}) reported success"
        time.sleep(0.5)
        assert victim.poll() is None, "a host process died"
        assert sandbar.proc.poll() is None, "the server died"
        assert os.path.exists(f"/proc/{neighbour_pid}"), "the neighbour sandbox's process died"
    finally:
        victim.kill()
        victim.wait(timeout=10)
        neighbour.kill()


OOM_PROBE = r"""
import errno, json
def read():
    return open('/proc/self/oom_score_adj').read().strip()
before = read()
res = {'before': before}
for v in ('-1000', '-1'):
    try:
        with open('/proc/self/oom_score_adj', 'w') as f:
            f.write(v)
        res[v] = 'WRITTEN'
    except OSError as e:
        res[v] = errno.errorcode.get(e.errno, str(e.errno))
res['after'] = read()
print(json.dumps(res))
"""


def test_oom_score_cannot_be_lowered(box):
    res = py_json(box, OOM_PROBE)
    # What a sandbox runs starts far above its agent and the host (the OOM killer's first
    # choice) and cannot go below 0, the agent's and the host services' score.
    assert res["before"] == "800", f"a sandbox process starts with oom_score_adj {res['before']}"
    assert res["-1000"] in ("EACCES", "EPERM") and res["-1"] in ("EACCES", "EPERM"), res
    assert res["after"] == "800", res
    # the same value seen from the host
    handle, _, pid = start_tagged_sleep(box)
    try:
        assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "800"
    finally:
        handle.kill()


CORE_PROBE = r"""
import json, resource
soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
try:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    raised = 'RAISED'
except (ValueError, OSError) as e:
    raised = str(e)
print(json.dumps({'soft': soft, 'hard': hard, 'raise': raised}))
"""


def test_core_dumps_limited(box):
    rc, out, err = run(box, "prlimit --core --output HARD --noheadings")
    assert rc == 0, err
    hard = out.strip()
    assert hard != "unlimited" and int(hard) <= 1, f"core hard limit inside is {hard!r}"
    res = py_json(box, CORE_PROBE)
    assert 0 <= res["hard"] <= 1 and res["raise"] != "RAISED", res


# --------------------------------------------------------------------------
# other sandboxes and the host's ports
# --------------------------------------------------------------------------


def tcp_probe_cmd(host, port, timeout=3):
    return "python3 -c " + shlex.quote(
        "import socket\n"
        f"s=socket.socket(); s.settimeout({timeout})\n"
        "try:\n"
        f"    s.connect(({host!r}, {int(port)})); print('CONNECTED')\n"
        "except Exception as e:\n"
        "    print('FAILED', type(e).__name__, e)\n"
    )


def test_neighbour_files_are_unreachable(box, box2):
    name = "escape-marker-" + secrets.token_hex(6)
    box.files.write(f"/home/user/{name}", "a")
    run(box, f"cp /home/user/{name} /tmp/{name} && cp /home/user/{name} /root/{name}")
    try:
        search = f"find / -xdev -name {name} 2>/dev/null; find /proc/[0-9]*/root/ -maxdepth 3 -name {name} 2>/dev/null; true"
        _, in_a, _ = run(box, search, timeout=120)
        assert f"/home/user/{name}" in in_a, f"positive control: A cannot find its own marker: {in_a}"
        _, in_b, _ = run(box2, search, timeout=120)
        assert in_b.strip() == "", f"B finds A's marker: {in_b}"
    finally:
        run(box, f"rm -f /home/user/{name} /tmp/{name} /root/{name}")


def test_neighbour_processes_are_invisible(box, box2):
    handle, argv, _ = start_tagged_sleep(box)
    try:
        _, in_a, _ = run(box, "ps -eo args=")
        assert " ".join(argv) in in_a, in_a
        _, in_b, _ = run(box2, "ps -eo args=")
        assert argv[1] not in in_b, f"B lists A's process: {in_b}"
    finally:
        handle.kill()


def test_neighbour_ports_are_unreachable(box, box2):
    port = random.randint(20000, 30000)
    _, addrs, _ = run(box, "hostname -I")
    a_ips = [a for a in addrs.split() if ":" not in a]
    assert a_ips, f"hostname -I in A: {addrs!r}"
    server = box.commands.run(f"exec python3 -m http.server {port} --bind 0.0.0.0", background=True, user="root")
    try:
        wait_until(
            lambda: "CONNECTED" in run(box, tcp_probe_cmd(a_ips[0], port))[1],
            timeout=20,
            interval=0.5,
            message="A's listener on its own address",
        )
        for ip in a_ips:
            out = run(box2, tcp_probe_cmd(ip, port))[1]
            assert out.startswith("FAILED"), f"B connected to A at {ip}:{port}"
    finally:
        server.kill()


DEFAULT_GW = r"""
import json, socket, struct
gw = None
for line in open('/proc/net/route').read().splitlines()[1:]:
    f = line.split()
    if f[1] == '00000000' and int(f[3], 16) & 2:
        gw = socket.inet_ntoa(struct.pack('<L', int(f[2], 16)))
        break
print(json.dumps(gw))
"""


def test_host_ports_are_unreachable(box):
    gw = py_json(box, DEFAULT_GW)
    assert gw, "the sandbox has no default gateway"
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        # positive control: the listener answers on the gateway address from the host
        with socket.create_connection((gw, port), timeout=5):
            pass
        for target in (gw, "127.0.0.1"):
            out = run(box, tcp_probe_cmd(target, port))[1]
            assert out.startswith("FAILED"), f"the sandbox reached a host listener at {target}:{port}: {out}"


# --------------------------------------------------------------------------
# kernel limits that are shared between users
# --------------------------------------------------------------------------

HOLDER = r"""
import ctypes, errno, json, os, resource, sys, time
kind, limit, status = sys.argv[1], int(sys.argv[2]), sys.argv[3]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard != resource.RLIM_INFINITY:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    limit = min(limit, hard - 50)
libc = ctypes.CDLL(None, use_errno=True)
held, err = [], None
for _ in range(limit):
    if kind == 'inotify':
        fd = libc.inotify_init1(0)
        if fd < 0:
            e = ctypes.get_errno()
            err = errno.errorcode.get(e, str(e))
            break
    else:
        try:
            fd = os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY)
        except OSError as e:
            err = errno.errorcode.get(e.errno, str(e.errno))
            break
    held.append(fd)
with open(status + '.tmp', 'w') as f:
    json.dump({'count': len(held), 'errno': err, 'nofile': hard}, f)
os.rename(status + '.tmp', status)
deadline = time.monotonic() + 60
while os.path.exists(status) and time.monotonic() < deadline:
    time.sleep(0.1)
"""


class Holder:
    """A process in a sandbox that takes up to `limit` kernel objects and keeps them until released."""

    def __init__(self, sbx, kind, limit):
        self.sbx = sbx
        self.status = f"/tmp/holder-{secrets.token_hex(5)}"
        self.handle = sbx.commands.run(py_cmd(HOLDER, kind, limit, self.status), background=True, user="root")

    def wait(self):
        def ready():
            return json.loads(self.sbx.files.read(self.status))

        return wait_until(ready, timeout=60, interval=0.3, message="the holder to report")

    def release(self):
        try:
            self.sbx.files.remove(self.status)
        except Exception:  # noqa: BLE001
            pass
        try:
            self.handle.kill()
        except Exception:  # noqa: BLE001
            pass


def host_inotify_init():
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    if fd < 0:
        return errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    os.close(fd)
    return "OK"


def test_inotify_instances_are_not_the_hosts(box):
    holder = Holder(box, "inotify", 200)
    try:
        got = holder.wait()
        host = host_inotify_init()
    finally:
        holder.release()
    assert got["count"] > 0, f"the sandbox could not open a single inotify instance: {got}"
    assert host == "OK", f"with the sandbox holding {got['count']} inotify instances ({got['errno']}), host root's inotify_init1 fails: {host}"


def test_pty_pool_is_not_exhausted_by_one_sandbox(sandbox, box2):
    pty_max = int(Path("/proc/sys/kernel/pty/max").read_text())
    reserve = int(Path("/proc/sys/kernel/pty/reserve").read_text()) if Path("/proc/sys/kernel/pty/reserve").exists() else 0
    holder = Holder(sandbox, "pty", 2000)
    try:
        got = holder.wait()
        nr = int(Path("/proc/sys/kernel/pty/nr").read_text())
        rc, out, err = run(box2, "python3 -c 'import os; m, s = os.openpty(); print(os.ttyname(s))'")
        host_master, host_slave = os.openpty()
        os.close(host_master)
        os.close(host_slave)
    finally:
        holder.release()
    assert got["errno"] is not None, f"one sandbox opened {got['count']} ptys without an error (host pty nr {nr} of {pty_max})"
    assert got["errno"] != "EMFILE", f"the descriptor limit stopped the probe first, not a pty cap: {got}"
    assert got["count"] <= (pty_max - reserve) // 2, f"one sandbox took {got['count']} ptys of the shared {pty_max - reserve}"
    assert rc == 0 and out.startswith("/dev/pts/"), f"a neighbour could not open a pty meanwhile: {out} {err}"


# --------------------------------------------------------------------------
# disks and deep trees
# --------------------------------------------------------------------------

SMALL_DISK_MB = 256
MiB = 1024 * 1024


def test_disk_fill_is_contained(sandbar, track_sandbox_id):
    sbx, limit_mb = create_raw(sandbar, track_sandbox_id, disk_mb=SMALL_DISK_MB)
    free_before, _ = host_statvfs(DATA_DIR)
    count = int(limit_mb * 1.25) + 64  # bounded: stops even without any limit
    rc, out, err = run(
        sbx,
        f"dd if=/dev/zero of=/home/user/fill bs=1M count={count} 2>&1; echo rc=$?; stat -c %s /home/user/fill",
        timeout=300,
    )
    free_during, _ = host_statvfs(DATA_DIR)
    size = int(out.strip().splitlines()[-1])
    assert "No space left on device" in out or "Disk quota exceeded" in out, (
        f"dd of {count} MiB into a {limit_mb} MiB disk did not hit a limit; wrote {size // MiB} MiB:\n{out[-500:]}"
    )
    assert limit_mb * MiB // 2 <= size <= (limit_mb + 16) * MiB, f"the fill stopped at {size // MiB} MiB, limit {limit_mb} MiB"
    assert run(sbx, "echo ok")[1] == "ok\n", "the agent stopped answering on a full disk"
    dropped = free_before - free_during
    assert dropped <= (limit_mb + 256) * MiB, f"the host's data disk lost {dropped // MiB} MiB for a {limit_mb} MiB sandbox"
    run(sbx, "rm -f /home/user/fill")


def test_df_inside_shows_the_disk_pool_not_the_host_disk(sandbar, track_sandbox_id):
    # btrfs reports the pool through statfs, not a subvolume's quota, so `df` shows the pool;
    # the quota itself is what the fill probes below enforce. The host's own disk stays hidden.
    sbx, _limit_mb = create_raw(sandbar, track_sandbox_id, disk_mb=SMALL_DISK_MB)
    rc, out, err = run(sbx, "df -B1 --output=size /home | tail -1")
    assert rc == 0, err
    inside = int(out.split()[0])
    host = os.statvfs(str(sandbar.data_dir))
    assert inside != host.f_blocks * host.f_frsize, "df inside a sandbox shows the host's disk"
    pool = os.statvfs(str(sandbar.data_dir / "sandboxes"))
    assert abs(inside - pool.f_blocks * pool.f_frsize) <= pool.f_blocks * pool.f_frsize // 100


INODE_FILL = r"""
import errno, json, os, sys, time
limit_mb, bound = int(sys.argv[1]), int(sys.argv[2])
# Take all but a little of the disk's bytes first, so the quota is reached by inodes alone.
spare = None
for headroom in (8, 16, 32, 64, 128, 256):
    if headroom >= limit_mb:
        break
    try:
        with open('/home/user/ballast', 'wb') as f:
            os.posix_fallocate(f.fileno(), 0, (limit_mb - headroom) << 20)
        spare = headroom
        break
    except OSError:
        os.unlink('/home/user/ballast')
os.makedirs('/home/user/many', exist_ok=True)
os.chdir('/home/user/many')
made, err = 0, None
deadline = time.monotonic() + 90
while made < bound and time.monotonic() < deadline:
    try:
        os.close(os.open('f%d' % made, os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
        break
    made += 1
print(json.dumps({'spare_mb': spare, 'made': made, 'errno': err}))
"""


def test_inode_exhaustion_is_contained(sandbar, track_sandbox_id):
    sbx, limit_mb = create_raw(sandbar, track_sandbox_id, disk_mb=SMALL_DISK_MB)
    _, inodes_before = host_statvfs(DATA_DIR)
    bound = 200_000
    res = py_json(sbx, INODE_FILL, limit_mb, bound, timeout=150)
    _, inodes_during = host_statvfs(DATA_DIR)
    assert res["spare_mb"] is not None, f"could not pre-fill the disk: {res}"
    assert res["errno"] in ("ENOSPC", "EDQUOT"), (
        f"{res['made']} empty files with {res['spare_mb']} MiB of a {limit_mb} MiB disk left and no limit hit: {res}"
    )
    assert run(sbx, "echo ok")[1] == "ok\n", "the agent stopped answering with no inodes left"
    used_on_host = inodes_before - inodes_during
    assert used_on_host < max(10_000, res["made"] // 2), f"the host's data disk lost {used_on_host} inodes"


def cpu_cgroup(sid):
    """(quota in CPUs or None, a function returning CPU seconds used) of a sandbox's cgroups."""
    quota, usage, procs = None, None, None
    for d in map(Path, sandbox_cgroup_dirs(sid)):
        if (d / "cpu.cfs_quota_us").exists():
            q, per = int((d / "cpu.cfs_quota_us").read_text()), int((d / "cpu.cfs_period_us").read_text())
            quota = q / per if q > 0 else None
        if (d / "cpu.max").exists():
            q, per = (d / "cpu.max").read_text().split()
            quota = None if q == "max" else int(q) / int(per)
        if (d / "cpuacct.usage").exists():
            usage = lambda f=d / "cpuacct.usage": int(f.read_text()) / 1e9  # noqa: E731
        elif (d / "cpu.stat").exists() and "usage_usec" in (d / "cpu.stat").read_text():
            usage = lambda f=d / "cpu.stat": int(re.search(r"usage_usec (\d+)", f.read_text()).group(1)) / 1e6  # noqa: E731
        if (d / "cgroup.procs").exists():
            procs = d / "cgroup.procs"
    if usage is None and procs is not None:
        # No CPU accounting controller: add up the times of the cgroup's live processes.
        tick = os.sysconf("SC_CLK_TCK")

        def usage():
            total = 0
            for pid in procs.read_text().split():
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    total += int(fields[11]) + int(fields[12])
                except (OSError, IndexError, ValueError):
                    pass
            return total / tick

    return quota, usage


CPU_HOG = r"""
import os, sys, time
n, seconds = int(sys.argv[1]), float(sys.argv[2])
for _ in range(n):
    if os.fork() == 0:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        os._exit(0)
for _ in range(n):
    os.wait()
"""


def test_cpu_hog_is_held_to_its_quota(sandbar, make_sandbox):
    sbx = make_sandbox(timeout=120)
    with sandbar.client() as c:
        cpus = int(c.get(f"/sandboxes/{sbx.sandbox_id}").json()["cpuCount"])
    quota, usage = cpu_cgroup(sbx.sandbox_id)
    assert usage is not None, f"no CPU accounting for {sbx.sandbox_id}"
    assert quota is not None and abs(quota - cpus) < 0.01, f"CPU quota {quota} for a sandbox of {cpus} CPUs"
    hog = sbx.commands.run(py_cmd(CPU_HOG, 2 * cpus + 1, 4), background=True, user="root")
    try:
        time.sleep(0.8)
        u0, t0 = usage(), time.monotonic()
        time.sleep(2)
        u1, t1 = usage(), time.monotonic()
        start = time.monotonic()
        with sandbar.client() as c:
            health = c.get("/health").status_code
        health_s = time.monotonic() - start
    finally:
        hog.kill()
    rate = (u1 - u0) / (t1 - t0)
    assert rate > 0.5, f"the hog used only {rate:.2f} CPUs; the probe measured nothing"
    assert rate <= cpus * 1.1 + 0.05, f"a sandbox of {cpus} CPUs used {rate:.2f}"
    assert health in (200, 204) and health_s < 2, f"the server answered /health with {health} after {health_s:.2f}s"


DEEP_TREE = r"""
import json, os, sys
os.chdir('/home/user')
depth = 0
for _ in range(int(sys.argv[1])):
    os.mkdir('d')
    os.chdir('d')
    depth += 1
print(json.dumps({'depth': depth}))
"""

DEEP_TREE_BOUND = 70_000


def open_file_limit(pid):
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft = line.split()[3]
            return None if soft == "unlimited" else int(soft)
    return None


def test_a_tree_deeper_than_the_descriptor_limit_does_not_block_kill(sandbar, make_sandbox):
    # Deeper than the server may hold descriptors open, so that a removal holding one per
    # level fails; never below 5000.
    limit = open_file_limit(sandbar.pid)
    if limit is None or limit + 500 > DEEP_TREE_BOUND:
        pytest.skip(f"the server's open-file limit ({limit}) is above what this probe builds ({DEEP_TREE_BOUND})")
    depth = max(5000, limit + 500)
    sbx = make_sandbox(timeout=300)
    sid = sbx.sandbox_id
    host_dir = DATA_DIR / "sandboxes" / sid
    assert host_dir.exists(), f"the sandbox's directory is not at {host_dir}"
    assert py_json(sbx, DEEP_TREE, depth, timeout=180)["depth"] == depth
    assert sbx.kill() is True
    wait_until(lambda: sid not in sandbar.sandbox_ids(), timeout=20, message=f"{sid} to leave the list")
    wait_until(lambda: not os.path.lexists(host_dir), timeout=30, message=f"{host_dir} ({depth} levels deep) to be removed")
    wait_until(lambda: not sandbox_cgroup_dirs(sid), timeout=15, message=f"the cgroups of {sid} to be removed")


# --------------------------------------------------------------------------
# the data directory on the host
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "credentials.json", "sandbar.db", "run"])
def test_data_directory_is_private(sandbar, name):
    path = DATA_DIR / name if name else DATA_DIR
    if not path.exists():
        pytest.skip(f"{path} does not exist in this layout")
    mode = path.stat().st_mode & 0o777
    assert mode & 0o077 == 0, f"{path} has mode {mode:o}; others may enter or read it"
