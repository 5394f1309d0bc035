"""Benchmark of a cluster on this one machine: what the API host's hop costs, and creates per
second with two nodes against one.

Builds the same machines as the cluster tests (`cluster.py`: two API hosts, two nodes, each
in its own network and mount namespace, PostgreSQL on a Unix socket) and runs
`sandbar-bench` three times:

1. through api1, both nodes live: create→first output at c=1 and rounds of concurrent ones;
2. against node n1 directly, with the cluster secret: the same without the API host's hop;
3. through api1 with n2 stopped: the rounds again, on one node.

All hosts share this machine's CPUs, so two nodes here cannot create faster than one with
the whole machine; the comparison shows what placement and the hop cost, not what a second
machine adds. Run as root from the repository's root, with nothing else using the machine:

    sudo python3 tests/e2e/bench_cluster.py [--iterations 30] [--rounds 5] [--concurrency 10]

With `--node-cpu C`, each node (and everything it starts) gets C cores of CPU time (a CFS
quota), so the nodes, not the API host, the database or the client, bound creates per second;
`--nodes N` (up to 3) starts N nodes (`--cold`: with no warm sandboxes, so every create
boots on its node, the work a node's CPU bounds), runs the rounds through the API host, then stops one
node at a time and runs them again: creates per second with N, N-1, ..., 1 nodes, by turns in
one run. This is how scaling with nodes is measured on one machine.

With `--one-cpu-per-node`, each node (and everything it starts) is confined to a CPU of its
own (n1 to CPU 0, n2 to CPU 1, cpuset cgroups) while the API host, PostgreSQL and the client
run on both, and the rounds run through the API host with both nodes and then with n1 alone:
the nearest this machine comes to two one-core machines against one, showing whether the
API host and the shared database let creates scale with nodes.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cluster as cl  # noqa: E402
from e2e_util import DATA_DIR, SANDBAR_BIN, acquire_run_lock  # noqa: E402

BENCH_BIN = SANDBAR_BIN.parent / "sandbar-bench"


def wait_node(c: cl.Cluster, node: cl.Host, timeout: float = 90) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            r = httpx.get(node.url + "/health", headers={cl.SECRET_HEADER: c.secret}, timeout=2)
            if r.status_code in (200, 204):
                return
        except httpx.HTTPError:
            pass
        if not node.running or time.monotonic() > deadline:
            raise RuntimeError(f"{node.name} did not come up\n" + node.log_tail())
        time.sleep(0.2)


def wait_base_template(api: cl.Host, timeout: float = 120) -> None:
    """The first node registers (or builds) `base` once it serves; the bench needs it ready."""
    deadline = time.monotonic() + timeout
    while True:
        with api.client() as client:
            r = client.get("/templates")
        if r.status_code == 200 and any(
            "base" in (t.get("aliases") or []) + (t.get("names") or []) and t.get("buildStatus") == "ready"
            for t in r.json()
        ):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("the base template did not become ready")
        time.sleep(0.5)


def bench(label: str, url: str, args, extra=()) -> None:
    print(f"\n## {label}\n", flush=True)
    cmd = [str(BENCH_BIN), "--api-url", url, "--api-key", cl.API_KEY, "--no-baseline",
           "--cpu-hogs", "0", "--idle", "0",
           "--iterations", str(args.iterations), "--rounds", str(args.rounds),
           "--concurrency", str(args.concurrency), *extra]
    print("$ " + " ".join(cmd).replace(cl.API_KEY, "$KEY"), flush=True)
    subprocess.run(cmd, check=True)


def pin_to_cpu(name: str, cpu: int) -> None:
    """Confines host `name` to CPU `cpu`, before it starts: its cpuset cgroup, made here, is
    kept by the harness, and the node's own cgroups inherit it."""
    parent = cl.CGROUP_ROOT / "cpuset"
    d = parent / (cl.PREFIX + name)
    d.mkdir(exist_ok=True)
    (d / "cpuset.mems").write_text((parent / "cpuset.mems").read_text().strip())
    (d / "cpuset.cpus").write_text(str(cpu))


# A third node for the scaling runs only (the tests' clusters have two): its own address,
# sandbox network and host id range, below the other nodes' (see NODE_SETTINGS).
cl.HOSTS.setdefault("n3", (f"{cl.SUBNET}.13", "node"))
cl.NODE_SETTINGS.setdefault("n3", {"id_base": 1 << 28, "network": "10.216.0.0/18"})


def limit_cpu(name: str, cores: float) -> None:
    """Gives host `name` (and every sandbox it starts, beneath it) `cores` of CPU time."""
    period = 100_000
    quota = max(1000, int(cores * period))
    if (cl.CGROUP_ROOT / "cgroup.controllers").exists():
        d = cl.CGROUP_ROOT / (cl.PREFIX + name)
        d.mkdir(exist_ok=True)
        (d / "cpu.max").write_text(f"{quota} {period}")
    else:
        d = cl.CGROUP_ROOT / "cpu" / (cl.PREFIX + name)
        d.mkdir(exist_ok=True)
        (d / "cpu.cfs_period_us").write_text(str(period))
        (d / "cpu.cfs_quota_us").write_text(str(quota))


def on_cluster(names, log_tag: str, work) -> int:
    """Runs `work(cluster)` on a cluster of `names` under the machine's run lock, then stops
    and removes everything; non-zero when something was left behind."""
    lock = acquire_run_lock(DATA_DIR)
    c = cl.Cluster(SANDBAR_BIN, names=names, log_tag=log_tag)
    try:
        c.open()
        status = work(c)
        for host in c.hosts.values():
            host.stop()
    finally:
        c.close()
        lock.close()
    found = cl.leaks()
    if found:
        print("left behind:\n  " + "\n  ".join(found))
        return 1
    return status


def scaling(args) -> int:
    names = [f"n{i}" for i in range(1, args.nodes + 1)]
    return on_cluster(("api1", *names), "bench-scaling", lambda c: measure_scaling(c, names, args))


def measure_scaling(c: cl.Cluster, names, args) -> int:
    for name in names:
        limit_cpu(name, args.node_cpu)
    for name in names:
        c[name].start(role="node")
        wait_node(c, c[name])
    c["api1"].start(role="api")
    c["api1"].wait_healthy(timeout=60)
    wait_base_template(c["api1"])
    c["api1"].wait_placement(set(names), timeout=60)
    live = list(names)
    while live:
        bench(f"Through the API host, {len(live)} node(s) of {args.node_cpu} cores each",
              c["api1"].url, args)
        if len(live) == 1:
            break
        c[live.pop()].stop()
        # Until its lease lapses the API host may still try the stopped node.
        time.sleep(12)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--one-cpu-per-node", action="store_true")
    parser.add_argument("--node-cpu", type=float, default=0.0,
                        help="cores of CPU time each node gets; with --nodes, measures scaling")
    parser.add_argument("--nodes", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--cold", action="store_true",
                        help="nodes keep no warm sandboxes: every create boots on its node")
    args = parser.parse_args()
    if args.cold:
        at = cl.NODE_FLAGS.index("--warm-pool") + 1
        cl.NODE_FLAGS[at] = "0"
    if args.node_cpu > 0:
        if not BENCH_BIN.exists():
            print(f"build it first: cargo build --release -p sandbar-bench ({BENCH_BIN} is missing)")
            return 1
        return scaling(args)
    pinned = args.one_cpu_per_node
    del args.one_cpu_per_node
    if not BENCH_BIN.exists():
        print(f"build it first: cargo build --release -p sandbar-bench ({BENCH_BIN} is missing)")
        return 1
    if pinned and "cpuset" not in (cl.cgroup_hierarchies() or []):
        print("--one-cpu-per-node needs the cgroup v1 cpuset hierarchy")
        return 1
    return on_cluster(("api1", "n1", "n2"), "bench", lambda c: measure_two(c, pinned, args))


def measure_two(c: cl.Cluster, pinned: bool, args) -> int:
    if pinned:
        pin_to_cpu("n1", 0)
        pin_to_cpu("n2", 1)
    c["n1"].start(role="node")
    wait_node(c, c["n1"])
    c["n2"].start(role="node")
    c["api1"].start(role="api")
    wait_node(c, c["n2"])
    c["api1"].wait_healthy(timeout=60)
    wait_base_template(c["api1"])
    c["api1"].wait_placement({"n1", "n2"}, timeout=60)
    bench("Through the API host, two nodes", c["api1"].url, args)
    if not pinned:
        bench("Node n1 directly (no API host)", c["n1"].url, args,
              ["--header", f"{cl.SECRET_HEADER}: {c.secret}"])
    c["n2"].stop()
    # Until its lease lapses the API host still tries n2 first for some creates.
    time.sleep(12)
    bench("Through the API host, one node (n2 stopped)", c["api1"].url, args)
    return 0

if __name__ == "__main__":
    sys.exit(main())
