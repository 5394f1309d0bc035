"""Isolation of sandboxes from the host and from each other.

These tests run as root on the host. The only network peers they use are
loopback, the sandboxes themselves, and a network namespace that the test
creates (`sbtest-inet-*`), which stands in for "the internet".
"""

import errno
import json
import os
import secrets
import shlex
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, SandboxException

from e2e_util import (
    CREATED_IDS,
    DATA_DIR,
    ENVD_PORT,
    METRICS_HEADERS,
    REPO_ROOT,
    host_links,
    host_mounts_mentioning,
    sandbar_cli,
    sandbox_cgroup_dirs,
    sh,
    stand_in_web,
    wait_until,
)

EXCLUDES = r"\( -path /proc -o -path /sys -o -path /dev \) -prune -o"


def root(sbx, cmd, **kw):
    kw.setdefault("timeout", 120)
    return sbx.commands.run(cmd, user="root", **kw)


def run_rc(sbx, cmd, user=None, timeout=60):
    """Run a command and return (exit_code, stdout, stderr) without raising on non-zero exit."""
    try:
        r = sbx.commands.run(cmd, user=user, timeout=timeout)
        return r.exit_code, r.stdout, r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout, e.stderr


FIB_TRIE_IPS = r"""python3 - <<'PY'
import re
data = open('/proc/net/fib_trie').read()
ips = set(re.findall(r'\|-- (\d+\.\d+\.\d+\.\d+)\n\s+/32 host LOCAL', data))
print(' '.join(sorted(i for i in ips if not i.startswith('127.'))))
PY"""

DEFAULT_GW = r"""python3 - <<'PY'
import socket, struct
for line in open('/proc/net/route').read().splitlines()[1:]:
    f = line.split()
    if f[1] == '00000000' and int(f[3], 16) & 2:
        print(socket.inet_ntoa(struct.pack('<L', int(f[2], 16))))
        break
PY"""


def tcp_probe_cmd(host, port, timeout=5):
    return (
        "python3 -c "
        + shlex.quote(
            "import socket,sys\n"
            f"s=socket.socket(); s.settimeout({timeout})\n"
            "try:\n"
            f"    s.connect(({host!r}, {int(port)})); print('CONNECTED')\n"
            "except Exception as e:\n"
            "    print('FAILED', type(e).__name__, e)\n"
        )
    )


def tcp_probe_many_cmd(pairs, timeout=5):
    """Probes every (host, port) at once; prints `host:port CONNECTED|FAILED …` per pair."""
    return "python3 -c " + shlex.quote(
        "import socket, threading\n"
        f"pairs = {list(pairs)!r}\n"
        "out = {}\n"
        "def probe(h, p):\n"
        f"    s = socket.socket(); s.settimeout({timeout})\n"
        "    try:\n"
        "        s.connect((h, p)); out[(h, p)] = 'CONNECTED'\n"
        "    except Exception as e:\n"
        "        out[(h, p)] = 'FAILED ' + type(e).__name__\n"
        "threads = [threading.Thread(target=probe, args=pair) for pair in pairs]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "for h, p in pairs: print(f'{h}:{p} {out[(h, p)]}')\n"
    )


def http_get_cmd(url, timeout=5):
    return "python3 -c " + shlex.quote(
        f"import urllib.request;r=urllib.request.urlopen({url!r},timeout={timeout});print(r.status);print(r.read().decode())"
    )


# ---- processes ---------------------------------------------------------------


def test_host_processes_invisible(sandbox):
    out = root(sandbox, "ps -e -o pid=,comm=").stdout
    procs = {}
    for line in out.splitlines():
        pid, _, comm = line.strip().partition(" ")
        procs[int(pid)] = comm.strip()
    assert 1 in procs, out
    assert len(procs) < 25, f"the sandbox sees {len(procs)} processes:\n{out}"
    cmdline1 = root(sandbox, "tr '\\0' ' ' < /proc/1/cmdline").stdout
    assert "agent" in procs[1] or "agent" in cmdline1, f"pid 1 is {procs[1]!r} ({cmdline1!r})"

    args = root(sandbox, "ps -eo args=").stdout
    assert "pytest" not in args
    assert "serve --listen" not in args
    me = os.getpid()
    if me > 1000:
        rc, _, _ = run_rc(sandbox, f"test -e /proc/{me}", user="root")
        assert rc != 0, f"/proc/{me} (the test runner's pid) exists inside the sandbox"


def test_namespaces_differ_from_host(sandbox):
    for ns in ("pid", "net", "mnt", "uts", "ipc"):
        host = os.readlink(f"/proc/self/ns/{ns}")
        inside = root(sandbox, f"readlink /proc/self/ns/{ns}").stdout.strip()
        assert inside and inside != host, f"{ns} namespace is shared with the host ({inside})"


def test_hostname_differs(sandbox):
    inside = sandbox.commands.run("cat /proc/sys/kernel/hostname").stdout.strip()
    assert inside
    assert inside != socket.gethostname()


# ---- files -------------------------------------------------------------------


def test_host_files_invisible(sandbox):
    name = "sbx-e2e-host-marker-" + secrets.token_hex(8)
    token = secrets.token_hex(16)
    markers = [Path("/tmp") / name, Path("/root") / name]
    try:
        for m in markers:
            m.write_text(token)
        found = root(sandbox, f"find / {EXCLUDES} -name {name} -print 2>/dev/null; true").stdout
        assert found.strip() == "", f"host marker visible in the sandbox: {found}"
        via_proc = root(
            sandbox,
            f"ls -d /proc/*/root/tmp/{name} /proc/*/root/root/{name} /proc/*/cwd/{name} 2>/dev/null; true",
        ).stdout
        assert via_proc.strip() == "", f"host marker reachable through /proc: {via_proc}"
        rc, out, _ = run_rc(sandbox, f"cat /proc/1/root/tmp/{name} /tmp/{name} /root/{name}", user="root")
        assert rc != 0 and token not in out
        # the repository and the server's data dir are not visible either
        for p in (REPO_ROOT / "Cargo.toml", DATA_DIR / "credentials.json"):
            rc, _, _ = run_rc(sandbox, f"test -e {shlex.quote(str(p))}", user="root")
            assert rc != 0, f"{p} is visible inside the sandbox"
    finally:
        for m in markers:
            m.unlink(missing_ok=True)


def test_sandbox_files_not_visible_to_host_mounts(sandbox):
    sandbox.files.write("/home/user/host-mount-check.txt", "x")
    # The node's disk pool is the one mount it keeps on the host, while it runs; nothing of a
    # sandbox (its overlay, /proc, /dev, the id-mapped template) may appear there.
    pool = f"{DATA_DIR}/sandboxes btrfs "
    mounts = [m for m in host_mounts_mentioning(str(DATA_DIR)) if pool not in m]
    assert mounts == [], "sandbox mounts leak into the host mount table"
    assert not [m for m in host_mounts_mentioning(sandbox.sandbox_id)]


def test_no_block_devices(sandbox):
    out = root(sandbox, "find /dev -type b 2>/dev/null; true").stdout
    assert out.strip() == "", f"block devices visible in the sandbox: {out}"


def test_sandboxes_cannot_see_each_others_files(make_sandbox):
    a = make_sandbox()
    b = make_sandbox()
    name = "sbx-e2e-secret-" + secrets.token_hex(6)
    part1, part2 = secrets.token_hex(8), secrets.token_hex(8)
    token = part1 + part2
    a.files.write(f"/tmp/{name}", token)
    a.files.write(f"/home/user/{name}", token)
    root(a, f"cp /tmp/{name} /root/{name}")

    # The token is assembled inside the shell so that it never appears
    # literally in a command line or in a log of the command.
    search = (
        f"P1={part1}; P2={part2}; "
        f"find / {EXCLUDES} -name {name} -print 2>/dev/null; "
        'grep -rlsF -D skip "$P1$P2" /tmp /home /root /var /opt /srv /etc /run 2>/dev/null; true'
    )
    # positive control: A finds its own files
    found_in_a = root(a, search).stdout
    assert f"/tmp/{name}" in found_in_a and f"/home/user/{name}" in found_in_a, found_in_a
    # B finds nothing
    found_in_b = root(b, search).stdout
    assert found_in_b.strip() == "", f"B sees A's secret: {found_in_b}"
    rc, out, _ = run_rc(b, f"cat /tmp/{name}", user="root")
    assert rc != 0 and token not in out


def test_sandboxes_cannot_see_each_others_processes(make_sandbox):
    a = make_sandbox()
    b = make_sandbox()
    h = a.commands.run("sleep 1234567", background=True)
    try:
        wait_until(lambda: "sleep 1234567" in root(a, "ps -eo args=").stdout, timeout=10, message="sleep in A")
        assert "1234567" not in root(b, "ps -eo args=").stdout
        rc, _, _ = run_rc(b, "pkill -f 'sleep 1234567'", user="root")
        assert rc != 0, "B could signal a process of A"
        assert "sleep 1234567" in root(a, "ps -eo args=").stdout
    finally:
        h.kill()


# ---- resources ------------------------------------------------------------------


def test_memory_limit_oom_kills_only_the_hog(sandbox, sandbar):
    hog = "python3 -c " + shlex.quote(
        "import sys\nb = b'x' * (1024 * 1024 * 1024)\nprint('allocated', len(b))\nsys.stdout.flush()"
    )
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run(hog, timeout=120)
    e = ei.value
    assert "allocated" not in (e.stdout or "")
    assert e.exit_code != 0
    # killed by a signal (137 = 128 + SIGKILL, or a negative/-1 signal status)
    assert e.exit_code in (137, -9, -1, 9) or e.exit_code >= 128, f"unexpected exit code {e.exit_code}"
    # the sandbox and the host are fine
    assert sandbox.commands.run("echo ok", timeout=30).stdout == "ok\n"
    assert sandbox.is_running()
    r = httpx.get(sandbar.url + "/health", timeout=10)
    assert r.status_code in (200, 204)
    assert sandbar.proc is not None and sandbar.proc.poll() is None, "the server died"


FORK_LOOP = r"""python3 - <<'PY'
import os, signal, sys
pids = []
err = None
for i in range(3000):
    try:
        pid = os.fork()
    except OSError as e:
        err = e.errno
        break
    if pid == 0:
        try:
            os.execv('/bin/sleep', ['sleep', '60'])
        finally:
            os._exit(1)
    pids.append(pid)
print(len(pids), err, flush=True)
for p in pids:
    try:
        os.kill(p, signal.SIGKILL)
    except OSError:
        pass
for p in pids:
    try:
        os.waitpid(p, 0)
    except OSError:
        pass
PY"""


@pytest.mark.parametrize("user", ["user", "root"])
def test_process_count_is_capped(sandbox, sandbar, user):
    out = sandbox.commands.run(FORK_LOOP, user=user, timeout=120).stdout.split()
    count, err = int(out[0]), out[1]
    assert count < 3000, f"{count} processes could be forked as {user}: no pids cap"
    assert err == str(errno.EAGAIN), f"fork failed with errno {err}, expected EAGAIN from the pids cap"
    assert count >= 50, f"only {count} forks succeeded; the cap is unreasonably low"
    _assert_recovers(sandbox, sandbar, "the fork loop", command_timeout=20, timeout=60, interval=1)


def _assert_recovers(sandbox, sandbar, after: str, command_timeout: float, timeout: float, interval: float) -> None:
    """The sandbox answers a command again within `timeout`, and the server is healthy."""
    wait_until(
        lambda: sandbox.commands.run("echo ok", timeout=command_timeout).stdout == "ok\n",
        timeout=timeout,
        interval=interval,
        message=f"the sandbox to answer after {after}",
    )
    assert httpx.get(sandbar.url + "/health", timeout=10).status_code in (200, 204)


def _pids_max(sandbox_id):
    for d in map(Path, sandbox_cgroup_dirs(sandbox_id)):
        f = d / "pids.max"
        if f.exists():
            return f.read_text().strip()
    return None


def test_fork_bomb_is_contained(sandbox, sandbar):
    cap = _pids_max(sandbox.sandbox_id)
    # never run a real fork bomb without a cap in place
    assert cap is not None and cap.isdigit() and int(cap) <= 4096, f"no usable pids cap ({cap}); not running the bomb"
    start = time.monotonic()
    try:
        sandbox.commands.run(":(){ :|:& };:", timeout=10)
    except SandboxException:
        pass
    assert time.monotonic() - start < 60
    _assert_recovers(sandbox, sandbar, "the fork bomb", command_timeout=10, timeout=90, interval=2)
    assert sandbar.proc is not None and sandbar.proc.poll() is None


def test_cgroup_limits_on_host(sandbox):
    sid = sandbox.sandbox_id
    dirs = sandbox_cgroup_dirs(sid)
    assert dirs, f"no cgroup directory named {sid} under any sandbar cgroup parent"
    pids_max = None
    mem_max = None
    for d in map(Path, dirs):
        for f in ("pids.max",):
            if (d / f).exists():
                pids_max = (d / f).read_text().strip()
        for f in ("memory.limit_in_bytes", "memory.max"):
            if (d / f).exists():
                mem_max = (d / f).read_text().strip()
    assert pids_max is not None and pids_max != "max", f"pids.max = {pids_max}"
    assert 16 <= int(pids_max) <= 4096
    assert mem_max is not None and mem_max != "max", f"memory limit = {mem_max}"
    assert int(mem_max) <= 600 * 1024 * 1024, f"memory limit {mem_max} is above ~512 MiB"
    sandbox.kill()
    wait_until(lambda: not sandbox_cgroup_dirs(sid), timeout=15, message=f"cgroups of {sid} to be removed")


def _host_link_with_address(address: str):
    """The (index, name) of the host link holding `address`, or None."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields[3].split("/")[0] == address:
            return fields[0].rstrip(":"), fields[1].split("@")[0]
    return None


def _host_link_exists(index: str) -> bool:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return any(line.split(":", 1)[0] == index for line in out.splitlines())


def test_host_link_removed_on_kill(make_sandbox):
    sbx = make_sandbox()
    inside = sbx.commands.run("ip -o -4 addr show eth0").stdout.split()[3].split("/")[0]
    # The host end of a slot's /30 is the address just below the sandbox's.
    a, b, c, d = (int(x) for x in inside.split("."))
    gateway = f"{a}.{b}.{c}.{d - 1}"
    found = _host_link_with_address(gateway)
    assert found and found[1].startswith("sbx"), f"no host-side sbx* link holds {gateway}"
    index, link = found
    sbx.kill()
    # By index: the freed slot may be wired again at once for a namespace kept waiting, with a
    # new link of the same name and address.
    wait_until(lambda: not _host_link_exists(index), timeout=15, message=f"link {link} ({index}) to be removed")


def test_sandbox_root_cannot_reconfigure_its_network(sandbox):
    # The network namespace belongs to the host: even sandbox root holds no capability in it.
    for cmd in (
        "ip link set lo down",
        "ip addr add 10.9.9.9/32 dev eth0",
        "ip route del default",
        "ip link add dummy0 type dummy",
    ):
        r = sandbox.commands.run(f"{cmd} 2>&1; echo rc=$?", user="root")
        assert "rc=0" not in r.stdout, f"sandbox root could run '{cmd}': {r.stdout}"
    assert "UP" in sandbox.commands.run("ip -o link show eth0").stdout
    assert sandbox.commands.run("ip -4 route show default").stdout.startswith("default via")


def test_every_user_may_bind_low_ports_and_open_ping_sockets(sandbox):
    script = (
        "import socket\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "s.bind(('0.0.0.0', 80)); s.listen(); print('bound', s.getsockname()[1])\n"
        "p = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP); print('icmp ok')\n"
    )
    r = sandbox.commands.run(f"python3 -c {shlex.quote(script)}", user="user")
    assert r.stdout == "bound 80\nicmp ok\n", r.stdout


def test_no_zombies_left_by_killed_sandboxes(make_sandbox, sandbar):
    for _ in range(3):
        sbx = make_sandbox(timeout=60)
        sbx.commands.run("true")
        assert sbx.kill() is True
    server_pid = sandbar.pid

    def zombies():
        out = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] == "Z" and int(fields[1]) == server_pid:
                out.append(pid)
        return out

    wait_until(lambda: not zombies(), timeout=10, message="the server to reap its exited children")


# ---- privileges -------------------------------------------------------------------


def test_root_cannot_mount(sandbox):
    rc, out, err = run_rc(sandbox, "sudo mount -t tmpfs x /mnt")
    assert rc != 0, f"mount succeeded: {out} {err}"
    assert "tmpfs" not in root(sandbox, "awk '$2==\"/mnt\"' /proc/mounts").stdout


def test_root_cannot_change_network_devices(sandbox):
    has_ip = run_rc(sandbox, "command -v ip")[0] == 0
    if has_ip:
        rc, out, err = run_rc(sandbox, "sudo ip link add e2edummy0 type dummy")
        assert rc != 0, f"ip link add succeeded: {out} {err}"
    probe = "python3 -c " + shlex.quote(
        "import socket, fcntl, struct\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "mtu = struct.unpack('16si12x', fcntl.ioctl(s, 0x8921, struct.pack('16si12x', b'lo', 0)))[1]\n"
        "try:\n"
        "    fcntl.ioctl(s, 0x8922, struct.pack('16si12x', b'lo', mtu)); print('ALLOWED')\n"
        "except OSError as e:\n"
        "    print('DENIED', e.errno)\n"
    )
    out = sandbox.commands.run("sudo " + probe).stdout
    assert out.startswith("DENIED"), f"root in the sandbox has CAP_NET_ADMIN: {out}"


def test_proc_kcore_unreadable(sandbox):
    out = sandbox.commands.run("sudo head -c 64 /proc/kcore 2>/dev/null | wc -c").stdout.strip()
    assert out == "0", f"read {out} bytes of /proc/kcore"


def test_sys_is_read_only(sandbox):
    lines = [l.split() for l in root(sandbox, "cat /proc/mounts").stdout.splitlines()]
    sys_mounts = [l for l in lines if len(l) >= 4 and l[1] == "/sys"]
    if sys_mounts:
        opts = sys_mounts[-1][3].split(",")
        assert "ro" in opts, f"/sys is mounted {sys_mounts[-1][3]}"
    else:
        # no sysfs at all is fine too, as long as nothing is writable there
        rc, _, _ = run_rc(sandbox, "test -w /sys/kernel", user="root")
        assert rc != 0


# ---- network ------------------------------------------------------------------------


# Addresses the fake internet serves. The "public" one is a retired relay range that no real
# route needs here; the others stand for what sandboxes must not reach beyond the host: a
# private network, a shared-address-space (cloud metadata) address and Azure's wire server.
# Each is reached only through a /32 route into the test's own namespace, checked before use,
# so no packet to them ever leaves the machine.
FAKE_PUBLIC_IP = "192.88.99.10"
FAKE_PRIVATE_IPS = ("10.255.77.7", "100.100.100.200", "168.63.129.16")


@pytest.fixture(scope="module")
def fake_internet():
    """A network namespace with a web server on several addresses, reached through /32 routes."""
    served_all = (FAKE_PUBLIC_IP, *FAKE_PRIVATE_IPS)
    with stand_in_web("sbtest-inet-", "sbt", "10.254", served_all, "sbtest-www-", "internet-") as (ns, port, marker, log_path):
        url = f"http://{FAKE_PUBLIC_IP}:{port}/marker.txt"
        wait_until(
            lambda: httpx.get(url, timeout=2).text == marker,
            timeout=20,
            message="the web server in the test namespace",
        )
        yield {
            "ip": FAKE_PUBLIC_IP,
            "port": port,
            "url": url,
            "marker": marker,
            "log": log_path,
            "ns": ns,
            "private_ips": FAKE_PRIVATE_IPS,
        }


def test_egress_allowed_by_default(sandbox, fake_internet):
    r = sandbox.commands.run(http_get_cmd(fake_internet["url"]), timeout=30)
    lines = r.stdout.splitlines()
    assert lines[0] == "200"
    assert lines[1] == fake_internet["marker"]


def test_egress_allowed_explicitly(make_sandbox, fake_internet):
    sbx = make_sandbox(allow_internet_access=True)
    r = sbx.commands.run(http_get_cmd(fake_internet["url"]), timeout=30)
    assert r.stdout.splitlines()[0] == "200"


def test_egress_blocked_without_internet_access(make_sandbox, fake_internet, sandbar):
    sbx = make_sandbox(allow_internet_access=False)
    probe_path = "blocked-probe-" + secrets.token_hex(6)
    url = f"http://{fake_internet['ip']}:{fake_internet['port']}/{probe_path}"
    rc, out, err = run_rc(sbx, http_get_cmd(url), timeout=30)
    assert rc != 0, f"request from a sandbox without internet access succeeded: {out}"
    rc, out, _ = run_rc(sbx, tcp_probe_cmd(fake_internet["ip"], fake_internet["port"]), timeout=30)
    assert out.startswith("FAILED"), out
    time.sleep(0.5)
    assert probe_path not in fake_internet["log"].read_text(errors="replace")

    # loopback inside the sandbox still works
    h = sbx.commands.run("python3 -m http.server 8123 --bind 127.0.0.1", background=True)
    try:
        wait_until(
            lambda: run_rc(sbx, http_get_cmd("http://127.0.0.1:8123/"))[0] == 0,
            timeout=20,
            interval=0.5,
            message="loopback web server inside the sandbox",
        )
    finally:
        h.kill()
    # inbound traffic through the user-port proxy still reaches the sandbox
    h2 = sbx.commands.run("python3 -m http.server 8000 --bind 0.0.0.0", background=True)
    try:
        headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"}
        wait_until(
            lambda: httpx.get(sandbar.url + "/", headers=headers, timeout=5).status_code == 200,
            timeout=20,
            interval=0.5,
            message="the proxy to reach a server in a sandbox without internet access",
        )
    finally:
        h2.kill()


def test_private_destinations_refused_by_default(sandbox, fake_internet):
    # The host reaches each address, so a refusal is the firewall's doing.
    for ip in fake_internet["private_ips"]:
        url = f"http://{ip}:{fake_internet['port']}/marker.txt"
        assert httpx.get(url, timeout=5).text == fake_internet["marker"]
    for ip in fake_internet["private_ips"]:
        probe_path = "private-probe-" + secrets.token_hex(6)
        url = f"http://{ip}:{fake_internet['port']}/{probe_path}"
        # Refused packets are dropped: a short wait says as much as a long one.
        rc, out, _ = run_rc(sandbox, http_get_cmd(url, timeout=2), timeout=30)
        assert rc != 0, f"a sandbox reached the private address {ip}: {out}"
        time.sleep(0.3)
        assert probe_path not in fake_internet["log"].read_text(errors="replace")
    # The public address stays reachable from the same sandbox.
    r = sandbox.commands.run(http_get_cmd(fake_internet["url"]), timeout=30)
    assert r.stdout.splitlines()[0] == "200"


def test_dns_through_the_gateway_resolver(sandbox, fake_internet, fake_dns):
    name = f"www-{secrets.token_hex(4)}.sandbar-test"
    fake_dns.records[name] = fake_internet["ip"]
    resolv = sandbox.commands.run("cat /etc/resolv.conf").stdout
    gateway = sandbox.commands.run("ip -4 route show default").stdout.split()[2]
    assert f"nameserver {gateway}" in resolv
    py = f"import socket; print(socket.gethostbyname('{name}'))"
    r = sandbox.commands.run(f"python3 -c \"{py}\"", timeout=30)
    assert r.stdout.strip() == fake_internet["ip"]
    assert name in fake_dns.queries
    url = f"http://{name}:{fake_internet['port']}/marker.txt"
    r = sandbox.commands.run(http_get_cmd(url), timeout=30)
    assert r.stdout.splitlines()[1] == fake_internet["marker"]
    # Unknown names fail cleanly instead of hanging.
    rc, _, err = run_rc(sandbox, "python3 -c \"import socket; socket.gethostbyname('nope.sandbar-test')\"", timeout=30)
    assert rc != 0 and "gaierror" in err


def test_no_dns_without_internet_access(make_sandbox, fake_dns):
    sbx = make_sandbox(allow_internet_access=False)
    name = f"isolated-{secrets.token_hex(4)}.sandbar-test"
    fake_dns.records[name] = "192.88.99.10"
    # A query would leave at once; the resolver's own retries only add waiting.
    rc, _, _ = run_rc(sbx, f"timeout 3 getent hosts {name}", timeout=30)
    assert rc != 0
    assert name not in fake_dns.queries


def _sandbox_ips(sbx):
    return sbx.commands.run(FIB_TRIE_IPS).stdout.split()


def test_sandbox_cannot_reach_another_sandbox(make_sandbox):
    a = make_sandbox()
    b = make_sandbox()
    h = a.commands.run("python3 -m http.server 8000 --bind 0.0.0.0", background=True)
    try:
        ips = _sandbox_ips(a)
        assert ips, "could not find the sandbox's own address"
        a_ip = ips[0]
        # positive control: A reaches its own server on that address
        wait_until(
            lambda: run_rc(a, http_get_cmd(f"http://{a_ip}:8000/"))[0] == 0,
            timeout=20,
            interval=0.5,
            message="A's web server on its own address",
        )
        for ip in ips:
            out = b.commands.run(tcp_probe_cmd(ip, 8000), timeout=30).stdout
            assert out.startswith("FAILED"), f"B connected to A at {ip}:8000"
    finally:
        h.kill()


def test_sandbox_cannot_reach_host_server(sandbox, sandbar):
    targets = set()
    gw = sandbox.commands.run(DEFAULT_GW).stdout.strip()
    if gw:
        targets.add(gw)
    # host-side addresses of other sandbox links: a few, since the node keeps many (its
    # warm sandboxes and wired namespaces), all alike
    out = sh("ip", "-4", "-o", "addr", "show").stdout
    others = sorted(
        parts[3].split("/")[0]
        for parts in (line.split() for line in out.splitlines())
        if len(parts) >= 4 and parts[1].startswith("sbx")
    )
    targets.update(others[:3])
    assert targets, "found neither a default gateway in the sandbox nor a host address on an sbx* link"
    probes = [(t, port) for t in sorted(targets) for port in (sandbar.port, ENVD_PORT)]
    # a host service listening on that very address is not reachable either
    listeners = []
    try:
        for t in sorted(targets):
            listener = socket.socket()
            try:
                listener.bind((t, 0))
            except OSError:
                listener.close()
                continue  # not an address of this host
            listeners.append(listener)
            listener.listen(8)
            port = listener.getsockname()[1]
            with socket.create_connection((t, port), timeout=5):
                pass  # positive control from the host itself
            probes.append((t, port))
        # Dropped packets only end at the timeout: every probe at once.
        out = sandbox.commands.run(tcp_probe_many_cmd(probes), timeout=60).stdout
    finally:
        for listener in listeners:
            listener.close()
    results = dict(line.split(" ", 1) for line in out.splitlines())
    for t, port in probes:
        assert results[f"{t}:{port}"].startswith("FAILED"), f"the sandbox reached the host at {t}:{port}"


def test_sandbox_loopback_is_its_own(sandbox, sandbar):
    # 127.0.0.1 inside the sandbox is not the host's loopback, where the server listens
    res = sandbox.commands.run(tcp_probe_cmd("127.0.0.1", sandbar.port), timeout=30).stdout
    assert res.startswith("FAILED"), "the sandbox reached the server through 127.0.0.1"



def test_memory_admission_counts_limits_up_to_the_overcommit_ratio(sandbar):
    """Memory limits are ceilings, not reservations: sandboxes are admitted while the host has
    memory available and their limits stay within the overcommit ratio (50x) of its memory.
    A template with 8 GiB sandboxes reaches the ratio in about 140 creates."""
    from e2b import Template

    # A team of its own, whose sandbox count is not what stops the creates first.
    team = json.loads(sandbar_cli(sandbar, "team", "create", "e2e-admission-" + secrets.token_hex(4),
                                  "--max-sandboxes", "400", "--requests-per-minute", "0"))
    headers = {"X-API-Key": team["apiKey"]}
    name = "e2e-big-" + secrets.token_hex(4)
    built = Template.build(Template().from_template("base"), name, memory_mb=8192, cpu_count=1,
                           api_key=team["apiKey"])
    created = []
    refusal = None
    try:
        metrics = httpx.get(sandbar.url + "/metrics", headers=METRICS_HEADERS, timeout=30).text
        limit = int(next(l for l in metrics.splitlines() if l.startswith("sandbar_memory_promise_limit_bytes ")).split()[1])
        meminfo = Path("/proc/meminfo").read_text()
        total = int(next(l for l in meminfo.splitlines() if l.startswith("MemTotal:")).split()[1]) * 1024
        assert limit > 10 * total, "the limits may not add up past the host's memory"
        for _ in range(limit // (8192 << 20) + 2):
            r = httpx.post(sandbar.url + "/sandboxes", headers=headers,
                           json={"templateID": name, "timeout": 120}, timeout=60)
            if r.status_code == 201:
                sid = r.json()["sandboxID"]
                created.append(sid)
                CREATED_IDS.add(sid)
                continue
            refusal = r
            break
        assert refusal is not None, f"{len(created)} sandboxes of 8 GiB were admitted past the ratio"
        assert refusal.status_code == 503, refusal.text
        assert "memory" in refusal.json()["message"] and "50x" in refusal.json()["message"], refusal.text
        assert int(refusal.headers["retry-after"]) > 0
        assert len(created) * (8192 << 20) <= limit
        assert len(created) * (8192 << 20) > total, "admission still counted limits as reservations"
    finally:
        for sid in created:
            httpx.delete(f"{sandbar.url}/sandboxes/{sid}", headers=headers, timeout=60)
    # Capacity comes back as sandboxes end.
    r = httpx.post(sandbar.url + "/sandboxes", headers=headers, json={"templateID": name, "timeout": 60}, timeout=60)
    assert r.status_code == 201, r.text
    CREATED_IDS.add(r.json()["sandboxID"])
    httpx.delete(f"{sandbar.url}/sandboxes/{r.json()['sandboxID']}", headers=headers, timeout=60)
    httpx.delete(f"{sandbar.url}/templates/{built.template_id}", headers=headers, timeout=60)
