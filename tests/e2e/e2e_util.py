"""Shared pieces of the Sandbar end-to-end suite: the server wrapper and host probes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import secrets
import shutil
import re
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
SANDBAR_BIN = Path(os.environ.get("SANDBAR_BIN") or REPO_ROOT / "target" / "release" / "sandbar")
DATA_DIR = Path(os.environ.get("SANDBAR_E2E_DATA_DIR") or "/var/tmp/sandbar-e2e")
LOG_DIR = Path(os.environ.get("SANDBAR_E2E_LOG_DIR") or "/tmp/sandbar-e2e-logs")
TEMPLATE_WAIT_S = float(os.environ.get("SANDBAR_E2E_TEMPLATE_WAIT") or 900)
# The default template's root under <data dir>/templates: `base-v{BASE_RECIPE_VERSION}` of
# crates/node/src/build/templates.rs.
BASE_ROOT = "base-v2"
# The templates a server builds itself; a run's cleanup never deletes them.
BUILTIN_TEMPLATE_NAMES = {"base", "code-interpreter-v1", "desktop"}
# The default template the shared server builds, which a module's own server may borrow.
SHARED_BASE = DATA_DIR / "templates" / BASE_ROOT

# Fixed key registered on the first start of the data dir.
TEST_API_KEY = "e2b_" + "5a4db0e2e0" * 4
# Every server the suite starts serves /metrics to scrapes with this token (and to no one else).
METRICS_TOKEN = "e2e-metrics-" + uuid.uuid4().hex
METRICS_HEADERS = {"Authorization": f"Bearer {METRICS_TOKEN}"}
DEFAULT_DOMAIN = "sandbar.localhost"
ENVD_PORT = 49983
# Where the SDK sends its requests.
SDK_URL_VARS = ("E2B_API_URL", "E2B_SANDBOX_URL")

CGROUP_ROOT = Path("/sys/fs/cgroup")

# The shared server keeps unused build uploads this long and this many per team
# (`--upload-ttl-secs`, `--max-uploads-per-team`), so test_build_limits.py sees both within
# seconds; a build holds its uploads while it runs, so the other template tests are unaffected.
UPLOAD_TTL_S = 10
UPLOADS_PER_TEAM = 300
# The shared server's volume content API rate per team (`--volume-requests-per-minute`).
VOLUME_REQUESTS_PER_MINUTE = 1200
# Where the shared server rotates agent logs (8 MiB by default): small, so the rotation test
# fills three of them in seconds rather than minutes.
AGENT_LOG_ROTATE_MB = 1


# --------------------------------------------------------------------------
# small utilities
# --------------------------------------------------------------------------


def acquire_run_lock(data_dir: Path, wait_s: float = float(os.environ.get("SANDBAR_E2E_LOCK_WAIT") or 1800)):
    """Hold an exclusive lock for the data dir for the whole run; waits for another run to finish."""
    import fcntl

    # One lock per machine unless told otherwise: two servers would share network ranges and
    # nftables tables even with different data dirs.
    lock_path = Path(os.environ.get("SANDBAR_E2E_LOCK") or "/var/tmp/sandbar-e2e.e2e-lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(lock_path, "a+")
    deadline = time.monotonic() + wait_s
    announced = False
    while True:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return f
        except BlockingIOError:
            if not announced:
                print(f"[e2e] another run holds {lock_path}; waiting up to {wait_s:.0f}s", flush=True)
                announced = True
            if time.monotonic() > deadline:
                f.close()
                raise RuntimeError(f"another e2e run still holds {lock_path}")
            time.sleep(2)


def private_binaries(binary: Path, interpreter: bool = False) -> Tuple[Path, Optional[Path]]:
    """Copy the server and its `sandbar-agent` sibling to a private dir, and with
    `interpreter` its `sandbar-interpreter`: a server without one does not build the
    code interpreter template, which only the shared server's tests need.

    A rebuild of target/release while the tests run would otherwise give the
    server and the agent different versions halfway through.
    """
    import shutil
    import tempfile

    dest = Path(tempfile.mkdtemp(prefix="sandbar-e2e-bin-"))
    server = dest / binary.name
    shutil.copy2(binary, server)
    agent_src = binary.parent / "sandbar-agent"
    agent = None
    if agent_src.is_file():
        agent = dest / "sandbar-agent"
        shutil.copy2(agent_src, agent)
    # The code interpreter server the code-interpreter-v1 template is built with.
    interpreter_src = binary.parent / "sandbar-interpreter"
    if interpreter and interpreter_src.is_file():
        shutil.copy2(interpreter_src, dest / "sandbar-interpreter")
    return server, agent


def free_port() -> int:
    """A free TCP port on 127.0.0.1 below the kernel's range of ephemeral ports: a server
    restarted on it must find it free, and while it is down an outgoing connection of any
    process could otherwise be given that very port."""
    import random

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randint(15000, max(15001, low - 1))
        if port >= low:
            break
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, stdin=subprocess.DEVNULL)


@contextlib.contextmanager
def stand_in_internet(
    ns_prefix: str, link_prefix: str, subnet: str, served: Sequence[str], workdir_prefix: str
) -> Iterator[Tuple[str, int, str]]:
    """A network namespace `<ns_prefix><random>` that stands in for the internet: joined to the
    host by a veth pair on a free /30 of `<subnet>.x`, holding each of `served` on its loopback
    behind a /32 host route that is checked to lead there. Skips the test where any of `served`
    is already routed on this host. Yields (namespace, a free port, a fresh working directory);
    removes the routes, the namespace, the link and the directory after."""
    # The benchmarks import this module without pytest installed.
    import pytest

    routes = sh("ip", "-4", "route").stdout + sh("ip", "-4", "addr").stdout
    for address in served:
        if address in routes:
            pytest.skip(f"{address} is already routed on this host")
    for _ in range(50):
        r = random.randint(1, 254)
        if f"{subnet}.{r}." not in routes:
            break
    else:
        pytest.skip(f"no free {subnet}.x.0/30 subnet")
    suffix = secrets.token_hex(3)
    ns = f"{ns_prefix}{suffix}"
    host_if, ns_if = f"{link_prefix}h{suffix}", f"{link_prefix}n{suffix}"
    host_ip, ns_ip = f"{subnet}.{r}.1", f"{subnet}.{r}.2"
    port = random.randint(20000, 30000)
    workdir = tempfile.mkdtemp(prefix=workdir_prefix)
    routed = []
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        sh("ip", "link", "set", ns_if, "netns", ns)
        sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        sh("ip", "-n", ns, "link", "set", ns_if, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ns, "route", "add", "default", "via", host_ip)
        for address in served:
            sh("ip", "-n", ns, "addr", "add", f"{address}/32", "dev", "lo")
            sh("ip", "route", "add", f"{address}/32", "via", ns_ip, "dev", host_if)
            routed.append(address)
            got = sh("ip", "-4", "route", "get", address).stdout
            assert f"dev {host_if}" in got, f"{address} would not go to the test namespace: {got}"
        yield ns, port, workdir
    finally:
        for address in routed:
            sh("ip", "route", "del", f"{address}/32", check=False)
        sh("ip", "netns", "del", ns, check=False)
        sh("ip", "link", "del", host_if, check=False)
        subprocess.run(["rm", "-rf", workdir], check=False)


@contextlib.contextmanager
def stand_in_web(
    ns_prefix: str, link_prefix: str, subnet: str, served: Sequence[str], workdir_prefix: str, marker_prefix: str
) -> Iterator[Tuple[str, int, str, Path]]:
    """A [`stand_in_internet`] serving HTTP on every one of `served` from its working directory,
    whose `marker.txt` holds a random marker. Yields (namespace, port, marker, the server's access
    log)."""
    with stand_in_internet(ns_prefix, link_prefix, subnet, served, workdir_prefix) as (ns, port, webroot):
        marker = marker_prefix + secrets.token_hex(8)
        Path(webroot, "marker.txt").write_text(marker)
        log_path = Path(webroot) / "access.log"
        server = ["python3", "-m", "http.server", str(port), "--bind", "0.0.0.0", "--directory", webroot]
        with open(log_path, "wb") as log, running_in_namespace(ns, server, output=log):
            yield ns, port, marker, log_path


@contextlib.contextmanager
def running_in_namespace(ns: str, argv: Sequence[str], output=subprocess.DEVNULL) -> Iterator[subprocess.Popen]:
    """`argv` run inside the network namespace `ns`, its output and errors to `output`; killed
    after."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        stdout=output,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_until(
    predicate: Callable[[], object],
    timeout: float,
    interval: float = 0.25,
    message: str = "condition",
):
    """Poll `predicate` until it returns a truthy value; return that value.

    Exceptions raised by the predicate count as "not yet". On timeout an
    AssertionError names the condition and the last exception seen.
    """
    deadline = time.monotonic() + timeout
    last_exc: Optional[BaseException] = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last_exc = None
        except Exception as e:  # noqa: BLE001 - polled condition
            last_exc = e
        if time.monotonic() >= deadline:
            extra = f" (last error: {last_exc!r})" if last_exc else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {message}{extra}")
        time.sleep(interval)


def sandbar_cgroup_parents() -> List[Path]:
    """Directories under which Sandbar creates one cgroup per sandbox."""
    parents = []
    if CGROUP_ROOT.is_dir():
        for child in CGROUP_ROOT.iterdir():
            cand = child / "sandbar"
            if cand.is_dir():
                parents.append(cand)
        if (CGROUP_ROOT / "sandbar").is_dir():
            parents.append(CGROUP_ROOT / "sandbar")
    return parents


def rss_kib(pid: int) -> int:
    """The resident memory of process `pid`, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def sandbox_cgroup_dirs(sandbox_id: Optional[str] = None) -> Set[str]:
    """Existing per-sandbox cgroup directories (optionally only for one sandbox). Groups whose
    names begin with a dot are the server's own (memory groups kept for later sandboxes, the
    freezer group it holds frozen), no sandbox's: see `server_cgroup_dirs`."""
    found = set()
    for parent in sandbar_cgroup_parents():
        try:
            for child in parent.iterdir():
                if child.name.startswith("."):
                    continue
                if child.is_dir() and (sandbox_id is None or child.name == sandbox_id):
                    found.add(str(child))
        except FileNotFoundError:
            pass
    return found


def server_cgroup_dirs() -> Set[str]:
    """The server's own cgroup directories, which a clean stop removes."""
    found = set()
    for parent in sandbar_cgroup_parents():
        try:
            found.update(str(c) for c in parent.iterdir() if c.name.startswith(".") and c.is_dir())
        except FileNotFoundError:
            pass
    return found


def host_links(prefix: str = "sbx") -> Set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        m = re.match(r"^\d+:\s+([^:@\s]+)", line)
        if m and m.group(1).startswith(prefix):
            names.add(m.group(1))
    return names


def host_netns() -> Set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def readlink_or_empty(p: str) -> str:
    """The target of the link `p`; "" where it cannot be read (a process gone, say)."""
    try:
        return os.readlink(p)
    except OSError:
        return ""


def read_or_empty(p: str) -> str:
    """The text of the file `p`; "" where it cannot be read."""
    try:
        with open(p, "r", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def mounts_under(path: Path, mountinfo: str = "/proc/self/mountinfo") -> List[str]:
    """Mount points at or below `path`, deepest first, in the mount namespace `mountinfo`
    describes (this process's unless told)."""
    prefix = str(path)
    points = []
    for line in read_or_empty(mountinfo).splitlines():
        fields = line.split(" ")
        if len(fields) > 4:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def unmount_under(path: Path) -> List[str]:
    """Unmounts everything at or below `path`, deepest first (lazily where a plain unmount
    fails); returns the mount points still there."""
    for point in mounts_under(path):
        if sh("umount", point, check=False).returncode != 0:
            sh("umount", "-l", point, check=False)
    return mounts_under(path)


def module_server(data_dir: Path, log_name: str, nameserver: str, extra_args: Sequence[str]) -> SandbarServer:
    """A server of a module's own on `data_dir` and a free port, from private copies of the
    binaries (the caller removes `server.binary.parent`), resolving through `nameserver`, with
    `extra_args`. It keeps no namespaces or sandboxes booted ahead of demand, which would take
    the memory and disk of the ones under test, and does without CRIU."""
    binary, _ = private_binaries(SANDBAR_BIN)
    return SandbarServer(
        binary,
        data_dir,
        LOG_DIR / f"{log_name}.log",
        free_port(),
        extra_args=[*extra_args, "--nameserver", nameserver, "--netns-pool", "0", "--warm-pool", "0", "--criu", ""],
    )


def bind_shared_base(data_dir: Path) -> None:
    """Binds the default template the shared server built (SHARED_BASE) read-only into
    `data_dir`, for a server of a module's own to start on without building it again."""
    base = data_dir / "templates" / SHARED_BASE.name
    base.mkdir(parents=True)
    sh("mount", "--bind", "-o", "ro", str(SHARED_BASE), str(base))
    sh("mount", "-o", "remount,bind,ro", str(base))


def all_pids() -> Set[int]:
    return {int(d) for d in os.listdir("/proc") if d.isdigit()}


def sandbox_like_processes(data_dir: Path, baseline: Iterable[int], ours: Iterable[str]) -> Dict[int, dict]:
    """Processes that look like they belong to a sandbox and were not there when the run started.

    A process counts if its cgroup path is under a `sandbar/` cgroup, its root or
    cwd is inside the data dir, or it lives in another PID namespace than ours.
    `mine` tells whether it can be tied to this run (a cgroup named after one of
    `ours`, or a root/cwd inside the data dir).
    """
    baseline = set(baseline)
    ours = set(ours)
    own_pidns = readlink_or_empty("/proc/self/ns/pid")
    data = str(data_dir)
    found = {}
    for pid in all_pids():
        if pid in baseline or pid == os.getpid():
            continue
        cg = read_or_empty(f"/proc/{pid}/cgroup")
        root = readlink_or_empty(f"/proc/{pid}/root")
        cwd = readlink_or_empty(f"/proc/{pid}/cwd")
        pidns = readlink_or_empty(f"/proc/{pid}/ns/pid")
        if not (cg or root or pidns):
            continue  # already gone
        reasons = []
        mine = False
        for sid in sorted(set(re.findall(r":/sandbar/([^/\n]+)", cg))):
            reasons.append(f"cgroup sandbar/{sid}")
            mine = mine or sid in ours
        if root.startswith(data) or cwd.startswith(data):
            reasons.append("root/cwd in data dir")
            mine = True
        if pidns and own_pidns and pidns != own_pidns:
            reasons.append("other pid namespace")
        if reasons:
            cmd = read_or_empty(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
            found[pid] = {"desc": f"{cmd!r} ({', '.join(reasons)})", "mine": mine}
    return found


def other_sandbar_servers(exclude: Iterable[int] = ()) -> List[int]:
    """PIDs of `sandbar serve` processes other than ours (another server on this machine)."""
    exclude = set(exclude)
    pids = []
    for pid in all_pids():
        if pid in exclude:
            continue
        cmd = read_or_empty(f"/proc/{pid}/cmdline").split("\0")
        if len(cmd) >= 2 and os.path.basename(cmd[0]) == "sandbar" and "serve" in cmd[1:]:
            pids.append(pid)
    return pids


# IDs of every sandbox this run created or saw listed; used to tie leftovers to this run.
CREATED_IDS: Set[str] = set()


def record_sandbox_creation() -> Callable[[], None]:
    """Wrap Sandbox._create so that every sandbox made through the SDK lands in CREATED_IDS."""
    from e2b import Sandbox

    original = Sandbox.__dict__["_create"]

    def _create(cls, *args, **kwargs):
        sbx = original.__func__(cls, *args, **kwargs)
        CREATED_IDS.add(sbx.sandbox_id)
        return sbx

    Sandbox._create = classmethod(_create)

    def undo():
        Sandbox._create = original

    return undo


def kill_quietly(sandbox_id: str) -> None:
    """Kills a sandbox through the SDK in a teardown: a failure there must not mask the test's
    result."""
    from e2b import Sandbox

    try:
        Sandbox.kill(sandbox_id)
    except Exception:  # noqa: BLE001 - teardown must not mask the test result
        pass


@contextlib.contextmanager
def created_sandbox(sandbox_cls=None, **create_kwargs) -> Iterator:
    """A sandbox made with `sandbox_cls.create(**create_kwargs)` (the Python SDK's `Sandbox`
    unless another SDK's class is given), killed when the block ends."""
    if sandbox_cls is None:
        from e2b import Sandbox as sandbox_cls
    sandbox = sandbox_cls.create(**create_kwargs)
    try:
        yield sandbox
    finally:
        kill_quietly(sandbox.sandbox_id)


def host_mounts_mentioning(text: str) -> List[str]:
    return [line for line in read_or_empty("/proc/self/mounts").splitlines() if text in line]


# --------------------------------------------------------------------------
# the server under test
# --------------------------------------------------------------------------


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies."""
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def serving_pid(proc: subprocess.Popen) -> int:
    """The process that serves: a server started as a session leader (as these fixtures and
    systemd start it) forks at once and serves from its child, so that no terminal can become
    its controlling one; the process started stays, forwarding signals."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        return proc.pid
    return int(children[0]) if len(children) == 1 else proc.pid


def stop_server(proc: subprocess.Popen, kill9: bool, timeout: float) -> bool:
    """SIGTERM (or SIGKILL) to a server, waited for; False when it did not end in time. A kill
    -9 goes to the serving process itself, and the one started ends as it did once it has
    reaped it, so the server's lock and port are free when this returns."""
    if proc.poll() is not None:
        return True
    if kill9:
        os.kill(serving_pid(proc), signal.SIGKILL)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        return True
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
        return True
    except subprocess.TimeoutExpired:
        os.kill(serving_pid(proc), signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=10)
        return False


class SandbarServer:
    """One `sandbar serve` process on a fixed port and data dir; can be restarted."""

    def __init__(
        self,
        binary: Path,
        data_dir: Path,
        log_path: Path,
        port: int,
        extra_args: Optional[List[str]] = None,
        desktop: bool = False,
    ):
        self.binary = binary
        # Only the shared server's tests use the desktop template, whose root is the largest
        # to build; every other server goes without.
        self.extra_args = list(extra_args or []) + ([] if desktop else ["--without-desktop"])
        self.data_dir = data_dir
        self.log_path = log_path
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.domain = DEFAULT_DOMAIN
        # The HTTPS listener's port and the directory of its CA and certificate, where the
        # server has one (`--tls-listen`).
        self.tls_port: Optional[int] = None
        self.tls_dir: Optional[Path] = None
        self.proc: Optional[subprocess.Popen] = None
        self.api_key = TEST_API_KEY
        self.base_template: Optional[dict] = None
        self._log_file = None
        self.starts = 0
        # Added to the server's environment at each start (such as a crash point to arm).
        self.extra_env: Dict[str, str] = {}

    # ---- process control -------------------------------------------------

    @property
    def pid(self) -> int:
        """The serving process (see `serving_pid`)."""
        assert self.proc is not None, "the server is not running"
        return serving_pid(self.proc)

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(f"\n===== sandbar start #{self.starts + 1} at {time.ctime()} =====\n".encode())
        env = dict(os.environ)
        env.update(
            {
                "SANDBAR_API_KEY": TEST_API_KEY,
                "SANDBAR_LISTEN": f"127.0.0.1:{self.port}",
                "SANDBAR_DATA_DIR": str(self.data_dir),
                "SANDBAR_METRICS_TOKEN": METRICS_TOKEN,
                "RUST_BACKTRACE": "1",
            }
        )
        env.setdefault("RUST_LOG", "info")
        env.update(self.extra_env)
        # Never hand our E2B settings to the server.
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
            env.pop(k, None)
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                "serve",
                "--listen",
                f"127.0.0.1:{self.port}",
                "--data-dir",
                str(self.data_dir),
                *self.extra_args,
            ],
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            # A test run that is killed (a timeout, Ctrl-C twice) stops its server too, rather
            # than leave it serving the shared data dir beside the next run's.
            preexec_fn=_stop_with_parent,
        )
        self.starts += 1

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"sandbar exited with code {self.proc.returncode} before becoming healthy\n" + self.log_tail()
                )
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code in (200, 204):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"sandbar did not answer GET /health within {timeout}s\n" + self.log_tail())
            time.sleep(0.2)

    def load_api_key(self) -> None:
        creds = self.data_dir / "credentials.json"
        try:
            data = json.loads(creds.read_text())
            key = data.get("apiKey")
            if isinstance(key, str) and key:
                self.api_key = key
        except (OSError, ValueError):
            pass

    def wait_base_template(self, timeout: float = TEMPLATE_WAIT_S) -> dict:
        template = self.wait_template("base", timeout)
        self.base_template = template
        return template

    def wait_template(self, alias: str, timeout: float = TEMPLATE_WAIT_S) -> dict:
        """Waits until the template named `alias` (a built-in one, say) has finished building."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"sandbar exited with code {self.proc.returncode} while building the {alias} template\n"
                    + self.log_tail()
                )
            try:
                r = httpx.get(self.url + "/templates", headers={"X-API-Key": self.api_key}, timeout=10)
                last = f"{r.status_code} {r.text[:500]}"
                if r.status_code == 200:
                    for t in r.json():
                        names = list(t.get("aliases") or []) + list(t.get("names") or [])
                        if alias in names:
                            status = t.get("buildStatus")
                            if status == "ready":
                                return t
                            if status == "error":
                                raise RuntimeError(f"{alias} template build failed\n" + self.log_tail())
            except httpx.HTTPError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{alias} template not ready within {timeout}s (last GET /templates: {last})\n" + self.log_tail()
                )
            time.sleep(2)

    def delete_leftover_templates(self) -> int:
        """Deletes the templates and snapshots an earlier run on this data dir left, built-ins
        aside. The data dir outlives a run (it caches the built-in roots), and without this its
        team's templates and snapshots pile up across runs until they meet the team's caps."""
        deleted = 0
        with self.client(timeout=30) as api:
            ids = []
            for t in api.get("/templates").json():
                names = set(t.get("aliases") or []) | set(t.get("names") or [])
                if not names & BUILTIN_TEMPLATE_NAMES:
                    ids.append(t["templateID"])
            ids.extend(s["snapshotID"] for s in api.get("/snapshots", params={"limit": 100}).json())
            for template_id in ids:
                if api.delete(f"/templates/{template_id}").status_code in (200, 204):
                    deleted += 1
        return deleted

    def stop(self, kill9: bool = False, timeout: float = 30) -> None:
        if self.proc is None:
            return
        if not stop_server(self.proc, kill9, timeout) and not kill9:
            raise AssertionError(f"sandbar did not exit within {timeout}s of SIGTERM\n" + self.log_tail())
        self.proc = None
        if self._log_file:
            self._log_file.close()
            self._log_file = None

    def stop_in_teardown(self, problems: List[str]) -> None:
        """Stops the server with SIGTERM or, where that fails (noted in `problems`), SIGKILL."""
        try:
            self.stop(kill9=False)
        except Exception as e:  # noqa: BLE001 - teardown goes on
            problems.append(f"stopping sandbar: {e}")
            self.stop(kill9=True)

    def delete_sandboxes_in_teardown(self, problems: List[str]) -> None:
        """Deletes every running or paused sandbox through the API; a failure is noted in
        `problems`."""
        try:
            with self.client(timeout=30) as api:
                for s in api.get("/v2/sandboxes", params={"state": "running,paused"}).json():
                    api.delete(f"/sandboxes/{s['sandboxID']}")
        except Exception as e:  # noqa: BLE001 - teardown goes on
            problems.append(f"killing sandboxes: {e}")

    def restart(self, kill9: bool = False, downtime: float = 0.0) -> None:
        """Stop the server (SIGKILL or SIGTERM) and start it again on the same port and data dir."""
        self.stop(kill9=kill9)
        if downtime:
            time.sleep(downtime)
        deadline = time.monotonic() + 20
        while True:
            self.start()
            try:
                self.wait_healthy(timeout=60)
                break
            except RuntimeError:
                # The port may briefly still be held; retry a few times.
                if self.proc is not None and self.proc.poll() is not None and time.monotonic() < deadline:
                    self.stop()
                    time.sleep(0.5)
                    continue
                raise
        self.wait_base_template(timeout=120)

    # ---- logs --------------------------------------------------------------

    def log_tail(self, lines: int = 150) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 64 * 1024))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no server log)"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- tail of {self.log_path} ---\n{tail}\n--- end of server log ---"

    # ---- HTTP shortcuts ----------------------------------------------------

    def client(self, api_key: Optional[str] = "__default__", **kw) -> httpx.Client:
        headers = dict(kw.pop("headers", {}) or {})
        if api_key == "__default__":
            api_key = self.api_key
        if api_key is not None:
            headers["X-API-Key"] = api_key
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 60), **kw)

    def list_all_sandboxes(self) -> List[dict]:
        """Every sandbox the server lists (all states, all pages), via GET /v2/sandboxes."""
        items: List[dict] = []
        token = None
        with self.client() as c:
            for _ in range(100):
                params = {"limit": 100}
                if token:
                    params["nextToken"] = token
                r = c.get("/v2/sandboxes", params=params)
                assert r.status_code == 200, f"GET /v2/sandboxes -> {r.status_code} {r.text}"
                items.extend(r.json())
                CREATED_IDS.update(i["sandboxID"] for i in r.json())
                token = r.headers.get("x-next-token")
                if not token:
                    break
        return items

    def sandbox_ids(self) -> Set[str]:
        return {s["sandboxID"] for s in self.list_all_sandboxes()}


def sandbar_cli(server: SandbarServer, *args: str, timeout: float = 60) -> str:
    """Runs the operator CLI (`sandbar team …`) on the server's data dir; its stdout."""
    done = subprocess.run(
        [str(server.binary), *args, "--data-dir", str(server.data_dir)],
        capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, f"sandbar {' '.join(args)}: {done.stderr}"
    return done.stdout


def kill_all_listed(server: SandbarServer) -> List[str]:
    """Kill every sandbox the server lists, using the SDK (Sandbox.list over all pages)."""
    from e2b import Sandbox, SandboxQuery, SandboxState

    killed: List[str] = []
    for _ in range(3):
        ids = []
        paginator = Sandbox.list(
            query=SandboxQuery(state=[SandboxState.RUNNING, SandboxState.PAUSED]), limit=100
        )
        pages = 0
        while paginator.has_next and pages < 100:
            ids.extend(s.sandbox_id for s in paginator.next_items())
            pages += 1
        if not ids:
            break
        CREATED_IDS.update(ids)
        for sid in ids:
            try:
                Sandbox.kill(sid)
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
            killed.append(sid)
    return killed



# Counts in /tmp/count while it runs; written beside and renamed over, so a freeze can never
# leave an empty file to read.
COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv -f /tmp/count.new /tmp/count; "
    "sleep 0.05; done"
)


def read_count(sbx) -> int:
    return int(sbx.commands.run("cat /tmp/count").stdout.strip())


def state_of(sandbar, sandbox_id: str) -> str:
    with sandbar.client() as api:
        r = api.get(f"/sandboxes/{sandbox_id}")
        assert r.status_code == 200, r.text
        return r.json()["state"]


def unique(prefix: str = "e2e") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def add_tar_entry(tar: tarfile.TarFile, name: str, kind: str = "file", data: bytes = b"x\n", target: str = "") -> None:
    """Adds to `tar` an entry of `kind` ("dir", "file" holding `data`, "symlink" or "hardlink" to
    `target`, or "chardev", /dev/mem's numbers) with a fixed mtime."""
    ti = tarfile.TarInfo(name)
    ti.mtime = 1_700_000_000
    ti.mode = 0o644
    if kind == "dir":
        ti.type, ti.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(ti)
    elif kind == "file":
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
    elif kind == "symlink":
        ti.type, ti.linkname, ti.mode = tarfile.SYMTYPE, target, 0o777
        tar.addfile(ti)
    elif kind == "hardlink":
        ti.type, ti.linkname = tarfile.LNKTYPE, target
        tar.addfile(ti)
    elif kind == "chardev":
        ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 1
        tar.addfile(ti)
    else:
        raise ValueError(kind)


def wait_build_end(
    api: httpx.Client,
    template_id: str,
    build_id: str,
    timeout: float,
    interval: float = 0.25,
    params: Optional[dict] = None,
) -> dict:
    """Polls a template build's status (asked with `params`, by default for all its log lines)
    until it is ready or failed; returns that status."""
    params = {"logsOffset": 0} if params is None else params

    def ended():
        s = api.get(f"/templates/{template_id}/builds/{build_id}/status", params=params)
        assert s.status_code == 200, f"{s.status_code} {s.text}"
        return s.json() if s.json()["status"] in ("ready", "error") else None

    return wait_until(ended, timeout=timeout, interval=interval, message=f"build {build_id} to end")


def build_log_messages(status: dict) -> List[str]:
    """The messages of the log lines a build status holds."""
    return [e.get("message", "") for e in status.get("logEntries") or []]


# --------------------------------------------------------------------------
# a fake upstream resolver
# --------------------------------------------------------------------------

# Names under this suffix resolve through FakeDns; everything else is NXDOMAIN, so no test ever
# makes the server ask a real resolver.
FAKE_DNS_SUFFIX = "sandbar-test."


class FakeDns:
    """A tiny DNS server (UDP and TCP, on 127.0.0.1 and a free port unless told) answering A
    queries from a table.

    The server under test uses it as its upstream resolver; tests set `records` (lower-case
    name without the trailing dot -> IPv4 address) while it runs. A `*.<name>` record answers
    every name under `<name>`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        self.records: dict = {}
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((host, port))
        self.host = host
        self.port = self.udp.getsockname()[1]
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((host, self.port))
        self.tcp.listen(16)
        self.queries: List[str] = []
        self._stop = False
        threading.Thread(target=self._serve_udp, daemon=True).start()
        threading.Thread(target=self._serve_tcp, daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def lookup(self, name: str) -> Optional[str]:
        """The address of `name`: its own record, else the wildcard record of the nearest
        name above it."""
        if name in self.records:
            return self.records[name]
        labels = name.split(".")
        for i in range(1, len(labels)):
            address = self.records.get("*." + ".".join(labels[i:]))
            if address is not None:
                return address
        return None

    def answer(self, query: bytes) -> bytes:
        import struct

        if len(query) < 12:
            return b""
        qid = query[:2]
        labels, pos = [], 12
        while pos < len(query) and query[pos] != 0:
            n = query[pos]
            labels.append(query[pos + 1 : pos + 1 + n].decode("ascii", "replace"))
            pos += 1 + n
        qtype = struct.unpack("!H", query[pos + 1 : pos + 3])[0] if pos + 3 <= len(query) else 0
        question = query[12 : pos + 5]
        name = ".".join(labels).lower()
        self.queries.append(name)
        address = self.lookup(name)
        if address is None:
            return qid + b"\x81\x83" + struct.pack("!HHHH", 1, 0, 0, 0) + question
        if qtype != 1:
            return qid + b"\x81\x80" + struct.pack("!HHHH", 1, 0, 0, 0) + question
        rdata = bytes(int(x) for x in address.split("."))
        record = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + rdata
        return qid + b"\x81\x80" + struct.pack("!HHHH", 1, 1, 0, 0) + question + record

    def _serve_udp(self):
        while not self._stop:
            try:
                data, peer = self.udp.recvfrom(4096)
                self.udp.sendto(self.answer(data), peer)
            except OSError:
                return

    def _serve_tcp(self):
        import struct

        while not self._stop:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            with conn:
                try:
                    n = struct.unpack("!H", conn.recv(2))[0]
                    data = b""
                    while len(data) < n:
                        chunk = conn.recv(n - len(data))
                        if not chunk:
                            break
                        data += chunk
                    reply = self.answer(data)
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
                except (OSError, struct.error):
                    pass

    def close(self):
        self._stop = True
        self.udp.close()
        self.tcp.close()


def checkpoints_off(server: "SandbarServer") -> Optional[str]:
    """Why the server cannot checkpoint or snapshot memory (no usable CRIU), from its log;
    None when it can."""
    text = Path(server.log_path).read_text(errors="replace")
    if "paused sandboxes are checkpointed to disk" in text:
        return None
    off = [l for l in text.splitlines() if "checkpoints are off" in l]
    return re.sub(r"\x1b\[[0-9;]*m", "", off[-1]) if off else "no CRIU probe line in the server log"


JS_DIR = Path(__file__).resolve().parent / "js"


def node_binary() -> str:
    """The `node` to run the JS tests with, once the npm SDK is installed beside them."""
    node = shutil.which("node")
    assert node, "node is required for the JS tests (install nodejs)"
    assert (JS_DIR / "node_modules" / "e2b").is_dir(), f"the npm e2b SDK is not installed: run `npm ci --prefix {JS_DIR}`"
    return node


def sdk_env(server: "SandbarServer", **extra: str) -> Dict[str, str]:
    """This process's environment with the SDK pointed at `server`, and `extra`."""
    return dict(
        os.environ,
        E2B_API_URL=server.url,
        E2B_SANDBOX_URL=server.url,
        E2B_API_KEY=server.api_key,
        **extra,
    )


def run_node_test(server: "SandbarServer", name: str, timeout: float = 180, **extra_env: str) -> None:
    """Runs js/`name` under node's test runner against `server`; fails the test where it fails."""
    result = subprocess.run(
        [node_binary(), "--test", "--test-reporter=spec", str(JS_DIR / name)],
        cwd=JS_DIR,
        env=sdk_env(server, **extra_env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"node test failed:\n{result.stdout}\n{result.stderr}"


@contextlib.contextmanager
def shared_server_set_aside(shared: "SandbarServer", shared_base: Path) -> Iterator[None]:
    """Stops the suite's shared server so that a module can run its own, which borrows the
    default template built at `shared_base` (skipping the module where there is none); after,
    points the SDK back at the shared server and starts it again."""
    # The benchmarks import this module without pytest installed.
    import pytest

    if not (shared_base / "complete").exists():
        pytest.skip(f"no built default template at {shared_base} to borrow")
    shared.stop(kill9=False)
    old_env = {k: os.environ.get(k) for k in SDK_URL_VARS}
    try:
        yield
    finally:
        restore_environ(old_env)
        shared.start()
        shared.wait_healthy(timeout=60)


def restore_environ(saved: Dict[str, Optional[str]]) -> None:
    """Puts environment variables back as `saved` has them (None: unset)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def point_sdk_at(url: str) -> None:
    for k in SDK_URL_VARS:
        os.environ[k] = url


def require_checkpoints(server: "SandbarServer", what: str = "checkpoint") -> None:
    """Skips the test where the server cannot `what` for want of a usable CRIU."""
    # The benchmarks import this module without pytest installed.
    import pytest

    reason = checkpoints_off(server)
    if reason:
        pytest.skip(f"the server cannot {what}: {reason}")


def destroy_volume(url: str, api_key: str, volume_id: str, name: str) -> None:
    """Removes a test's volume whatever the order its fixtures end in: a sandbox still
    mounting it (its fixture not yet torn down) would make the delete a 409 and leak the
    volume, so those sandboxes are killed first."""
    headers = {"X-API-Key": api_key}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as api:
        for listed in api.get("/v2/sandboxes", params={"limit": 100}).json():
            sandbox_id = listed.get("sandboxID")
            detail = api.get(f"/sandboxes/{sandbox_id}")
            mounts = detail.json().get("volumeMounts") or [] if detail.status_code == 200 else []
            if any(m.get("name") == name for m in mounts):
                api.delete(f"/sandboxes/{sandbox_id}")
        api.delete(f"/volumes/{volume_id}")


def wait_js(page, expression: str, timeout: float = 15.0) -> None:
    """Polls `expression` in a Playwright page from outside it: the dashboard's CSP forbids the
    string evaluation Playwright's own wait_for_function does inside the page."""
    deadline = time.monotonic() + timeout
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"timed out waiting for {expression}"
        time.sleep(0.1)


# --------------------------------------------------------------------------
# HTTPS clients that know only the domain
# --------------------------------------------------------------------------

# The test CA and certificate the shared server serves HTTPS with (`sandbar cert`).
TLS_FILES = ("ca.pem", "ca-key.pem", "cert.pem", "key.pem")
# The address of a TLS client namespace, on its loopback: no route leads to it from outside,
# and it collides with no range the server or the other tests use (10.213/16 sandboxes,
# 10.214-216 and 10.231 the cluster tests, 10.250 the node's unit tests, 10.253-254 the
# stand-in internets).
TLS_CLIENT_ADDRESS = "10.237.0.1"


def make_tls_files(binary: Path, domain: str, out: Path, force: bool = False) -> str:
    """`sandbar cert --domain <domain> --out <out>`: its output."""
    argv = [str(binary), "cert", "--domain", domain, "--out", str(out)]
    if force:
        argv.append("--force")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"sandbar cert failed: {done.stderr}"
    return done.stdout


class TlsClientNamespace:
    """A network namespace `sbtest-tls-<random>` in which `<domain>`, `api.<domain>` and
    `<port>-<id>.<domain>` all resolve (through a resolver of its own) to an address whose
    port 443 is the shared server's HTTPS listener, as are 127.0.0.1:443 (where browsers send
    `*.localhost` without asking DNS). Its only interface is its loopback, so nothing run in it
    can reach any other host. See netns_relay.py.

    `run(argv, env)` runs a program inside it; `ca_path` is the CA to trust.
    """

    def __init__(self, https_port: int, domain: str, ca_path: Path, log_path: Path):
        self.https_port = https_port
        self.domain = domain
        self.ca_path = ca_path
        self.log_path = log_path
        self.name = "sbtest-tls-" + secrets.token_hex(3)
        self.etc = Path("/etc/netns") / self.name
        self._relay: Optional[subprocess.Popen] = None
        self._made_etc_netns = False

    def __enter__(self) -> "TlsClientNamespace":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        sh("ip", "netns", "add", self.name)
        sh("ip", "-n", self.name, "link", "set", "lo", "up")
        sh("ip", "-n", self.name, "addr", "add", f"{TLS_CLIENT_ADDRESS}/32", "dev", "lo")
        links = sh("ip", "-n", self.name, "-o", "link", "show").stdout.splitlines()
        assert len(links) == 1 and ": lo:" in links[0], f"the namespace must hold only its loopback: {links}"
        self._made_etc_netns = not Path("/etc/netns").exists()
        self.etc.mkdir(parents=True)
        # `ip netns exec` binds these over /etc/resolv.conf and /etc/hosts inside it.
        (self.etc / "resolv.conf").write_text(f"nameserver {TLS_CLIENT_ADDRESS}\noptions timeout:2 attempts:2\n")
        (self.etc / "hosts").write_text("127.0.0.1 localhost\n::1 localhost\n")
        relay = Path(__file__).resolve().parent / "netns_relay.py"
        log = open(self.log_path, "ab")
        self._relay = subprocess.Popen(
            [
                sys.executable, str(relay), "--netns", self.name, "--address", TLS_CLIENT_ADDRESS,
                "--upstream", f"127.0.0.1:{self.https_port}", "--domain", self.domain,
            ],
            stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        ready = self._relay.stdout.readline() if self._relay.stdout else b""
        assert ready.strip() == b"ready", f"the namespace's relay did not start: {self.log_tail()}"

    def env(self, **extra: str) -> Dict[str, str]:
        """An environment with nothing of this process's E2B settings: PATH, HOME and `extra`."""
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
        env.update(extra)
        return env

    def argv(self, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], env: Dict[str, str], timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
        """`argv` run inside the namespace with exactly `env`; waited for."""
        return subprocess.run(self.argv(argv), env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)

    def popen(self, argv: Sequence[str], env: Dict[str, str], **kwargs) -> subprocess.Popen:
        """`argv` started inside the namespace with exactly `env`."""
        return subprocess.Popen(self.argv(argv), env=env, start_new_session=True, **kwargs)

    def log_tail(self) -> str:
        try:
            return Path(self.log_path).read_text(errors="replace")[-4000:]
        except OSError:
            return "(no relay log)"

    def close(self) -> None:
        if self._relay is not None:
            self._relay.kill()
            try:
                self._relay.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if self._relay.stdout:
                self._relay.stdout.close()
            self._relay = None
        # Whatever a test started in the namespace and left running (it holds the namespace).
        for pid in sh("ip", "netns", "pids", self.name, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        sh("ip", "netns", "del", self.name, check=False)
        shutil.rmtree(self.etc, ignore_errors=True)
        if self._made_etc_netns:
            with contextlib.suppress(OSError):
                Path("/etc/netns").rmdir()
