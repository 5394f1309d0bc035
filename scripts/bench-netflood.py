#!/usr/bin/env python3
"""What sandboxes flooding the network do to the server and to new sandboxes, with each
sandbox's bandwidth shaped at one or more rates (0: shaping off).

    sudo python3 scripts/bench-netflood.py --bin target/release --data-dir /var/tmp/sandbar-bench \\
        [--rates 100,0] [--rounds 2] [--iterations 20]

For every round and rate it starts `BIN/sandbar serve --sandbox-bandwidth-mbit RATE` on a free
port of 127.0.0.1 with DATA_DIR (the `base` template is built on its first use), and runs these
scenarios in turn: idle, one sandbox flooding UDP, one flooding TCP, two flooding UDP, two
flooding TCP. A flooding sandbox runs a Python loop sending 1400-byte datagrams, or 64 KiB
writes on one TCP connection, as fast as it can to a network namespace this script makes
(`sbtest-nfb-*`, one address of the retired 6to4 relay range behind a /32 host route) where a
sink counts what arrives. Nothing is sent anywhere else; every flood ends when its sandbox is
killed at the end of its scenario, and the namespace and route are removed on exit.

In each scenario, after the floods run for a second:
- create→first output, `--iterations` times in a row (after one warm-up): `POST /v2/sandboxes`
  for `base`, then `process.Process/Start` of `bash -l -c 'echo ready'` through the edge until
  the first stdout event, as `Sandbox.create()` + `commands.run()` do; then `DELETE`;
- `GET /health` every 10 ms from another thread for as long;
- the rate the sink received, and the host's CPU over the scenario: all busy time, the part
  the kernel counted as softirq, the sandboxes' cgroups (`cpuacct`, v1) and the server.

It holds the e2e suite's machine-wide lock (`SANDBAR_E2E_LOCK`, default
`/var/tmp/sandbar-e2e.e2e-lock`) while it runs: two servers would share the firewall table.
Every sandbox it creates is killed before it exits.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import random
import secrets
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

SINK_ADDR = "192.88.99.41"
START_BODY = {"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo ready"]}, "stdin": False}
HZ = os.sysconf("SC_CLK_TCK")
SANDBOXES_CPUACCT = Path("/sys/fs/cgroup/cpuacct/sandbar/cpuacct.usage")

# The sink and the flood are the e2e suite's (tests/e2e/netflood.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
from netflood import FLOOD, SINK  # noqa: E402


def sh(*args, check=True):
    return subprocess.run(list(args), capture_output=True, text=True, check=check)


class Internet:
    """A namespace with a sink on SINK_ADDR, reached through a /32 route."""

    def __init__(self):
        routes = sh("ip", "-4", "route").stdout + sh("ip", "-4", "addr").stdout
        if SINK_ADDR in routes:
            raise SystemExit(f"{SINK_ADDR} is already routed on this host")
        free = [r for r in range(1, 255) if f"10.252.{r}." not in routes]
        r = random.choice(free)
        suffix = secrets.token_hex(3)
        self.ns = f"sbtest-nfb-{suffix}"
        self.host_if, ns_if = f"sbtbh{suffix}", f"sbtbn{suffix}"
        host_ip, ns_ip = f"10.252.{r}.1", f"10.252.{r}.2"
        self.port = random.randint(20000, 30000)
        self.dir = tempfile.mkdtemp(prefix="bench-netflood-")
        self.state = Path(self.dir, "counts")
        self.proc = None
        self.routed = False
        try:
            sh("ip", "netns", "add", self.ns)
            sh("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", ns_if)
            sh("ip", "link", "set", ns_if, "netns", self.ns)
            sh("ip", "addr", "add", f"{host_ip}/30", "dev", self.host_if)
            sh("ip", "link", "set", self.host_if, "up")
            sh("ip", "-n", self.ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
            sh("ip", "-n", self.ns, "link", "set", ns_if, "up")
            sh("ip", "-n", self.ns, "link", "set", "lo", "up")
            sh("ip", "-n", self.ns, "route", "add", "default", "via", host_ip)
            sh("ip", "-n", self.ns, "addr", "add", f"{SINK_ADDR}/32", "dev", "lo")
            sh("ip", "route", "add", f"{SINK_ADDR}/32", "via", ns_ip, "dev", self.host_if)
            self.routed = True
            got = sh("ip", "-4", "route", "get", SINK_ADDR).stdout
            if f"dev {self.host_if}" not in got:
                raise SystemExit(f"{SINK_ADDR} would not go to the bench namespace: {got}")
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.ns, "python3", "-c", SINK, str(self.port), str(self.state)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
            deadline = time.monotonic() + 10
            while not self.state.exists():
                if time.monotonic() > deadline:
                    raise SystemExit("the sink did not start")
                time.sleep(0.1)
        except BaseException:
            self.close()
            raise

    def counts(self):
        _, udp, tcp = self.state.read_text().split()
        return int(udp), int(tcp)

    def close(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.routed:
            sh("ip", "route", "del", f"{SINK_ADDR}/32", check=False)
            self.routed = False
        sh("ip", "netns", "del", self.ns, check=False)
        sh("ip", "link", "del", self.host_if, check=False)
        subprocess.run(["rm", "-rf", self.dir], check=False)


def envelope(message: dict) -> bytes:
    payload = json.dumps(message).encode()
    return b"\0" + struct.pack(">I", len(payload)) + payload


class Server:
    def __init__(self, bin_dir: Path, data_dir: Path, rate: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        credentials = data_dir / "credentials.json"
        env = dict(os.environ)
        if credentials.exists():
            self.key = json.loads(credentials.read_text())["apiKey"]
        else:
            self.key = "e2b_" + secrets.token_hex(20)
            env["SANDBAR_API_KEY"] = self.key
        self.log = tempfile.NamedTemporaryFile(prefix="bench-netflood-server-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [str(bin_dir / "sandbar"), "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", str(data_dir),
             "--sandbox-bandwidth-mbit", str(rate)],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self.api = httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, timeout=120)
        self.live: list[str] = []
        deadline = time.monotonic() + 1200
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited; see {self.log.name}")
            try:
                templates = self.api.get("/templates").json()
                if any(t.get("buildStatus") == "ready" and "base" in (t.get("aliases") or []) for t in templates):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the base template is not ready")
            time.sleep(0.5)
        time.sleep(2)

    def create(self) -> dict:
        r = self.api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
        if r.status_code != 201:
            raise SystemExit(f"create answered {r.status_code}: {r.text}")
        sandbox = r.json()
        self.live.append(sandbox["sandboxID"])
        return sandbox

    def start(self, sandbox: dict, body: dict) -> float:
        """Runs a process and returns seconds from the request to its first stdout."""
        headers = {
            "E2b-Sandbox-Id": sandbox["sandboxID"],
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": sandbox["envdAccessToken"],
            "Content-Type": "application/connect+json",
            "Connect-Protocol-Version": "1",
        }
        started = time.perf_counter()
        first = None
        out = b""
        buf = b""
        with self.api.stream("POST", "/process.Process/Start", content=envelope(body), headers=headers) as r:
            if r.status_code != 200:
                raise SystemExit(f"Start answered {r.status_code}")
            for chunk in r.iter_raw():
                buf += chunk
                while len(buf) >= 5:
                    flags, size = buf[0], struct.unpack(">I", buf[1:5])[0]
                    if len(buf) < 5 + size:
                        break
                    message, buf = json.loads(buf[5 : 5 + size]), buf[5 + size :]
                    if flags & 2:
                        if "error" in message:
                            raise SystemExit(f"Start ended with {message['error']}")
                        continue
                    data = message.get("event", {}).get("data", {}).get("stdout")
                    if data:
                        first = first or time.perf_counter() - started
                        out += base64.b64decode(data)
        if out != b"ready\n":
            raise SystemExit(f"unexpected output {out!r}")
        return first

    def kill(self, sandbox_id: str):
        self.api.delete(f"/sandboxes/{sandbox_id}")
        if sandbox_id in self.live:
            self.live.remove(sandbox_id)

    def close(self):
        for sandbox_id in list(self.live):
            try:
                self.kill(sandbox_id)
            except httpx.HTTPError:
                pass
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_snapshot(server_pid: int):
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]
    stat = open(f"/proc/{server_pid}/stat").read().rsplit(")", 1)[1].split()
    server = int(stat[11]) + int(stat[12])
    sandboxes = int(SANDBOXES_CPUACCT.read_text()) / 1e9 if SANDBOXES_CPUACCT.exists() else 0.0
    return time.monotonic(), busy / HZ, fields[6] / HZ, sandboxes, server / HZ


def health_sampler(url: str, stop: threading.Event, samples: list):
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            if client.get("/health").status_code not in (200, 204):
                raise SystemExit("/health failed")
            samples.append((time.perf_counter() - t) * 1000)
            stop.wait(0.01)


def scenario(server: Server, internet: Internet, floods: list, iterations: int) -> dict:
    flooders = []
    script = base64.b64encode(FLOOD.encode()).decode()
    for kind in floods:
        sandbox = server.create()
        cmd = (
            f"echo {script} | base64 -d > /tmp/flood.py && "
            f"(python3 /tmp/flood.py {kind} {SINK_ADDR} {internet.port} 600 </dev/null >/dev/null 2>&1 &) && echo ready"
        )
        server.start(sandbox, {"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}, "stdin": False})
        flooders.append(sandbox["sandboxID"])
    try:
        time.sleep(1.0)
        stop, health = threading.Event(), []
        sampler = threading.Thread(target=health_sampler, args=(server.url, stop, health), daemon=True)
        before, c0 = internet.counts(), cpu_snapshot(server.proc.pid)
        sampler.start()
        totals = []
        for i in range(iterations + 1):
            t = time.perf_counter()
            sandbox = server.create()
            server.start(sandbox, START_BODY)
            if i:
                totals.append((time.perf_counter() - t) * 1000)
            server.kill(sandbox["sandboxID"])
            time.sleep(0.05)
        stop.set()
        sampler.join()
        after, c1 = internet.counts(), cpu_snapshot(server.proc.pid)
    finally:
        for sandbox_id in flooders:
            server.kill(sandbox_id)
    dt = c1[0] - c0[0]
    return {
        "create": totals,
        "health": health,
        "udp_mbit": (after[0] - before[0]) * 8 / dt / 1e6,
        "tcp_mbit": (after[1] - before[1]) * 8 / dt / 1e6,
        "busy": (c1[1] - c0[1]) / dt,
        "softirq": (c1[2] - c0[2]) / dt,
        "sandboxes": (c1[3] - c0[3]) / dt,
        "server": (c1[4] - c0[4]) / dt,
    }


SCENARIOS = [
    ("idle", []),
    ("1 sandbox flooding UDP", ["udp"]),
    ("1 sandbox flooding TCP", ["tcp"]),
    ("2 sandboxes flooding UDP", ["udp", "udp"]),
    ("2 sandboxes flooding TCP", ["tcp", "tcp"]),
]


def pct(samples: list, q: float) -> float:
    samples = sorted(samples)
    return samples[min(len(samples) - 1, int(len(samples) * q))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", type=Path, required=True, help="directory holding sandbar and sandbar-agent")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--rates", default="100,0", help="Mbit/s per sandbox, comma-separated; 0 is off")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    rates = [int(r) for r in args.rates.split(",")]
    lock = open(os.environ.get("SANDBAR_E2E_LOCK") or "/var/tmp/sandbar-e2e.e2e-lock", "a+")
    print("waiting for the machine-wide lock", file=sys.stderr, flush=True)
    fcntl.flock(lock, fcntl.LOCK_EX)
    results: dict = {}
    internet = Internet()
    try:
        for round_ in range(1, args.rounds + 1):
            for rate in rates:
                server = Server(args.bin, args.data_dir, rate)
                try:
                    for name, floods in SCENARIOS:
                        load = open("/proc/loadavg").read().split()[0]
                        print(f"round {round_}, rate {rate or 'off'}: {name} (load {load})", file=sys.stderr, flush=True)
                        got = scenario(server, internet, floods, args.iterations)
                        into = results.setdefault((rate, name), {})
                        for key, value in got.items():
                            into.setdefault(key, []).extend(value if isinstance(value, list) else [value])
                finally:
                    server.close()
    finally:
        internet.close()
    print(f"\n{args.rounds} rounds, {args.iterations} creates per scenario and round; "
          "CPU in cores of the 2-core host, medians over rounds\n")
    print("| rate (Mbit/s) | scenario | create→first output p50 / p95 (ms) | /health p50 / p95 (ms) "
          "| received (Mbit/s) | host busy | softirq | sandboxes' cgroups | server |")
    print("|---|---|--:|--:|--:|--:|--:|--:|--:|")
    for rate in rates:
        for name, _ in SCENARIOS:
            r = results[(rate, name)]
            med = {k: statistics.median(r[k]) for k in ("udp_mbit", "tcp_mbit", "busy", "softirq", "sandboxes", "server")}
            received = med["udp_mbit"] + med["tcp_mbit"]
            print(f"| {rate or 'off'} | {name} | {statistics.median(r['create']):.1f} / {pct(r['create'], 0.95):.1f} "
                  f"| {statistics.median(r['health']):.2f} / {pct(r['health'], 0.95):.2f} | {received:.0f} "
                  f"| {med['busy']:.2f} | {med['softirq']:.2f} | {med['sandboxes']:.2f} | {med['server']:.2f} |")


if __name__ == "__main__":
    main()
