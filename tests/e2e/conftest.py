"""End-to-end fixtures for Sandbar.

The suite starts one `sandbar serve` process for the whole test run and talks
to it with the official E2B Python SDK (and with plain HTTP where the wire
format itself is under test).

Environment:
  SANDBAR_BIN            path of the server binary
                         (default: <repo>/target/release/sandbar)
  SANDBAR_E2E_DATA_DIR   data dir, kept between runs so the base template is
                         built once per machine (default: /var/tmp/sandbar-e2e)
  SANDBAR_E2E_LOG_DIR    where the server log goes
                         (default: /tmp/sandbar-e2e-logs)
  SANDBAR_E2E_TEMPLATE_WAIT  seconds to wait for the base template (default 900)
  SANDBAR_E2E_LOCK       lock file that serializes runs on this machine
                         (default: /var/tmp/sandbar-e2e.e2e-lock)

The `registry` fixture (registry.py) adds two local OCI registries with busybox
fixture images for the custom-template tests.

The tests must run as root on a Linux host (network namespaces, cgroups).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

import pytest

from e2e_util import (
    CREATED_IDS,
    FakeDns,
    acquire_run_lock,
    DATA_DIR,
    DEFAULT_DOMAIN,
    LOG_DIR,
    SANDBAR_BIN,
    SandbarServer,
    TlsClientNamespace,
    UPLOAD_TTL_S,
    UPLOADS_PER_TEAM,
    VOLUME_REQUESTS_PER_MINUTE,
    AGENT_LOG_ROTATE_MB,
    all_pids,
    created_sandbox,
    free_port,
    host_links,
    host_mounts_mentioning,
    host_netns,
    kill_all_listed,
    kill_quietly,
    make_tls_files,
    other_sandbar_servers,
    private_binaries,
    record_sandbox_creation,
    restore_environ,
    sandbox_cgroup_dirs,
    server_cgroup_dirs,
    sandbox_like_processes,
)

# Test files whose tests must run after every other file (they restart the server).
RUN_LAST = (
    "test_disk_full.py",
    "test_postgres_store.py",
    "test_cluster.py",
    "test_volumes.py",
    "test_build_queue.py",
    "test_criu_later.py",
    "test_restart.py",
)
# Test files that run a server of their own and hold the machine-wide lock while they do, so
# they must finish before the shared server starts.
RUN_FIRST = ("test_first_start.py",)


# --------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------

_SERVER: Optional[SandbarServer] = None
FAKE_DNS: Optional[FakeDns] = None
_REGISTRY = None
_REGISTRY_PORTS = None
# More logs for a failing test's report, by name: each a function returning text (the
# cluster tests hand in their hosts' logs).
EXTRA_LOGS: dict = {}


@pytest.fixture(scope="module")
def browser():
    """Debian's chromium, headless, driven by Playwright (the dashboard's tests)."""
    from playwright.sync_api import sync_playwright

    (LOG_DIR / "dashboard").mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        # Root in a container has no user namespace for chromium's own sandbox.
        b = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def registry_ports():
    """The local registries' ports, reserved once by whichever fixture asks first: the server
    must be told to allow them (it refuses pulls from loopback otherwise) before the registries
    exist."""
    global _REGISTRY_PORTS
    if _REGISTRY_PORTS is None:
        from registry import RegistryPorts

        _REGISTRY_PORTS = RegistryPorts()
    return _REGISTRY_PORTS


def pytest_collection_modifyitems(session, config, items):
    """Run the tests with a server of their own first, the server-restarting tests last."""
    own = [i for i in items if i.path.name in RUN_FIRST]
    first = [i for i in items if i.path.name not in RUN_LAST and i.path.name not in RUN_FIRST]
    last = [i for i in items if i.path.name in RUN_LAST]
    items[:] = own + first + last


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and _SERVER is not None:
        rep.sections.append(("sandbar server log", _SERVER.log_tail(80)))
    if rep.failed:
        for name, logs in list(EXTRA_LOGS.items()):
            rep.sections.append((f"{name} logs", logs()))
    if rep.failed and _REGISTRY is not None and "registry" in getattr(item, "fixturenames", ()):
        rep.sections.append(("registry logs", _REGISTRY.log_tail(20)))


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sandbar():
    """The running server. Offers .url, .port, .api_key, .restart(kill9), .log_tail()."""
    global _SERVER
    if os.geteuid() != 0:
        pytest.exit("the Sandbar e2e suite must run as root", returncode=2)
    if not SANDBAR_BIN.is_file():
        pytest.exit(
            f"sandbar binary not found at {SANDBAR_BIN}; build it with `cargo build --release -p sandbar` "
            "or set SANDBAR_BIN",
            returncode=2,
        )

    # Two runs must not share a data dir: they would kill each other's sandboxes.
    lock = acquire_run_lock(DATA_DIR)

    baseline_pids = all_pids()
    baseline_cgroups = sandbox_cgroup_dirs()
    baseline_server_cgroups = server_cgroup_dirs()
    baseline_links = host_links("sbx")
    baseline_netns = host_netns()

    log_path = LOG_DIR / f"sandbar-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    binary, _agent = private_binaries(SANDBAR_BIN, interpreter=True)
    # HTTPS beside plain HTTP, with a CA of this run's own made as an operator would make it
    # (test_tls.py reaches it as the SDKs do with only E2B_DOMAIN set).
    tls_dir = Path(tempfile.mkdtemp(prefix="sandbar-e2e-tls-"))
    make_tls_files(binary, DEFAULT_DOMAIN, tls_dir)
    port = free_port()
    tls_port = free_port()
    while tls_port == port:
        tls_port = free_port()
    global FAKE_DNS
    FAKE_DNS = FakeDns()
    # Small disks keep the disk-exhaustion probes fast, and a small pool leaves the host room
    # for the other suites' servers (its blocks are all allocated up front); the upstream
    # resolver is the fake one, so nothing a sandbox resolves ever reaches a real resolver.
    server = SandbarServer(
        binary,
        DATA_DIR,
        log_path,
        port,
        # A short pause grace lets the checkpoint tests see sandboxes written to disk soon;
        # the freezer tests resume well within it. Pulls may reach the local registries only.
        extra_args=[
            "--base-disk-mb", "512", "--disk-pool-gb", "8", "--ready-timeout-secs", "20", "--nameserver", FAKE_DNS.address, "--pause-grace-secs", "3",
            "--upload-ttl-secs", str(UPLOAD_TTL_S), "--max-uploads-per-team", str(UPLOADS_PER_TEAM),
            "--volume-requests-per-minute", str(VOLUME_REQUESTS_PER_MINUTE),
            # The rotation test writes three times this through process starts.
            "--agent-log-rotate-mb", str(AGENT_LOG_ROTATE_MB),
            # The webhook receiver runs on 127.0.0.1, and its retries are waited for.
            "--webhook-allow-private", "--webhook-retry-secs", "1",
            *registry_ports().allow_args(),
            "--tls-listen", f"127.0.0.1:{tls_port}",
            "--tls-cert", str(tls_dir / "cert.pem"), "--tls-key", str(tls_dir / "key.pem"),
        ],
        desktop=True,
    )
    server.tls_port = tls_port
    server.tls_dir = tls_dir
    print(
        f"\n[e2e] sandbar {SANDBAR_BIN} (copied to {binary.parent}) on {server.url}, "
        f"data dir {DATA_DIR}, log {log_path}",
        file=sys.stderr,
    )
    server.start()
    _SERVER = server
    try:
        server.wait_healthy(timeout=60)
        server.load_api_key()
        server.wait_base_template()
    except Exception as e:
        server.stop(kill9=True)
        shutil.rmtree(binary.parent, ignore_errors=True)
        shutil.rmtree(tls_dir, ignore_errors=True)
        lock.close()
        pytest.exit(f"could not start sandbar: {e}", returncode=3)

    undo_recording = record_sandbox_creation()
    old_env = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN")}
    os.environ["E2B_API_URL"] = server.url
    os.environ["E2B_SANDBOX_URL"] = server.url
    os.environ["E2B_API_KEY"] = server.api_key
    os.environ["E2B_DOMAIN"] = server.domain

    # Sandboxes left over by an earlier, interrupted run of this suite.
    leftovers = kill_all_listed(server)
    if leftovers:
        print(f"[e2e] killed {len(leftovers)} sandboxes left from an earlier run", file=sys.stderr)
    stale_templates = server.delete_leftover_templates()
    if stale_templates:
        print(f"[e2e] deleted {stale_templates} templates and snapshots left from an earlier run", file=sys.stderr)

    try:
        yield server
    finally:
        problems: List[str] = []
        try:
            if server.proc is None or server.proc.poll() is not None:
                # The server died (or a test left it stopped); bring it back to clean up.
                server.proc = None
                server.start()
                server.wait_healthy(timeout=60)
            kill_all_listed(server)
            remaining = server.sandbox_ids()
            if remaining:
                problems.append(f"sandboxes still listed after kill: {sorted(remaining)}")
        except Exception as e:  # noqa: BLE001
            problems.append(f"cleanup through the API failed: {e!r}")
        server.stop_in_teardown(problems)
        _SERVER = None
        undo_recording()
        restore_environ(old_env)

        # Leak checks: resources may take a moment to disappear. Resources that
        # cannot be tied to this run only count when no other Sandbar server is
        # running on this machine.
        def leaks():
            out, notes = [], []
            strict = not other_sandbar_servers()
            loose = out if strict else notes
            new_cg = sandbox_cgroup_dirs() - baseline_cgroups
            mine = {d for d in new_cg if Path(d).name in CREATED_IDS}
            if mine:
                out.append(f"cgroup dirs left: {sorted(mine)}")
            if new_cg - mine:
                loose.append(f"cgroup dirs of unknown sandboxes left: {sorted(new_cg - mine)}")
            own_cg = server_cgroup_dirs() - baseline_server_cgroups
            if own_cg:
                loose.append(f"the server's own cgroup dirs left after its stop: {sorted(own_cg)[:10]}")
            links = host_links("sbx") - baseline_links
            if links:
                loose.append(f"host links left: {sorted(links)}")
            ns = {n for n in host_netns() - baseline_netns if n.startswith("sbtest-")}
            if ns:
                out.append(f"test network namespaces left: {sorted(ns)}")
            procs = sandbox_like_processes(DATA_DIR, baseline_pids, CREATED_IDS)
            for mine_flag, target in ((True, out), (False, loose)):
                sel = sorted((p, d["desc"]) for p, d in procs.items() if d["mine"] == mine_flag)
                if sel:
                    target.append("sandbox processes left: " + "; ".join(f"{p}: {d}" for p, d in sel[:20]))
            mounts = host_mounts_mentioning(str(DATA_DIR))
            if mounts:
                out.append(f"host mounts under the data dir: {mounts[:10]}")
            return out, notes

        deadline = time.monotonic() + 20
        found, notes = leaks()
        while found and time.monotonic() < deadline:
            time.sleep(1)
            found, notes = leaks()
        problems.extend(found)
        # A stopped server leaves its firewall table on purpose, for sandboxes that outlive
        # it; with no sandbox interface left and no other server, the table is this run's.
        if not other_sandbar_servers() and not host_links("sbx"):
            subprocess.run(["nft", "delete", "table", "inet", "sandbar"], capture_output=True, check=False)
        shutil.rmtree(binary.parent, ignore_errors=True)
        shutil.rmtree(tls_dir, ignore_errors=True)
        lock.close()
        for n in notes:
            print(f"[e2e] warning (another sandbar server is running): {n}", file=sys.stderr)
        if problems:
            tail = ""
            try:
                with open(log_path, "rb") as f:
                    tail = f.read()[-8000:].decode("utf-8", "replace")
            except OSError:
                pass
            pytest.fail("resource leaks after the run:\n  " + "\n  ".join(problems) + "\n" + tail)


@pytest.fixture(scope="session")
def tls_client_ns(sandbar):
    """A network namespace whose clients reach the shared server only as the SDKs do with
    `E2B_DOMAIN=sandbar.localhost`: https://api.sandbar.localhost and
    https://<port>-<id>.sandbar.localhost on port 443, through DNS. Offers .run(argv, env),
    .popen(argv, env), .env(**vars) (no E2B settings of this process) and .ca_path. Removed
    at the end of the session, on failure too (see e2e_util.TlsClientNamespace)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / f"tls-relay-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    with TlsClientNamespace(sandbar.tls_port, sandbar.domain, sandbar.tls_dir / "ca.pem", log) as ns:
        yield ns


@pytest.fixture(scope="session")
def fake_dns(sandbar) -> FakeDns:
    """The server's upstream resolver: set `fake_dns.records[name] = ip`."""
    assert FAKE_DNS is not None
    return FAKE_DNS


@pytest.fixture(scope="session")
def registry():
    """Local OCI registries with the fixture images, for custom templates (see registry.py).

    Offers .host and .auth_host ("127.0.0.1:<port>", plain HTTP), .image("e2e/tiny:1") and
    .image("e2e/tiny:2") on the open registry, .auth_image ("<auth_host>/e2e/private:1"),
    .username and .password for the auth registry, and .closed_host (a port nothing listens on).
    Both registries start empty for the session and are stopped at its end; the OCI layout the
    images are pushed from is cached under <data dir>/e2e-fixtures.
    """
    global _REGISTRY
    from registry import LocalRegistries

    try:
        reg = LocalRegistries.start(cache_dir=DATA_DIR / "e2e-fixtures", ports=registry_ports())
    except Exception as e:  # noqa: BLE001 - reported as the fixture's error
        pytest.fail(f"could not set up the local registries: {e}", pytrace=False)
    _REGISTRY = reg
    try:
        yield reg
    finally:
        _REGISTRY = None
        reg.close()


@pytest.fixture(scope="module")
def tiny1(registry) -> str:
    """The fixture image `e2e/tiny:1` on the open local registry."""
    return registry.image("e2e/tiny:1")


@pytest.fixture(scope="session")
def base_template(sandbar) -> dict:
    return sandbar.base_template or sandbar.wait_base_template()


@pytest.fixture
def sandbox(sandbar):
    """A fresh sandbox from the default template (timeout 120 s), always killed afterwards."""
    with created_sandbox(timeout=120) as sbx:
        yield sbx


@pytest.fixture
def make_sandbox(sandbar):
    """Factory for extra sandboxes: make_sandbox(**Sandbox.create kwargs). All are killed in teardown."""
    from e2b import Sandbox

    created: List = []

    def _make(**kwargs):
        kwargs.setdefault("timeout", 120)
        sbx = Sandbox.create(**kwargs)
        created.append(sbx)
        return sbx

    try:
        yield _make
    finally:
        for sbx in created:
            kill_quietly(sbx.sandbox_id)


@pytest.fixture
def track_sandbox_id(sandbar):
    """Register sandbox IDs created outside the SDK (raw HTTP) so they are killed in teardown."""
    ids: List[str] = []

    def _track(sandbox_id: str) -> None:
        ids.append(sandbox_id)
        CREATED_IDS.add(sandbox_id)

    try:
        yield _track
    finally:
        for sid in ids:
            kill_quietly(sid)
