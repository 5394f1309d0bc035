"""A cluster of Sandbar hosts on this one machine, for the cluster end-to-end tests.

Every host is a "machine" of its own:

- a network namespace `sbtest-cl-<name>` whose only link (`eth0`) is a veth pair into the
  bridge namespace `sbtest-cl-br`, where a Linux bridge joins all hosts on 10.231.0.0/24
  (the bridge itself is 10.231.0.1). No host has a default route.
- a mount namespace of its own (private propagation), held by a small holder process that
  lives as long as the machine: a restarted server re-enters the same namespace, so the
  mounts a node made (its disk pool, sandbox roots) are still there, as they would be on a
  real host whose server restarts. A tmpfs on `/run/sandbar` keeps the host lock per
  machine, another on `/run/sandbar-<hash>` the node's mount points. Nodes also get a fresh
  sysfs on `/sys` (their own interfaces) and a tmpfs on `/sys/fs/cgroup` with each cgroup
  hierarchy of the host bound from `/sys/fs/cgroup/<hierarchy>/sbtest-cl-<name>` (for cgroup
  v2, `/sys/fs/cgroup/sbtest-cl-<name>` over `/sys/fs/cgroup`), so each node's `sandbar`
  cgroups are its own; and the shared server's `base` root bound read-only into its data dir,
  so nothing is downloaded.

`ip netns exec` is not used to make these namespaces: it remounts `/sys` and so detaches
the cgroup mounts before anything could bind them. The holder is started with
`unshare --mount --propagation private nsenter --net=/run/netns/sbtest-cl-<name>` and
servers with `nsenter --target <holder> --net --mount`.

The test process reaches the hosts through one more veth pair, `sbtest-cl-h` on this
machine (10.231.1.2/30) to `up0` in the bridge namespace (10.231.1.1/30), which forwards
between its two links only: this machine routes 10.231.0.0/24 to it and the hosts route
10.231.1.0/30 back. Nothing else is routed anywhere: the bridge namespace has routes only to
those two networks, the hosts only to the bridge's /24 and that /30, and this machine sends
only 10.231.0.0/24 into the pair, so no packet of the cluster can reach the real network and
no traffic of this machine but the test's enters the cluster. The stock SDK in the pytest
process is then simply given `http://10.231.0.2:3000` as its API and sandbox URL.

PostgreSQL 15 runs as the `postgres` user in this machine's network namespace with no TCP
at all (`listen_addresses = ''`), on a Unix socket under the cluster's directory, which
every host sees (they share the filesystem); `pg_hba.conf` trusts that socket and nothing
else.

Everything made is removed by `Cluster.close()`, by an atexit hook, and by a watchdog
process that waits for the test process to end; `reap()` removes by name whatever an earlier
interrupted run left, and `leaks()` lists anything still there.

`python3 cluster.py --reap` removes what an interrupted run left; `--reap-after PID` is the
watchdog.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Set

from e2e_util import read_or_empty, readlink_or_empty, serving_pid, stop_server

PREFIX = "sbtest-cl-"
BRIDGE_NS = PREFIX + "br"
HOST_LINK = PREFIX + "h"
ROOT = Path(os.environ.get("SANDBAR_E2E_CLUSTER_DIR") or "/var/tmp/sandbar-e2e-cluster")
LOG_DIR = Path(os.environ.get("SANDBAR_E2E_LOG_DIR") or "/tmp/sandbar-e2e-logs")
PG_BIN = Path(os.environ.get("SANDBAR_PG_BIN") or "/usr/lib/postgresql/15/bin")
SHARED_DATA_DIR = Path(os.environ.get("SANDBAR_E2E_DATA_DIR") or "/var/tmp/sandbar-e2e")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# The default template's root (BASE_ROOT in e2e_util.py).
BASE_ROOT = "base-v2"
SHARED_BASE = SHARED_DATA_DIR / "templates" / BASE_ROOT

SUBNET = "10.231.0"
BRIDGE_ADDR = f"{SUBNET}.1"
UPLINK_NET = "10.231.1.0/30"
UPLINK_BRIDGE_ADDR = "10.231.1.1"
UPLINK_HOST_ADDR = "10.231.1.2"
PORT = 3000

# name -> (address, kind)
HOSTS: Dict[str, tuple] = {
    "api1": (f"{SUBNET}.2", "api"),
    "api2": (f"{SUBNET}.3", "api"),
    "n1": (f"{SUBNET}.11", "node"),
    "n2": (f"{SUBNET}.12", "node"),
}
# Per node: the first host uid of its sandboxes and its sandbox network. A node maps each of
# its network's slots (one /30 each) to 65,536 host ids from its base on: a /18 is 4,096
# slots, 2^28 ids, so the two nodes' ranges can never overlap (sandboxes on one kernel must
# never share host ids). Both lie below 2^30, where the single-host server's range (its
# default --id-base) begins: sandboxes the stopped shared server left running share none.
NODE_SETTINGS = {
    "n1": {"id_base": 1 << 29, "network": "10.214.0.0/18"},
    "n2": {"id_base": (1 << 29) + (1 << 28), "network": "10.215.0.0/18"},
}
# The layer store: a registry (distribution's `docker-registry`) in the bridge's namespace,
# on the bridge's address, where nodes publish and fetch template layers.
LAYER_REGISTRY_PORT = 5000
LAYER_STORE = f"http://{BRIDGE_ADDR}:{LAYER_REGISTRY_PORT}/sandbar/layers"
# Every node's serve flags besides its identity.
NODE_FLAGS = [
    "--without-desktop",
    "--warm-pool", "2",
    "--netns-pool", "1",
    "--disk-pool-gb", "2",
    "--base-disk-mb", "512",
    "--pause-grace-secs", "1",
    # Nothing a sandbox resolves may leave the node; nothing listens on the node's port 53.
    "--nameserver", "127.0.0.1",
    # The base root is borrowed; a build that still tried a mirror would find nothing here.
    "--debian-mirror", "http://127.0.0.1:9/debian",
    "--layer-store", LAYER_STORE,
    # What deleted snapshots leave in the layer store goes within seconds.
    "--layer-store-collect-secs", "1",
]
SECRET_HEADER = "X-Sandbar-Node-Secret"

# Fixed key registered on the first start against the database (TEST_API_KEY of e2e_util.py).
API_KEY = "e2b_" + "5a4db0e2e0" * 4
DOMAIN = "sandbar.localhost"


def sh(*args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout, **kw
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, args))}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def as_postgres(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    return sh("runuser", "-u", "postgres", "--", *args, check=check, timeout=timeout)


def _stop_with_parent() -> None:
    """In a server's child before exec: SIGTERM when the test process dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)


def _pids() -> List[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def mount_dir_of(data_dir: Path) -> Path:
    """The node's directory of sandbox mount points (`/run/sandbar-<hash>` of
    crates/node/src/runtime/mod.rs): the first 12 hex digits of the SHA-256 of the data dir."""
    return Path("/run/sandbar-" + hashlib.sha256(str(data_dir).encode()).hexdigest()[:12])


# --------------------------------------------------------------------------
# cgroups
# --------------------------------------------------------------------------


def cgroup_hierarchies() -> Optional[List[str]]:
    """The cgroup hierarchies mounted under /sys/fs/cgroup as paths relative to it: "" alone
    when /sys/fs/cgroup is the v2 unified hierarchy, else one entry per v1 (or hybrid v2)
    mount, such as "memory" or "cpu,cpuacct"."""
    found = []
    for line in read_or_empty("/proc/self/mountinfo").splitlines():
        fields = line.split()
        sep = fields.index("-")
        mountpoint, fstype = fields[4], fields[sep + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        if mountpoint == str(CGROUP_ROOT):
            return [""]
        if mountpoint.startswith(str(CGROUP_ROOT) + "/"):
            found.append(mountpoint[len(str(CGROUP_ROOT)) + 1 :])
    return sorted(set(found))


def cgroup_links() -> Dict[str, str]:
    """Symlinks in a v1 /sys/fs/cgroup (`cpu -> cpu,cpuacct`), to make again in a node."""
    links = {}
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return links
    for entry in CGROUP_ROOT.iterdir():
        if entry.is_symlink():
            links[entry.name] = os.readlink(entry)
    return links


def host_cgroup_dirs(name: str) -> List[Path]:
    return [CGROUP_ROOT / rel / (PREFIX + name) if rel else CGROUP_ROOT / (PREFIX + name)
            for rel in cgroup_hierarchies()]


def make_host_cgroups(name: str) -> None:
    for d in host_cgroup_dirs(name):
        d.mkdir(exist_ok=True)
        # A new cpuset starts with no CPUs and no memory nodes; give it its parent's.
        for f in ("cpuset.cpus", "cpuset.mems"):
            if (d / f).exists() and not read_or_empty(d / f).strip():
                (d / f).write_text(read_or_empty(d.parent / f).strip() or "\n")
    if cgroup_hierarchies() == [""]:
        # v2: the node enables memory, cpu and pids in its root, which needs them here.
        try:
            (CGROUP_ROOT / "cgroup.subtree_control").write_text("+memory +cpu +pids")
        except OSError:
            pass


def our_cgroup_dirs() -> List[Path]:
    """Every `sbtest-cl-*` cgroup directory and everything beneath, deepest first."""
    tops = []
    for rel in cgroup_hierarchies():
        base = CGROUP_ROOT / rel if rel else CGROUP_ROOT
        try:
            tops.extend(p for p in base.iterdir() if p.name.startswith(PREFIX) and p.is_dir())
        except OSError:
            pass
    out = []
    for top in tops:
        for dirpath, dirnames, _ in os.walk(top):
            out.append(Path(dirpath))
    return sorted(out, key=lambda p: len(p.parts), reverse=True)


def cgroup_pids(dirs: List[Path]) -> List[int]:
    pids = set()
    for d in dirs:
        for line in read_or_empty(d / "cgroup.procs").split():
            if line.isdigit():
                pids.add(int(line))
    return sorted(pids)


def thaw(dirs: List[Path]) -> None:
    """Thaws frozen cgroups: a frozen task does not die of SIGKILL until it runs again."""
    for d in dirs:
        for f, value in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
            if (d / f).exists():
                try:
                    (d / f).write_text(value)
                except OSError:
                    pass


# --------------------------------------------------------------------------
# namespaces and processes
# --------------------------------------------------------------------------


def our_netns() -> List[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    return [l.split()[0] for l in out.splitlines() if l.strip() and l.split()[0].startswith(PREFIX)]


def ns_inode(path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def pids_in_namespaces(net_inodes, mnt_inodes) -> List[int]:
    me = os.getpid()
    found = []
    for pid in _pids():
        if pid == me:
            continue
        net = readlink_or_empty(f"/proc/{pid}/ns/net")
        mnt = readlink_or_empty(f"/proc/{pid}/ns/mnt")
        if any(net == f"net:[{i}]" for i in net_inodes) or any(mnt == f"mnt:[{i}]" for i in mnt_inodes):
            found.append(pid)
    return found


def pids_of_binaries(paths: List[str]) -> List[int]:
    found = []
    for pid in _pids():
        exe = readlink_or_empty(f"/proc/{pid}/exe").replace(" (deleted)", "")
        if exe and any(exe == p or exe.startswith(p.rstrip("/") + "/") for p in paths):
            found.append(pid)
    return found


def describe(pid: int) -> str:
    cmd = read_or_empty(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
    return f"{pid}: {cmd[:160] or readlink_or_empty(f'/proc/{pid}/exe')}"


def kill_all(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# --------------------------------------------------------------------------
# removal of everything by name (also what an interrupted run left)
# --------------------------------------------------------------------------


def _cluster_processes(binaries_dir: Optional[str] = None) -> List[int]:
    net = [ns_inode(f"/run/netns/{n}") for n in our_netns()]
    net = [i for i in net if i]
    mnt = set()
    # Holders and servers are in our network namespaces; their mount namespaces hold the rest.
    for pid in pids_in_namespaces(net, []):
        m = readlink_or_empty(f"/proc/{pid}/ns/mnt")
        if m.startswith("mnt:["):
            mnt.add(int(m[5:-1]))
    own_mnt = readlink_or_empty("/proc/self/ns/mnt")
    mnt.discard(int(own_mnt[5:-1]) if own_mnt.startswith("mnt:[") else -1)
    pids = set(pids_in_namespaces(net, mnt))
    pids.update(cgroup_pids(our_cgroup_dirs()))
    binaries = [str(ROOT / "bin")] + ([binaries_dir] if binaries_dir else [])
    pids.update(pids_of_binaries(binaries))
    pids.discard(os.getpid())
    return sorted(pids)


def _postgres_pids() -> List[int]:
    pg = str(ROOT / "pg")
    return [p for p in _pids() if pg in read_or_empty(f"/proc/{p}/cmdline").replace("\0", " ")
            or readlink_or_empty(f"/proc/{p}/cwd").startswith(pg)]


def stop_postgres(immediate: bool = True) -> None:
    data = ROOT / "pg" / "data"
    if (data / "postmaster.pid").exists():
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(data), "stop", "-m", "immediate" if immediate else "fast",
                    "-t", "30", check=False, timeout=40)
    deadline = time.monotonic() + 10
    while _postgres_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    kill_all(_postgres_pids())


def unmount_in(holder: int, under: List[str]) -> None:
    """Unmounts, deepest first, every mount of the holder's mount namespace under `under`."""
    points = []
    for line in read_or_empty(f"/proc/{holder}/mountinfo").splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == u or mp.startswith(u.rstrip("/") + "/") for u in under):
            points.append(mp)
    for mp in sorted(set(points), key=lambda p: p.count("/"), reverse=True):
        if sh("nsenter", f"--target={holder}", "--mount", "--", "umount", mp, check=False).returncode != 0:
            sh("nsenter", f"--target={holder}", "--mount", "--", "umount", "-l", mp, check=False)


def loop_devices() -> List[str]:
    out = sh("losetup", "-l", "-n", "-O", "NAME,BACK-FILE", check=False).stdout
    return [l.split()[0] for l in out.splitlines() if str(ROOT) + "/" in l]


def reap(binaries_dir: Optional[str] = None, log=lambda m: None) -> None:
    """Removes every piece of a cluster (this run's or an earlier one's), by name.

    Order: thaw and kill every process of the cluster (servers, holders, sandboxes, their
    helpers), stop PostgreSQL, let the machines' mounts go with their namespaces (and detach
    any loop device still backed by a file under the cluster's directory), delete the
    namespaces and the uplink, remove the cgroups depth first, then the directories.
    """
    # Servers first, with SIGTERM they would stop cleanly, but sandboxes outlive a server by
    # design: here everything goes at once with SIGKILL.
    for _ in range(50):
        dirs = our_cgroup_dirs()
        thaw(dirs)
        pids = _cluster_processes(binaries_dir)
        if not pids:
            break
        log(f"killing {len(pids)} cluster processes")
        kill_all(pids)
        time.sleep(0.2)
    stop_postgres()
    deadline = time.monotonic() + 15
    while loop_devices() and time.monotonic() < deadline:
        time.sleep(0.3)
    for dev in loop_devices():
        log(f"detaching {dev}")
        sh("losetup", "-d", dev, check=False)
    for name in our_netns():
        if name != BRIDGE_NS:
            sh("ip", "netns", "del", name, check=False)
    if BRIDGE_NS in our_netns():
        sh("ip", "netns", "del", BRIDGE_NS, check=False)
    if Path(f"/sys/class/net/{HOST_LINK}").exists():
        sh("ip", "link", "del", HOST_LINK, check=False)
    deadline = time.monotonic() + 15
    while True:
        left = []
        for d in our_cgroup_dirs():
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(d)
        if not left or time.monotonic() > deadline:
            break
        thaw(left)
        kill_all(cgroup_pids(left))
        time.sleep(0.2)
    for name in HOSTS:
        d = mount_dir_of(ROOT / name)
        if d.is_dir():
            try:
                d.rmdir()
            except OSError as e:
                log(f"cannot remove {d}: {e}")
    # Only once nothing can have a mount under it (a mount of a live namespace would not be
    # seen from here, and rmtree never crosses into one).
    if ROOT.exists() and not any(str(ROOT) in m for m in all_mount_lines()):
        shutil.rmtree(ROOT, ignore_errors=True)


def all_mount_lines() -> List[str]:
    """The mount table lines, of every mount namespace on the machine, naming the cluster's
    directory."""
    seen, out = set(), []
    for pid in _pids():
        ns = readlink_or_empty(f"/proc/{pid}/ns/mnt")
        if not ns or ns in seen:
            continue
        seen.add(ns)
        out.extend(l for l in read_or_empty(f"/proc/{pid}/mountinfo").splitlines() if str(ROOT) in l)
    return out


def leaks(binaries_dir: Optional[str] = None) -> List[str]:
    """What is left of a cluster; empty when `reap` (or `Cluster.close`) removed everything."""
    problems = []
    ns = our_netns()
    if ns:
        problems.append(f"network namespaces left: {ns}")
    if Path(f"/sys/class/net/{HOST_LINK}").exists():
        problems.append(f"link {HOST_LINK} left")
    procs = _cluster_processes(binaries_dir)
    if procs:
        problems.append("processes left: " + "; ".join(describe(p) for p in procs[:20]))
    if _postgres_pids():
        problems.append("PostgreSQL still runs: " + "; ".join(describe(p) for p in _postgres_pids()[:5]))
    cg = our_cgroup_dirs()
    if cg:
        problems.append(f"cgroups left: {[str(c) for c in cg[:20]]}")
    mounts = all_mount_lines()
    if mounts:
        problems.append(f"mounts under {ROOT}: {mounts[:10]}")
    loops = loop_devices()
    if loops:
        problems.append(f"loop devices backed under {ROOT}: {loops}")
    runs = [str(mount_dir_of(ROOT / n)) for n in HOSTS if mount_dir_of(ROOT / n).exists()]
    if runs:
        problems.append(f"directories left: {runs}")
    if ROOT.exists():
        problems.append(f"{ROOT} left")
    return problems


def start_watchdog(binaries_dir: Optional[str]) -> subprocess.Popen:
    """A process of its own session that removes the cluster once this process is gone."""
    args = [sys.executable, str(Path(__file__).resolve()), "--reap-after", str(os.getpid())]
    if binaries_dir:
        args += ["--binaries", binaries_dir]
    return subprocess.Popen(
        args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, cwd="/",
    )


# --------------------------------------------------------------------------
# PostgreSQL
# --------------------------------------------------------------------------


class Postgres:
    """A throwaway PostgreSQL 15 cluster: no TCP, a Unix socket in ROOT/pg, trust on it only."""

    def __init__(self):
        self.dir = ROOT / "pg"
        self.data = self.dir / "data"

    def start(self) -> None:
        self.dir.mkdir(parents=True)
        shutil.chown(self.dir, "postgres", "postgres")
        as_postgres(str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                    "--no-sync", "-E", "UTF8", "--no-locale")
        (self.data / "pg_hba.conf").write_text("# The cluster's Unix socket only.\nlocal all all trust\n")
        options = f"-c listen_addresses='' -k {self.dir} -c fsync=off -c max_connections=300"
        as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.dir / "log"), "-w",
                    "-t", "60", "-o", options, "start", timeout=90)
        self.psql("CREATE DATABASE sandbar", db="postgres")

    @property
    def url(self) -> str:
        return f"postgres://postgres@localhost/sandbar?host={self.dir}"

    def psql(self, sql: str, db: str = "sandbar") -> str:
        return as_postgres(str(PG_BIN / "psql"), "-h", str(self.dir), "-U", "postgres", "-d", db, "-q",
                           "-tA", "-c", sql).stdout.strip()

    def stop(self) -> None:
        stop_postgres(immediate=False)


# --------------------------------------------------------------------------
# hosts
# --------------------------------------------------------------------------

HOLDER_SCRIPT = r"""
set -e
mount -t tmpfs -o mode=0755,size=64m sbtest-cl-run /run/sandbar
if [ -n "$MOUNT_DIR" ]; then mount -t tmpfs -o mode=0755 sbtest-cl-mnt "$MOUNT_DIR"; fi
if [ "$KIND" = node ]; then
  # Keep this host's cgroup directories aside, mount a sysfs of this network namespace,
  # then put them where the host's hierarchies were.
  stash=/run/sandbar/.cgroups
  for rel in $HIERARCHIES; do
    [ "$rel" = . ] && src=/sys/fs/cgroup/$CGNAME || src=/sys/fs/cgroup/$rel/$CGNAME
    mkdir -p "$stash/$rel"
    mount --bind "$src" "$stash/$rel"
  done
  mount -t sysfs sysfs /sys
  if [ "$HIERARCHIES" = . ]; then
    mount --move "$stash/." /sys/fs/cgroup
  else
    mount -t tmpfs -o mode=0755 cgroup /sys/fs/cgroup
    for rel in $HIERARCHIES; do
      mkdir -p "/sys/fs/cgroup/$rel"
      mount --move "$stash/$rel" "/sys/fs/cgroup/$rel"
    done
    for link in $CGLINKS; do ln -s "${link#*=}" "/sys/fs/cgroup/${link%%=*}"; done
  fi
  rm -rf "$stash"
  if [ -n "$BASE_SRC" ]; then
    mkdir -p "$BASE_DST"
    mount --bind "$BASE_SRC" "$BASE_DST"
    mount -o remount,bind,ro "$BASE_DST"
  fi
fi
echo ready
exec sleep infinity
"""


class Host:
    """One machine and the `sandbar serve` it runs (started and stopped at will)."""

    def __init__(self, cluster: "Cluster", name: str, address: str, kind: str):
        self.cluster = cluster
        self.name = name
        self.address = address
        self.kind = kind
        self.netns = PREFIX + name
        self.data_dir = ROOT / name
        self.url = f"http://{address}:{PORT}"
        self.log_path = cluster.log_dir / f"{name}.log"
        self.holder: Optional[subprocess.Popen] = None
        self.proc: Optional[subprocess.Popen] = None
        self.args: List[str] = []
        self.starts = 0
        self._log = None

    # ---- the machine ---------------------------------------------------------

    def make_machine(self) -> None:
        """The network namespace, its veth into the bridge, and the holder of its mounts."""
        ns, br = self.netns, BRIDGE_NS
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", br, "link", "add", f"v-{self.name}", "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "-n", br, "link", "set", f"v-{self.name}", "master", "br0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "addr", "add", f"{self.address}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "route", "add", UPLINK_NET, "via", BRIDGE_ADDR)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        Path("/run/sandbar").mkdir(exist_ok=True)
        env = dict(os.environ, KIND=self.kind, CGNAME=self.netns, MOUNT_DIR="", BASE_SRC="", HIERARCHIES="",
                   CGLINKS="")
        if self.kind == "node":
            make_host_cgroups(self.name)
            mount_dir = mount_dir_of(self.data_dir)
            mount_dir.mkdir(exist_ok=True)
            env["MOUNT_DIR"] = str(mount_dir)
            env["HIERARCHIES"] = " ".join(r or "." for r in cgroup_hierarchies())
            env["CGLINKS"] = " ".join(f"{k}={v}" for k, v in cgroup_links().items())
            if self.name not in self.cluster.without_base:
                env["BASE_SRC"] = str(SHARED_BASE)
                env["BASE_DST"] = str(self.data_dir / "templates" / BASE_ROOT)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "--",
             "nsenter", f"--net=/run/netns/{ns}", "--", "sh", "-c", HOLDER_SCRIPT],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
            start_new_session=True, cwd="/",
        )
        line = self.holder.stdout.readline().decode().strip()
        if line != "ready":
            err = self.holder.stderr.read().decode() if self.holder.poll() is not None else ""
            raise RuntimeError(f"machine {self.name} did not come up: {line!r} {err}")

    def run(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A command inside this machine (its network and mount namespaces)."""
        return sh("nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--", *args, check=check,
                  timeout=timeout)

    def close_machine(self) -> None:
        """Unmounts what the machine mounted and ends its holder (its processes must be gone)."""
        if self.holder is None:
            return
        if self.holder.poll() is None:
            unmount_in(self.holder.pid, [str(self.data_dir), str(mount_dir_of(self.data_dir)), "/run/sandbar"])
            self.holder.kill()
        self.holder.wait(timeout=10)
        self.holder = None

    # ---- the server ----------------------------------------------------------

    def serve_args(self, role: Optional[str]) -> List[str]:
        c = self.cluster
        args = ["--listen", f"{self.address}:{PORT}", "--data-dir", str(self.data_dir),
                "--database-url", c.pg.url]
        if role is not None:
            args = ["--role", role, *args, "--cluster-secret-file", str(c.secret_file)]
        if role == "node":
            args += ["--node-id", self.name, "--advertise-url", self.url]
        if self.kind == "node":
            s = NODE_SETTINGS[self.name]
            args += ["--id-base", str(s["id_base"]), "--network", s["network"], *NODE_FLAGS]
        else:
            # Templates made through an API host get this disk, as the nodes' do.
            args += ["--base-disk-mb", "512"]
        return args

    def start(self, role: Optional[str] = None, extra_args: Optional[List[str]] = None) -> None:
        """Starts `sandbar serve` in the machine: `role` None is the default (all in one)."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} already runs"
        if role is not None or extra_args is not None or not self.args:
            self.args = self.serve_args(role) + list(extra_args or [])
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab", buffering=0)
        self._log.write(f"\n===== {self.name} start #{self.starts + 1} at {time.ctime()} =====\n".encode())
        env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and not k.startswith("SANDBAR_")}
        env.update({"SANDBAR_API_KEY": API_KEY, "RUST_BACKTRACE": "1"})
        env.setdefault("RUST_LOG", "info")
        self.proc = subprocess.Popen(
            ["nsenter", f"--target={self.holder.pid}", "--net", "--mount", "--",
             str(self.cluster.binary), "serve", *self.args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True, cwd="/", preexec_fn=_stop_with_parent,
        )
        self.starts += 1

    def stop(self, kill9: bool = False, timeout: float = 30) -> None:
        if self.proc is None:
            return
        if not stop_server(self.proc, kill9, timeout):
            raise AssertionError(f"{self.name} did not exit within {timeout}s of SIGTERM\n" + self.log_tail())
        self.proc = None
        if self._log:
            self._log.close()
            self._log = None

    def kill9(self) -> None:
        self.stop(kill9=True)

    @property
    def pid(self) -> int:
        """The serving process (see `serving_pid`)."""
        assert self.proc is not None, f"{self.name} is not running"
        return serving_pid(self.proc)

    def restart(self, kill9: bool = False) -> None:
        self.stop(kill9=kill9)
        self.start()
        self.wait_healthy()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout: float = 60) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        last = None
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before answering /health\n"
                                   + self.log_tail())
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code in (200, 204):
                    return
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer GET /health within {timeout}s ({last})\n"
                                   + self.log_tail())
            time.sleep(0.2)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        tail = "\n".join(self.log_text().splitlines()[-lines:])
        return f"--- tail of {self.log_path} ---\n{tail}\n--- end of {self.name} log ---"

    # ---- clients -------------------------------------------------------------

    def sdk(self) -> dict:
        """Keyword arguments that point the E2B SDK at this host for both API and sandboxes."""
        return {"api_url": self.url, "sandbox_url": self.url, "api_key": API_KEY, "domain": DOMAIN}

    def client(self, **kw):
        import httpx

        headers = {"X-API-Key": API_KEY, **(kw.pop("headers", None) or {})}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 30), **kw)

    def wait_placement(self, nodes: Set[str], timeout: float = 30) -> None:
        """Creates (and kills) sandboxes through this API host until each of `nodes` took one:
        an API host learns of nodes from the database, so it places nothing on a node it has
        not seen yet."""
        seen: Set[str] = set()
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while not nodes <= seen:
                r = client.post("/sandboxes", json={"templateID": "base", "timeout": 30})
                if r.status_code == 201:
                    seen.add(r.json()["clientID"])
                    assert client.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
                else:
                    assert r.status_code == 503, f"create through {self.name}: {r.status_code} {r.text}"
                    time.sleep(0.3)
                assert time.monotonic() < deadline, f"{self.name} placed on {sorted(seen)} only within {timeout}s"


class Cluster:
    """The bridge, PostgreSQL, and the machines named in `names` (a subset of HOSTS)."""

    def __init__(self, binary: Path, names=tuple(HOSTS), log_tag: Optional[str] = None,
                 without_base: Set[str] = frozenset()):
        """`without_base`: nodes that do not borrow the default template's root, and so hold
        its layer only once they fetched it from the layer store."""
        self.source_binary = binary
        self.names = list(names)
        self.without_base = set(without_base)
        self.log_dir = LOG_DIR / f"cluster-{log_tag or time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.pg = Postgres()
        self.hosts: Dict[str, Host] = {}
        self.secret = os.urandom(24).hex()
        self.secret_file = ROOT / "cluster-secret"
        self.binary = ROOT / "bin" / binary.name
        self.watchdog: Optional[subprocess.Popen] = None
        self._closed = False

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def nodes(self) -> List[Host]:
        return [h for h in self.hosts.values() if h.kind == "node"]

    def open(self) -> "Cluster":
        """Makes everything; on any failure removes what was made and raises."""
        if os.geteuid() != 0:
            raise RuntimeError("the cluster harness needs root")
        for needed in (PG_BIN / "initdb", SHARED_BASE / "complete"):
            if not needed.exists():
                raise RuntimeError(f"missing {needed}")
        reap()
        left = leaks()
        if left:
            raise RuntimeError("could not remove an earlier cluster: " + "; ".join(left))
        atexit.register(self.close)
        self.watchdog = start_watchdog(None)
        try:
            ROOT.mkdir(parents=True)
            os.chmod(ROOT, 0o755)
            # A copy of its own: a rebuild while the tests run must not change the servers.
            (ROOT / "bin").mkdir()
            shutil.copy2(self.source_binary, self.binary)
            agent = self.source_binary.parent / "sandbar-agent"
            if agent.is_file():
                shutil.copy2(agent, ROOT / "bin" / "sandbar-agent")
            self.secret_file.write_text(self.secret + "\n")
            os.chmod(self.secret_file, 0o600)
            self.make_bridge()
            self.start_layer_registry()
            self.pg.start()
            for name in self.names:
                address, kind = HOSTS[name]
                host = Host(self, name, address, kind)
                self.hosts[name] = host
                host.make_machine()
        except BaseException:
            self.close()
            raise
        return self

    def make_bridge(self) -> None:
        br = BRIDGE_NS
        sh("ip", "netns", "add", br)
        sh("ip", "-n", br, "link", "set", "lo", "up")
        sh("ip", "-n", br, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", br, "addr", "add", f"{BRIDGE_ADDR}/24", "dev", "br0")
        sh("ip", "-n", br, "link", "set", "br0", "up")
        # The test's way in: a /30 on this machine's end and the bridge namespace's end only.
        sh("ip", "link", "add", HOST_LINK, "type", "veth", "peer", "name", "up0", "netns", br)
        sh("ip", "-n", br, "addr", "add", f"{UPLINK_BRIDGE_ADDR}/30", "dev", "up0")
        sh("ip", "-n", br, "link", "set", "up0", "up")
        sh("ip", "addr", "add", f"{UPLINK_HOST_ADDR}/30", "dev", HOST_LINK)
        sh("ip", "link", "set", HOST_LINK, "up")
        sh("ip", "route", "add", f"{SUBNET}.0/24", "via", UPLINK_BRIDGE_ADDR, "dev", HOST_LINK)
        sh("ip", "netns", "exec", br, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")

    def start_layer_registry(self) -> None:
        """The layer store's registry, in the bridge's namespace (reap kills it with the rest of
        what runs in the cluster's namespaces); its storage is under the cluster's directory."""
        import socket

        d = ROOT / "registry"
        d.mkdir()
        config = d / "config.yml"
        config.write_text(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\n"
            f"storage:\n  delete:\n    enabled: true\n  filesystem:\n    rootdirectory: {d / 'storage'}\n"
            f"http:\n  addr: {BRIDGE_ADDR}:{LAYER_REGISTRY_PORT}\n  secret: cluster-test-only\n"
        )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_dir / "layer-registry.log", "ab")
        subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{BRIDGE_NS}", "--", "docker-registry", "serve", str(config)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd="/",
        )
        log.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection((BRIDGE_ADDR, LAYER_REGISTRY_PORT), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the layer store's registry did not start")
                time.sleep(0.1)

    def close(self) -> None:
        """Stops every server and removes everything; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for host in self.hosts.values():
            try:
                host.stop(kill9=True)
            except Exception:  # noqa: BLE001 - removal goes on
                pass
        for host in self.hosts.values():
            # Sandboxes outlive their server: kill whatever the machine still runs before
            # its mounts go.
            if host.kind == "node":
                for _ in range(50):
                    dirs = [d for d in our_cgroup_dirs() if d.parent.name.startswith(host.netns) or host.netns in d.parts]
                    thaw(dirs)
                    pids = cgroup_pids(dirs)
                    if not pids:
                        break
                    kill_all(pids)
                    time.sleep(0.1)
            try:
                host.close_machine()
            except Exception:  # noqa: BLE001
                pass
        reap()
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait(timeout=10)
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001
            pass

    def log_tails(self, lines: int = 40) -> str:
        return "\n".join(h.log_tail(lines) for h in self.hosts.values())


def main(argv: List[str]) -> int:
    if argv[:1] == ["--reap-after"]:
        pid = int(argv[1])
        start = read_or_empty(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()[19:20]
        while True:
            now = read_or_empty(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()[19:20]
            if not now or now != start:
                break
            time.sleep(1)
        reap()
        return 0
    if argv[:1] == ["--reap"]:
        reap(log=print)
        left = leaks()
        for l in left:
            print("left:", l)
        return 1 if left else 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
