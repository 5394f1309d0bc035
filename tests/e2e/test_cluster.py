"""Sandbar as a cluster: API hosts and nodes, each a machine of its own, sharing PostgreSQL.

`cluster.py` makes the machines (network and mount namespaces on a bridge of their own,
per-host cgroups, PostgreSQL on a Unix socket) and removes them, also when a test fails or
the run is interrupted. The module runs among the last with the shared server stopped, or
alone holding the machine-wide lock.

- `test_harness_smoke`: one `sandbar serve` of the default role on the harness's PostgreSQL,
  in node n1's machine, reached from this process with the stock SDK; a sandbox runs
  `echo hi`; everything is removed and the leak check is clean. Needs nothing of the roles.
- the rest need `sandbar serve --role` (they run whenever `serve --help` lists it) and share
  one cluster of two API hosts (api1, api2) and two nodes (n1, n2; n2 does not borrow the
  base template's root, so it holds its layer only once fetched from the layer store): 40
  sandboxes created through api1, while only n1 holds base, land at least 12 on each node; commands, files, signed file URLs and a user port work through both API
  hosts; both list the same set and either kills the other's sandboxes; kill -9 of an API
  host while commands run through the other; kill -9 of a node and its return; a node's API
  refuses requests without the cluster secret. About 40 s once the nodes are up.
- `test_a_node_fetches_ahead_the_templates_others_run`: a template built by one node and run
  there only is fetched by the other node's fetch-ahead task, with no create of it there.
- `test_a_build_goes_to_the_node_with_a_free_build_slot` (after the budget above): with one
  build slot per node, team A's endless build holds one node's slot, and team B's build that
  copies a file goes to the other node and is ready within a minute; a sandbox of it sees the
  file, and A's build is cancelled through an API host.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Set

import httpx
import pytest

import cluster as cl
import conftest
from e2e_util import DATA_DIR, LOG_DIR, SANDBAR_BIN, acquire_run_lock, read_or_empty, wait_js, wait_until

FLEET = 40
# One tenant build at a time per node, so one endless build fills a node's build slots.
BUILD_FLAGS = ["--concurrent-builds", "1", "--builds-per-team", "1"]
# Once the nodes are up, the role tests together stay within this.
BUDGET_S = 120
# A dead node's sandboxes stop being listed as running within the lease and a margin.
# A process that keeps a secret in memory only, and writes it out when sent SIGUSR1.
MEMORY_KEEPER = """secret=$(od -An -N8 -tx1 /dev/urandom | tr -d ' \\n')
echo "$secret" > /home/user/expected
echo $$ > /home/user/keeper.pid
trap 'echo "$secret" > /home/user/told' USR1
while :; do sleep 0.2; done
"""
DEAD_NODE_S = 15


def _serve_help() -> str:
    try:
        return subprocess.run([str(SANDBAR_BIN), "serve", "--help"], capture_output=True, text=True,
                              timeout=30).stdout
    except OSError:
        return ""


HAS_ROLES = "--role" in _serve_help()
needs_roles = pytest.mark.skipif(
    not HAS_ROLES, reason=f"`{SANDBAR_BIN} serve --help` lists no --role: the cluster roles are not built in"
)


@pytest.fixture(scope="module")
def machine():
    """This machine to ourselves: the shared server, if this session runs it, is stopped (the
    session already holds the machine-wide lock) and started again afterwards; run alone, the
    module takes the lock itself."""
    shared = conftest._SERVER
    if shared is not None:
        shared.stop(kill9=False)
        try:
            yield
        finally:
            shared.start()
            shared.wait_healthy(timeout=60)
    else:
        lock = acquire_run_lock(DATA_DIR)
        try:
            yield
        finally:
            lock.close()


def _leak_check(label: str) -> None:
    found = cl.leaks()
    deadline = time.monotonic() + 20
    while found and time.monotonic() < deadline:
        time.sleep(1)
        found = cl.leaks()
    assert not found, f"{label}: left behind:\n  " + "\n  ".join(found)


def _wait_template(host: cl.Host, timeout: float = 90, headers=None) -> None:
    def ready():
        with host.client(headers=headers) as api:
            r = api.get("/templates")
            return r.status_code == 200 and any(
                "base" in (t.get("aliases") or []) + (t.get("names") or []) and t.get("buildStatus") == "ready"
                for t in r.json()
            )

    wait_until(ready, timeout=timeout, interval=0.5, message=f"the base template through {host.name}")


# --------------------------------------------------------------------------
# the harness itself, with today's single-host server
# --------------------------------------------------------------------------


def test_harness_smoke(machine):
    from e2b import Sandbox

    links_before = _host_links()
    started = time.monotonic()
    c = cl.Cluster(SANDBAR_BIN, names=("n1",), log_tag="smoke")
    conftest.EXTRA_LOGS["cluster"] = c.log_tails
    timings = {}
    try:
        c.open()
        timings["machine"] = time.monotonic() - started
        n1 = c["n1"]
        n1.start(role=None)
        n1.wait_healthy(timeout=60)
        _wait_template(n1, timeout=90)
        timings["server"] = time.monotonic() - started
        sbx = Sandbox.create(template="base", timeout=120, metadata={"suite": "cluster-smoke"}, **n1.sdk())
        out = sbx.commands.run("echo hi")
        assert out.stdout == "hi\n" and out.exit_code == 0
        timings["echo"] = time.monotonic() - started
        assert c.pg.psql(f"SELECT status FROM sandboxes WHERE id = '{sbx.sandbox_id}'") == "running"
        # The sandbox's cgroups are the node's own, beneath its host directory.
        mine = [d for d in cl.our_cgroup_dirs() if d.name == sbx.sandbox_id]
        assert mine and all(d.parent.parent.name == "sbtest-cl-n1" and d.parent.name == "sandbar" for d in mine), mine
        assert not any((cl.CGROUP_ROOT / h / "sandbar" / sbx.sandbox_id).exists() for h in cl.cgroup_hierarchies())
        # The host ends of its links are in the node's namespace, not on this machine.
        assert "sbx" in n1.run("ip", "-o", "link").stdout
        assert not {l for l in _host_links() - links_before if l.startswith("sbx")}
        # The node took its host lock in its machine's own /run/sandbar.
        assert n1.run("cat", "/run/sandbar/server.lock").stdout.strip() == str(n1.pid)
        host_lock = Path("/run/sandbar/server.lock")
        assert not host_lock.exists() or host_lock.read_text().strip() != str(n1.pid)
        # A second sandbox stays running: the harness must remove what a server leaves.
        Sandbox.create(template="base", timeout=120, **n1.sdk())
        sbx.kill()
        n1.stop()
    finally:
        c.close()
        conftest.EXTRA_LOGS.pop("cluster", None)
    timings["closed"] = time.monotonic() - started
    _leak_check("after the smoke test")
    assert not {l for l in _host_links() - links_before if l.startswith(("sbx", cl.PREFIX))}
    print(f"\n[e2e] cluster smoke timings (s from start): " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))


def _host_links() -> Set[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return {l.split(":")[1].strip().split("@")[0] for l in out.splitlines() if ":" in l}


# --------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------


class Fleet:
    def __init__(self, c: cl.Cluster):
        self.c = c
        self.tag = uuid.uuid4().hex[:10]
        self.sandboxes: Dict[str, object] = {}  # id -> Sandbox made through api1
        self.started = time.monotonic()

    def node_of(self, sandbox_id: str, via: str = "api1") -> str:
        with self.c[via].client() as api:
            r = api.get(f"/sandboxes/{sandbox_id}")
            assert r.status_code == 200, f"GET /sandboxes/{sandbox_id} through {via}: {r.status_code} {r.text}"
            return r.json()["clientID"]

    def running(self, via: str) -> Dict[str, str]:
        """Every running sandbox listed through `via`: id -> clientID."""
        with self.c[via].client(timeout=10) as api:
            r = api.get("/v2/sandboxes", params={"state": "running", "limit": 100})
            assert r.status_code == 200, f"list through {via}: {r.status_code} {r.text}"
            return {s["sandboxID"]: s["clientID"] for s in r.json()}


def _node_secret(c: cl.Cluster) -> dict:
    return {cl.SECRET_HEADER: c.secret}


@pytest.fixture(scope="module")
def cluster(machine):
    # n2 does not borrow the base template's root: it has the template's layer only once it
    # fetched it from the layer store, as a node that joins a running cluster.
    c = cl.Cluster(SANDBAR_BIN, log_tag="roles", without_base={"n2"})
    conftest.EXTRA_LOGS["cluster"] = c.log_tails
    try:
        c.open()
        # The first server on the empty database bootstraps the team and its key; the rest
        # then start together.
        c["n1"].start(role="node", extra_args=BUILD_FLAGS)
        _wait_node(c, c["n1"])
        # n2, without the base root, must find base built, or it would build it itself.
        _wait_template(c["n1"], headers=_node_secret(c))
        c["n2"].start(role="node", extra_args=BUILD_FLAGS)
        for name in ("api1", "api2"):
            c[name].start(role="api")
        _wait_node(c, c["n2"])
        for name in ("api1", "api2"):
            c[name].wait_healthy(timeout=60)
        _wait_template(c["api1"])
        _wait_known(c, {"n1", "n2"})
        # n1 built the base template and n2 did not, nor fetched it yet: the fleet's creates
        # start from a node that must fetch its layers.
        c.n2_held_base = _template_on_disk("n2", _template_id(c["api1"], "base"), c)
        c.ready_at = time.monotonic()
        yield c
        problems = []
        try:
            with c["api1"].client() as api:
                for s in api.get("/v2/sandboxes", params={"state": "running,paused", "limit": 100}).json():
                    api.delete(f"/sandboxes/{s['sandboxID']}")
        except Exception as e:  # noqa: BLE001 - the harness removes them anyway
            problems.append(f"killing the sandboxes through api1: {e!r}")
        for host in c.hosts.values():
            try:
                host.stop()
            except Exception as e:  # noqa: BLE001
                problems.append(f"stopping {host.name}: {e}")
        assert not problems, problems
    finally:
        c.close()
        conftest.EXTRA_LOGS.pop("cluster", None)
    _leak_check("after the cluster tests")


def _wait_node(c: cl.Cluster, node: cl.Host, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while True:
        if not node.running:
            raise AssertionError(f"{node.name} exited with {node.proc.returncode}\n" + node.log_tail())
        try:
            r = httpx.get(node.url + "/health", headers=_node_secret(c), timeout=2)
            if r.status_code in (200, 204):
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as e:
            last = repr(e)
        assert time.monotonic() < deadline, f"{node.name} did not answer /health with the secret ({last})"
        time.sleep(0.2)


def _wait_known(c: cl.Cluster, nodes: Set[str], timeout: float = 30) -> None:
    """Waits until the database lists `nodes` as live and then for the API hosts' next reads of
    it (every second), without a create, which would give the node a template's layers."""
    listed = ",".join(f"'{n}'" for n in sorted(nodes))
    wait_until(lambda: c.pg.psql(f"SELECT count(*) FROM nodes WHERE id IN ({listed}) AND lease_until > now()")
               == str(len(nodes)), timeout=timeout, interval=0.3, message=f"{sorted(nodes)} live in the database")
    time.sleep(2.5)


def _template_id(host: cl.Host, alias: str) -> str:
    with host.client() as api:
        r = api.get("/templates")
        assert r.status_code == 200, f"templates through {host.name}: {r.status_code} {r.text}"
        return next(t["templateID"] for t in r.json() if alias in (t.get("aliases") or []) + (t.get("names") or []))


@pytest.fixture(scope="module")
def fleet(cluster):
    """40 sandboxes created through api1, all killed at the end."""
    from e2b import Sandbox

    f = Fleet(cluster)
    api1 = cluster["api1"]

    def make(i):
        return Sandbox.create(template="base", timeout=300, metadata={"fleet": f.tag, "i": str(i)}, **api1.sdk())

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        for sbx in pool.map(make, range(FLEET)):
            f.sandboxes[sbx.sandbox_id] = sbx
    f.made_in = time.monotonic() - started
    yield f
    for sid in list(f.sandboxes):
        try:
            Sandbox.kill(sid, **api1.sdk())
        except Exception:  # noqa: BLE001 - teardown goes on
            pass


def _run_all(sandboxes: List, fn, workers: int = 8) -> list:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, sandboxes))


def _serve_port(sbx, port: int = 8000) -> str:
    marker = uuid.uuid4().hex
    sbx.files.write(f"/home/user/site/{marker}.txt", marker)
    sbx.commands.run(f"python3 -m http.server {port} --bind 0.0.0.0", background=True, cwd="/home/user/site",
                     timeout=0)
    return marker


def _fetch_port(host: cl.Host, sbx, marker: str, port: int = 8000) -> None:
    def by_headers():
        r = httpx.get(f"{host.url}/{marker}.txt", timeout=5,
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": str(port)})
        return r.status_code == 200 and r.text == marker

    wait_until(by_headers, timeout=20, interval=0.3, message=f"port {port} of {sbx.sandbox_id} through {host.name}")
    r = httpx.get(f"{host.url}/{marker}.txt", headers={"Host": sbx.get_host(port)}, timeout=5)
    assert r.status_code == 200 and r.text == marker, f"by Host through {host.name}: {r.status_code} {r.text[:200]}"


@needs_roles
def test_creates_spread_and_everything_works_through_both_api_hosts(cluster, fleet):
    from e2b import Sandbox

    nodes = {sid: fleet.node_of(sid) for sid in fleet.sandboxes}
    counts = {n: list(nodes.values()).count(n) for n in ("n1", "n2")}
    assert set(nodes.values()) == {"n1", "n2"}, f"clientIDs: {counts}, others {set(nodes.values()) - {'n1', 'n2'}}"
    # Only n1 held the base template's layers when they began: locality is a preference that
    # gives way once n1 is fuller by the margin, so n2 takes its share and fetches them.
    assert not cluster.n2_held_base, "n2 held the base template's layers before the fleet"
    assert min(counts.values()) >= FLEET * 3 // 10, f"placement far from even: {counts}"
    print(f"\n[e2e] {FLEET} creates through api1, base on n1 only, placed {counts} "
          f"in {fleet.made_in:.1f} s")
    # The same answer through the other API host.
    assert {sid: fleet.node_of(sid, via="api2") for sid in nodes} == nodes

    sbxs = list(fleet.sandboxes.values())
    outs = _run_all(sbxs, lambda s: s.commands.run(f"echo {s.sandbox_id}").stdout)
    assert outs == [f"{s.sandbox_id}\n" for s in sbxs]
    via2 = _run_all(list(fleet.sandboxes), lambda sid: Sandbox.connect(sid, **cluster["api2"].sdk()))
    outs = _run_all(via2, lambda s: s.commands.run("cat /proc/sys/kernel/hostname; echo via2").stdout)
    assert all(o.endswith("via2\n") for o in outs)

    # Files and a user port, on a sandbox of each node, through each API host.
    for node in ("n1", "n2"):
        sid = next(s for s, n in nodes.items() if n == node)
        one = fleet.sandboxes[sid]
        two = Sandbox.connect(sid, **cluster["api2"].sdk())
        one.files.write("/home/user/from-api1.txt", f"api1 {sid}")
        assert two.files.read("/home/user/from-api1.txt") == f"api1 {sid}"
        two.files.write("/home/user/from-api2.bin", sid.encode() * 1000)
        assert one.files.read("/home/user/from-api2.bin", format="bytes") == sid.encode() * 1000
        marker = _serve_port(one)
        _fetch_port(cluster["api1"], one, marker)
        _fetch_port(cluster["api2"], two, marker)
        # A signed URL names no sandbox: the API host finds it by the signature.
        url = one.download_url("/home/user/from-api1.txt")
        assert "signature=" in url and sid not in url
        r = httpx.get(url, timeout=30)
        assert r.status_code == 200 and r.text == f"api1 {sid}", f"{url} -> {r.status_code} {r.text[:200]}"
        up = two.upload_url("/home/user/uploaded.txt")
        r = httpx.post(up, files={"file": ("uploaded.txt", b"signed upload")}, timeout=30)
        assert r.status_code == 200, f"{up} -> {r.status_code} {r.text[:200]}"
        assert one.files.read("/home/user/uploaded.txt") == "signed upload"


@needs_roles
def test_both_api_hosts_list_the_same_and_kill_each_others(cluster, fleet):
    from e2b import Sandbox, SandboxQuery

    def listed(via: str) -> Set[str]:
        paginator = Sandbox.list(query=SandboxQuery(metadata={"fleet": fleet.tag}), limit=7, **cluster[via].sdk())
        ids: List[str] = []
        while paginator.has_next:
            ids.extend(s.sandbox_id for s in paginator.next_items())
        assert len(ids) == len(set(ids)), f"duplicates in the pages through {via}"
        return set(ids)

    one, two = listed("api1"), listed("api2")
    assert one == two == set(fleet.sandboxes), (len(one), len(two), len(fleet.sandboxes))

    victims = sorted(fleet.sandboxes)[:4]
    for sid in victims:
        assert Sandbox.kill(sid, **cluster["api2"].sdk()) is True
        fleet.sandboxes.pop(sid)
    for via in ("api1", "api2"):
        with cluster[via].client() as api:
            for sid in victims:
                r = api.get(f"/sandboxes/{sid}")
                assert r.status_code == 404, f"{sid} through {via} after the kill: {r.status_code} {r.text}"
    assert listed("api1") == listed("api2") == set(fleet.sandboxes)


@needs_roles
def test_kill9_of_an_api_host_leaves_the_other_serving(cluster, fleet):
    from e2b import Sandbox

    api1, api2 = cluster["api1"], cluster["api2"]
    sid = sorted(fleet.sandboxes)[0]
    sbx = Sandbox.connect(sid, **api2.sdk())
    failures: List[str] = []
    done = [0]
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                r = sbx.commands.run(f"echo {done[0]}", timeout=10)
                assert r.stdout == f"{done[0]}\n"
                done[0] += 1
            except Exception as e:  # noqa: BLE001 - counted
                failures.append(repr(e))

    t = threading.Thread(target=loop)
    t.start()
    try:
        time.sleep(1.5)
        before = done[0]
        api1.kill9()
        time.sleep(3)
        # Creates and lists through the survivor too.
        extra = Sandbox.create(template="base", timeout=120, **api2.sdk())
        fleet.sandboxes[extra.sandbox_id] = extra
        assert extra.commands.run("echo ok").stdout == "ok\n"
        time.sleep(1.5)
    finally:
        stop.set()
        t.join(timeout=30)
    assert not failures, f"{len(failures)} commands failed through api2 while api1 died: {failures[:3]}"
    print(f"\n[e2e] {done[0]} commands through api2, {done[0] - before} of them after api1's kill -9")
    assert done[0] > before + 5, f"only {done[0] - before} commands after api1 died"

    api1.start()
    api1.wait_healthy(timeout=60)
    again = Sandbox.connect(sid, **api1.sdk())
    assert again.commands.run("echo back").stdout == "back\n"
    assert extra.sandbox_id in fleet.running("api1")


@needs_roles
def test_kill9_of_a_node_and_its_return(cluster, fleet):
    from e2b import Sandbox, SandboxException, Template

    api1, api2, n1 = cluster["api1"], cluster["api2"], cluster["n1"]
    on_n1 = {sid for sid, node in fleet.running("api1").items() if node == "n1" and sid in fleet.sandboxes}
    assert on_n1, "no fleet sandbox runs on n1"

    # A template built once, by n1 (both nodes' build slots are free, so the first by id
    # builds), is published to the layer store before it is ready; once n1 is gone, n2
    # fetches its layers and starts it.
    built_once = f"built-once-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    sdk = {k: v for k, v in api2.sdk().items() if k != "sandbox_url"}
    Template.build(Template().from_template("base").run_cmd(f"echo {built_once} > /etc/built-once", user="root"),
                   built_once, **sdk)
    print(f"\n[e2e] template built and published in {time.monotonic() - t0:.1f}s")
    published = cluster.pg.psql("SELECT layer, node_id FROM layer_blobs ORDER BY layer")
    assert any(line.startswith("layer/") and line.endswith("|n1") for line in published.splitlines()), published
    assert not _template_on_disk("n2", built_once, cluster), "n2 had the new template before it was asked for it"

    # A sandbox paused on n1, with a process whose memory holds what no file does: n1
    # checkpoints it and copies its files and the checkpoint to the layer store, so that
    # another node can resume it, processes and all, if n1 is lost.
    paused_id = sorted(on_n1)[-1]
    on_n1.discard(paused_id)
    paused = fleet.sandboxes[paused_id]
    paused.files.write("/home/user/kept.txt", "written before the pause\n")
    paused.files.write("/home/user/keeper.sh", MEMORY_KEEPER)
    paused.commands.run("sh /home/user/keeper.sh", background=True)
    wait_until(lambda: paused.commands.run("test -s /home/user/keeper.pid").exit_code == 0, timeout=10,
               message="the keeper to start")
    keeper_pid = paused.files.read("/home/user/keeper.pid").strip()
    assert paused.pause() is True
    for copy in ("files", "memory"):
        wait_until(lambda: cluster.pg.psql(f"SELECT node_id FROM layer_blobs WHERE layer = '{copy}/{paused_id}'") == "n1",
                   timeout=40, interval=0.3, message=f"n1 to share the paused sandbox's {copy}")

    n1.kill9()
    died = time.monotonic()

    def gone():
        left = on_n1 & set(fleet.running("api1"))
        return not left and not (on_n1 & set(fleet.running("api2")))

    wait_until(gone, timeout=DEAD_NODE_S, interval=0.5, message="n1's sandboxes to be no longer listed as running")
    print(f"\n[e2e] n1's sandboxes unlisted {time.monotonic() - died:.1f}s after its kill -9")

    # Using one is a clear error, not a hang.
    sid = sorted(on_n1)[0]
    t0 = time.monotonic()
    with api1.client(timeout=10) as api:
        r = api.get(f"/sandboxes/{sid}")
    assert time.monotonic() - t0 < 5
    assert r.status_code != 200 or r.json().get("state") != "running", r.text
    t0 = time.monotonic()
    with pytest.raises(SandboxException) as err:
        Sandbox.connect(sid, **api1.sdk()).commands.run("echo no", timeout=20, request_timeout=20)
    assert time.monotonic() - t0 < 10, f"the error took {time.monotonic() - t0:.1f}s"
    text = str(err.value).lower()
    assert sid.lower() in text or any(w in text for w in ("not found", "not running", "unavailable", "unreachable")), \
        err.value

    # New creates all go to n2, the new template's too.
    new = _run_all(list(range(6)), lambda i: Sandbox.create(template="base", timeout=120, **api2.sdk()), workers=3)
    t0 = time.monotonic()
    fetched = Sandbox.create(template=built_once, timeout=120, **api1.sdk())
    print(f"[e2e] first sandbox of the new template on n2 (layers fetched) in {time.monotonic() - t0:.2f}s")
    new.append(fetched)
    for s in new:
        fleet.sandboxes[s.sandbox_id] = s
    assert {fleet.node_of(s.sandbox_id) for s in new} == {"n2"}
    assert fetched.commands.run("cat /etc/built-once").stdout == built_once + "\n"

    # The paused sandbox is still listed as paused, and resumes on n2, on its files, with its
    # processes restored from n1's checkpoint.
    with api2.client() as api:
        r = api.get("/v2/sandboxes", params={"state": "paused"})
        assert r.status_code == 200, r.text
        assert paused_id in {s["sandboxID"] for s in r.json()}, r.text
    # Nodes of a real cluster copy their agent at their own start, minutes apart: a checkpoint
    # names the agent by its digest, so the copy's time must not matter.
    n2 = cluster["n2"]
    n2.run("sh", "-c", f"touch -d '-10 minutes' {n2.data_dir}/agents/*")
    t0 = time.monotonic()
    resumed = Sandbox.connect(paused_id, timeout=120, **api1.sdk())
    print(f"[e2e] paused sandbox of the lost node resumed on another in {time.monotonic() - t0:.2f}s")
    assert fleet.node_of(paused_id) == "n2"
    assert resumed.files.read("/home/user/kept.txt") == "written before the pause\n"
    assert resumed.commands.run("echo resumed elsewhere").stdout == "resumed elsewhere\n"
    # The same process, with the secret it held only in memory.
    assert resumed.commands.run(f"kill -USR1 {keeper_pid}").exit_code == 0
    wait_until(lambda: resumed.commands.run("test -s /home/user/told").exit_code == 0, timeout=10,
               message="the restored keeper to answer")
    assert resumed.files.read("/home/user/told") == resumed.files.read("/home/user/expected")
    assert cluster.pg.psql(
        f"SELECT count(*) FROM layer_blobs WHERE layer IN ('files/{paused_id}', 'memory/{paused_id}')") == "0", \
        "the copies of a woken sandbox are forgotten"
    fleet.sandboxes[paused_id] = resumed
    wait_until(lambda: _template_on_disk("n2", built_once, cluster), timeout=10, interval=0.5,
               message="n2 to report the fetched template")

    # n1 comes back: it is placed on again, and no sandbox is live on two nodes.
    n1.start()
    _wait_node(cluster, n1)

    for api in (api1, api2):
        api.wait_placement({"n1"})

    def settled():
        listed = fleet.running("api1")
        for sid in on_n1:
            if sid in listed:
                # Adopted: it works, on n1.
                assert listed[sid] == "n1", f"{sid} came back on {listed[sid]}"
            elif _cgroup_on(sid, "n1"):
                return False  # not cleaned up yet
        return listed

    listed = wait_until(settled, timeout=20, interval=0.5, message="n1's sandboxes adopted or removed")
    for sid in on_n1 & set(listed):
        assert Sandbox.connect(sid, **api2.sdk()).commands.run("echo adopted").stdout == "adopted\n"
    print(f"[e2e] after n1's return: {len(on_n1 & set(listed))} of its {len(on_n1)} sandboxes adopted, "
          f"the rest removed")
    live_n1, live_n2 = _live_on("n1"), _live_on("n2")
    assert not live_n1 & live_n2, f"live on both nodes: {sorted(live_n1 & live_n2)}"
    for sid, node in listed.items():
        assert _cgroup_on(sid, node), f"{sid} listed on {node} has no cgroup there"
        other = "n2" if node == "n1" else "n1"
        assert not _cgroup_on(sid, other), f"{sid} listed on {node} also lives on {other}"

    # Creates spread over both again, once both run as many sandboxes (n2 took every create
    # while n1 was away, and placement goes by headroom).
    per_node = {"n1": [], "n2": []}
    for sid, node in fleet.running("api1").items():
        per_node[node].append(sid)
    fuller = max(per_node, key=lambda n: len(per_node[n]))
    for sid in sorted(per_node[fuller])[: len(per_node[fuller]) - min(len(v) for v in per_node.values())]:
        Sandbox.kill(sid, **api2.sdk())
        fleet.sandboxes.pop(sid, None)
    # Both nodes report their headroom again (every 2 s) after the kills: on one kernel the
    # memory both see is the same, and a report from before the kills would show less.
    time.sleep(3)
    more = _run_all(list(range(8)), lambda i: Sandbox.create(template="base", timeout=120, **api1.sdk()), workers=4)
    for s in more:
        fleet.sandboxes[s.sandbox_id] = s
    assert {fleet.node_of(s.sandbox_id) for s in more} == {"n1", "n2"}


def _template_on_disk(node: str, alias: str, cluster) -> bool:
    """Whether `node` reports the template named `alias` (or of that id) among those whose
    layers it holds."""
    template_id = cluster.pg.psql(f"SELECT template_id FROM template_aliases WHERE alias = '{alias}'") or alias
    report = json.loads(cluster.pg.psql(f"SELECT report FROM nodes WHERE id = '{node}'") or "{}")
    return template_id in (report.get("templates") or [])


def _live_on(node: str) -> Set[str]:
    """Sandbox cgroups (with processes) under the node's machine: what really runs there."""
    out = set()
    for rel in cl.cgroup_hierarchies():
        parent = (cl.CGROUP_ROOT / rel if rel else cl.CGROUP_ROOT) / (cl.PREFIX + node) / "sandbar"
        if parent.is_dir():
            out.update(d.name for d in parent.iterdir() if d.is_dir() and read_or_empty(d / "cgroup.procs").strip())
    return out


def _cgroup_on(sid: str, node: str) -> bool:
    return sid in _live_on(node)


@needs_roles
def test_a_snapshot_with_memory_starts_on_every_node(cluster, fleet):
    from e2b import Sandbox

    api1 = cluster["api1"]
    source = Sandbox.create(template="base", timeout=120, **api1.sdk())
    fleet.sandboxes[source.sandbox_id] = source
    origin = fleet.node_of(source.sandbox_id)
    other = "n1" if origin == "n2" else "n2"
    source.files.write("/home/user/keeper.sh", MEMORY_KEEPER)
    source.commands.run("sh /home/user/keeper.sh", background=True)
    wait_until(lambda: source.commands.run("test -s /home/user/keeper.pid").exit_code == 0, timeout=10,
               message="the keeper to start")
    keeper_pid = source.files.read("/home/user/keeper.pid").strip()
    checkpoints = lambda: cluster.pg.psql("SELECT layer FROM layer_blobs WHERE layer LIKE 'checkpoint/%'").split()
    before = set(checkpoints())
    snapshot = source.create_snapshot()
    try:
        # Once recorded, its origin publishes its layer and checkpoint in the background.
        wait_until(lambda: set(checkpoints()) - before, timeout=30, interval=0.3,
                   message="the snapshot's checkpoint to reach the layer store")
        # Asked directly, the other node fetches both and restores the snapshot's processes.
        t0 = time.monotonic()
        r = httpx.post(cluster[other].url + "/v2/sandboxes", json={"templateID": snapshot.snapshot_id, "timeout": 60},
                       headers={**_node_secret(cluster), "X-API-Key": cl.API_KEY}, timeout=120)
        assert r.status_code == 201, r.text
        print(f"\n[e2e] snapshot restored on the node that did not take it in {time.monotonic() - t0:.2f}s")
        copy = Sandbox.connect(r.json()["sandboxID"], **api1.sdk())
        fleet.sandboxes[copy.sandbox_id] = copy
        assert fleet.node_of(copy.sandbox_id) == other
        assert copy.commands.run(f"kill -USR1 {keeper_pid}").exit_code == 0
        wait_until(lambda: copy.commands.run("test -s /home/user/told").exit_code == 0, timeout=10,
                   message="the restored keeper to answer")
        assert copy.files.read("/home/user/told") == source.files.read("/home/user/expected")
        copy.kill()
        fleet.sandboxes.pop(copy.sandbox_id, None)
    finally:
        source.kill()
        fleet.sandboxes.pop(source.sandbox_id, None)
        Sandbox.delete_snapshot(snapshot.snapshot_id.split(":")[0], **api1.sdk())

    # Deleted, the snapshot's checkpoint leaves the layer store: its record, then the tag that
    # kept its blob; what templates still name stays.
    published = set(checkpoints()) - before
    wait_until(lambda: not published & set(checkpoints()), timeout=30, interval=0.5,
               message="the deleted snapshot's records to be collected")
    recorded = lambda: set(cluster.pg.psql("SELECT DISTINCT digest FROM layer_blobs").split())

    def tags() -> set:
        r = httpx.get(f"http://{cl.BRIDGE_ADDR}:{cl.LAYER_REGISTRY_PORT}/v2/sandbar/layers/tags/list", timeout=10)
        assert r.status_code == 200, r.text
        return {"sha256:" + t.removeprefix("sha256-") for t in r.json().get("tags") or [] if t.startswith("sha256-")}

    wait_until(lambda: tags() <= recorded(), timeout=30, interval=0.5,
               message="the tags of blobs no record names to be deleted")
    assert recorded() <= tags(), "a blob a record names lost its tag"


@needs_roles
def test_a_node_fetches_ahead_the_templates_others_run(cluster):
    """A template built by one node and run there only: the other node fetches its layers
    from the layer store within a pass or two of its fetch-ahead task (every 15 s), before
    any create of it reaches that node."""
    from e2b import Template

    name = f"ahead-{uuid.uuid4().hex[:8]}"
    sdk = {k: v for k, v in cluster["api1"].sdk().items() if k != "sandbox_url"}
    Template.build(Template().from_template("base").run_cmd(f"echo {name} > /etc/ahead", user="root"), name, **sdk)
    holders = wait_until(lambda: [n for n in ("n1", "n2") if _template_on_disk(n, name, cluster)], timeout=10,
                         interval=0.5, message="the building node to report the template")
    assert len(holders) == 1, f"both nodes held {name} before any sandbox of it ran"
    builder, other = holders[0], ({"n1", "n2"} - set(holders)).pop()
    # Straight to the builder, so that no create of it reaches the other node.
    headers = {"X-API-Key": cl.API_KEY, **_node_secret(cluster)}
    with httpx.Client(base_url=cluster[builder].url, headers=headers, timeout=60) as node:
        r = node.post("/sandboxes", json={"templateID": name, "timeout": 60})
        assert r.status_code == 201, f"create on {builder}: {r.status_code} {r.text}"
        sid = r.json()["sandboxID"]
        try:
            t0 = time.monotonic()
            wait_until(lambda: _template_on_disk(other, name, cluster), timeout=45, interval=0.5,
                       message=f"{other} to fetch {name} ahead")
            print(f"\n[e2e] {other} held {name}, run on {builder} only, {time.monotonic() - t0:.1f}s after its create")
            log = cluster[other].log_path.read_text(errors="replace")
            assert "fetched a template's layers ahead of its creates" in log
        finally:
            node.delete(f"/sandboxes/{sid}")


@needs_roles
def test_a_node_refuses_requests_without_the_secret(cluster, fleet):
    node = cluster["n2"]
    sid = sorted(fleet.sandboxes)[0]
    for headers in ({}, {cl.SECRET_HEADER: "not-" + cluster.secret}, {cl.SECRET_HEADER: ""}):
        for path, extra in (("/health", {}), ("/sandboxes", {"X-API-Key": cl.API_KEY}),
                            ("/v2/sandboxes", {"X-API-Key": cl.API_KEY}),
                            ("/", {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})):
            r = httpx.get(node.url + path, headers={**headers, **extra}, timeout=10)
            assert r.status_code == 401, f"{path} with {headers or 'no secret'}: {r.status_code} {r.text[:200]}"
    r = httpx.get(node.url + "/health", headers=_node_secret(cluster), timeout=10)
    assert r.status_code in (200, 204)
    took = time.monotonic() - cluster.ready_at
    assert took < BUDGET_S, f"the cluster tests took {took:.0f}s once the nodes were up"


def _team(c: cl.Cluster, name: str) -> dict:
    done = subprocess.run(
        [str(SANDBAR_BIN), "team", "create", f"{name}-{uuid.uuid4().hex[:8]}", "--requests-per-minute", "0",
         "--database-url", c.pg.url, "--data-dir", str(c["api1"].data_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, f"sandbar team create: {done.stderr}"
    return json.loads(done.stdout)


def _build_node(c: cl.Cluster, build_id: str) -> str:
    return c.pg.psql(f"SELECT node_id FROM template_builds WHERE id = '{build_id}'")


@needs_roles
def test_a_build_goes_to_the_node_with_a_free_build_slot(cluster, tmp_path):
    """Each node has one build slot: team A's endless build takes one node's; team B's build,
    which copies a file, is given the other node and is ready within a minute, and a sandbox
    of it sees the file. A's build is cancelled through an API host at the end."""
    from e2b import Sandbox, Template

    api1 = cluster["api1"]
    hog, copier = _team(cluster, "hog"), _team(cluster, "copier")
    a = httpx.Client(base_url=api1.url, headers={"X-API-Key": hog["apiKey"]}, timeout=60)
    made = []
    hog_build = None
    try:
        r = a.post("/v3/templates", json={"name": f"hog-{uuid.uuid4().hex[:8]}"})
        assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
        hog_template, hog_build = r.json()["templateID"], r.json()["buildID"]
        made.append((a, hog_template))
        r = a.post(f"/v2/templates/{hog_template}/builds/{hog_build}",
                   json={"fromTemplate": "base", "steps": [{"type": "RUN", "args": ["sleep 100000"], "force": True}]})
        assert r.status_code == 202, f"start of the endless build: {r.status_code} {r.text}"
        hog_node = _build_node(cluster, hog_build)
        assert hog_node in ("n1", "n2"), hog_node

        def hog_runs() -> bool:
            report = cluster.pg.psql(f"SELECT report FROM nodes WHERE id = '{hog_node}'")
            return '"running":1' in report.replace(" ", "")

        wait_until(hog_runs, timeout=30, interval=0.3, message=f"{hog_node} to report the endless build running")

        ctx = tmp_path / "ctx"
        ctx.mkdir()
        marker = uuid.uuid4().hex
        (ctx / "copied.txt").write_text(marker + "\n")
        alias = f"copier-{uuid.uuid4().hex[:8]}"
        sdk = {"api_url": api1.url, "api_key": copier["apiKey"], "domain": cl.DOMAIN}
        outcome: dict = {}
        done = threading.Event()

        def build():
            try:
                outcome["built"] = Template.build(
                    Template(file_context_path=str(ctx)).from_template("base")
                    .copy("copied.txt", "/home/user/copied.txt"),
                    alias, **sdk)
            except BaseException as e:  # noqa: BLE001 - handed to the test
                outcome["error"] = e
            finally:
                done.set()

        # In a thread of its own: a build queued behind the endless one would never end.
        t0 = time.monotonic()
        threading.Thread(target=build, daemon=True, name="copier-build").start()
        assert done.wait(60), "the other team's build was not ready within 60s"
        took = time.monotonic() - t0
        assert "error" not in outcome, f"the other team's build failed: {outcome['error']!r}"
        built = outcome["built"]
        print(f"\n[e2e] the other team's build was ready in {took:.1f}s")
        made.append((httpx.Client(base_url=api1.url, headers={"X-API-Key": copier["apiKey"]}, timeout=60),
                     built.template_id))
        copier_node = _build_node(cluster, built.build_id)
        assert copier_node in ("n1", "n2") and copier_node != hog_node, \
            f"the endless build is on {hog_node}, the other team's went to {copier_node!r}"

        sbx = Sandbox.create(template=alias, timeout=60, **sdk, sandbox_url=api1.url)
        try:
            assert sbx.commands.run("cat /home/user/copied.txt").stdout == marker + "\n"
        finally:
            sbx.kill()

        s = a.get(f"/templates/{hog_template}/builds/{hog_build}/status").json()
        assert s["status"] == "building", s
        r = a.delete(f"/templates/{hog_template}/builds/{hog_build}")
        assert r.status_code == 204, f"cancel of the endless build: {r.status_code} {r.text}"
        assert a.get(f"/templates/{hog_template}/builds/{hog_build}/status").json()["status"] == "error"
    finally:
        if hog_build is not None:
            a.delete(f"/templates/{hog_template}/builds/{hog_build}")
        for client, template_id in made:
            client.delete(f"/templates/{template_id}")
        for client, _ in made:
            client.close()
        a.close()


def _dashboard_session(client: httpx.Client, key: str) -> str:
    """Signs in to the dashboard with `key`; the CSRF token of the session's pages."""
    r = client.post("/dashboard/login", data={"key": key}, follow_redirects=False)
    assert r.status_code == 303 and "sandbar_dashboard" in client.cookies, f"sign-in: {r.status_code} {r.text[:200]}"
    page = client.get("/dashboard/").text
    return re.search(r'X-CSRF-Token&quot;:&quot;([0-9a-f]+)', page).group(1)


@needs_roles
def test_the_dashboard_on_an_api_host_reaches_the_nodes(cluster, fleet, browser):
    """Through an API host, the dashboard lists the nodes, and a sandbox's page, its terminal
    (a WebSocket), a create and a kill are carried to the nodes with the session the API host
    checked; a client's own vouching headers never reach a node."""
    api1 = cluster["api1"]
    other = _team(cluster, "dash-other")
    # One of the fleet's sandboxes on each node.
    on = {}
    for sid in fleet.sandboxes:
        on.setdefault(fleet.node_of(sid), sid)
        if len(on) == 2:
            break
    assert set(on) == {"n1", "n2"}, f"the fleet is on {sorted(on)} only"

    context = browser.new_context(base_url=api1.url)
    page = context.new_page()
    page.set_default_timeout(20_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    created = None
    try:
        page.goto("/dashboard/login")
        page.fill("#key", cl.API_KEY)
        page.click("button[type=submit]")
        page.wait_for_url(re.compile(r"/dashboard/$"))

        page.goto("/dashboard/nodes")
        for node in ("n1", "n2"):
            row = page.locator(f"tr[data-node='{node}']")
            assert row.locator(".node-state").inner_text().startswith("live"), row.inner_text()
            assert int(row.locator(".node-sandboxes").inner_text()) >= 1, row.inner_text()
        assert "base" in page.locator("tr[data-node='n1'] .node-templates").inner_text()
        page.screenshot(path=str(LOG_DIR / "dashboard" / "cluster-nodes.png"), full_page=True)

        # A sandbox on each node: its page comes from that node, and its terminal runs there.
        for node, sid in sorted(on.items()):
            page.goto(f"/dashboard/sandboxes/{sid}")
            assert page.locator("#sandbox-state").inner_text() == "running"
            page.click("#open-terminal")
            wait_js(page, "document.querySelector('#terminal').dataset.connected === '1'", 30)
            page.click("#terminal")
            page.keyboard.type(f"echo {node}-$((6*7)) > /tmp/dash; cat /tmp/dash\n")
            wait_js(page, f"document.querySelector('#terminal .xterm-rows').textContent.includes('{node}-42')")
            assert fleet.sandboxes[sid].files.read("/tmp/dash") == f"{node}-42\n"

        # Created from the page: placed on a node, then killed from its page.
        page.goto("/dashboard/sandboxes")
        page.click("#create summary")
        page.fill("#create-form input[name=timeout]", "120")
        page.click("#create-form button[type=submit]")
        page.wait_for_url(re.compile(r"/dashboard/sandboxes/[a-z0-9]+$"), timeout=60_000)
        created = page.url.rsplit("/", 1)[1]
        assert fleet.node_of(created) in ("n1", "n2")
        assert page.locator("#sandbox-state").inner_text() == "running"
        page.click("#kill")
        page.wait_for_url(re.compile(r"/dashboard/sandboxes$"))
        with api1.client() as api:
            assert api.get(f"/sandboxes/{created}").status_code == 404
        created = None
        assert errors == []
    finally:
        if created:
            with api1.client() as api:
                api.delete(f"/sandboxes/{created}")
        context.close()

    # Another team's session, with the first team's key in the headers a node would trust:
    # the API host replaces them with its own session's, so the node finds no such sandbox.
    sid = next(iter(on.values()))
    forged = {"x-sandbar-dashboard-credential": cl.API_KEY, "x-sandbar-dashboard-session": "x",
              "x-sandbar-dashboard-csrf": "x"}
    with httpx.Client(base_url=api1.url, timeout=30) as client:
        csrf = _dashboard_session(client, other["apiKey"])
        r = client.get(f"/dashboard/sandboxes/{sid}", headers=forged)
        assert r.status_code == 404, f"another team's session saw the sandbox: {r.status_code} {r.text[:300]}"
        r = client.post(f"/dashboard/sandboxes/{sid}/kill", headers={**forged, "x-csrf-token": csrf})
        assert r.status_code == 404, f"another team's session killed the sandbox: {r.status_code} {r.text[:300]}"
        # A forged CSRF token is refused on the API host, before any node hears of it.
        r = client.post(f"/dashboard/sandboxes/{sid}/kill", headers={"x-csrf-token": "0" * 64})
        assert r.status_code == 403, f"{r.status_code} {r.text[:300]}"
    # Without a session: nothing is forwarded.
    r = httpx.get(f"{api1.url}/dashboard/sandboxes/{sid}", headers=forged, timeout=30)
    assert r.status_code == 401, f"{r.status_code} {r.text[:300]}"
    assert fleet.sandboxes[sid].is_running()
