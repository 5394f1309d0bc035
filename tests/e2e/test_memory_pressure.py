"""Sandboxes that together use more memory than the host has.

Four sandboxes with 8 GiB limits fill the host's available memory until less than the
server's reserve is left: new sandboxes are refused with 503 while the server, every agent and
`/health` keep answering. One more allocation pushes the host past its memory: the kernel's
OOM killer picks a sandbox process (they run at `oom_score_adj` 800, agents and the server at
0 or below), never anything else; the sandbox's agent lives on and the sandbox's log says what
happened. Once the memory is back, creates work again.

The test only allocates what the host had available when it began (less half a GiB), and the
push is 1.5 GiB: no swap storm, and the kernel has a sandbox process to kill long before anything
of the host's.
"""

from __future__ import annotations

import re
import secrets
import subprocess
import time
from pathlib import Path

import httpx
from e2b import Sandbox, Template

from e2e_util import CREATED_IDS, wait_until

HOGS = 4
LIMIT_MIB = 8192
# Allocates in 64 MiB steps (bytes objects: every page is written) up to argv[1] MiB, says
# so in /tmp/held, and holds the memory.
HOG = (
    "python3 -c \"import sys, time; target = int(sys.argv[1]); chunks = []\n"
    "while len(chunks) * 64 < target: chunks.append(b'x' * (64 << 20))\n"
    "open('/tmp/held', 'w').write(str(len(chunks) * 64)); time.sleep(3600)\" {mib}"
)
# The host-wide OOM killer; a sandbox at its own limit is "Memory cgroup out of memory".
KILLED = re.compile(r"^[^:]*\] Out of memory: Killed process (\d+) \(([^)]*)\)", re.M)


def available_mib() -> int:
    meminfo = Path("/proc/meminfo").read_text()
    return int(next(l for l in meminfo.splitlines() if l.startswith("MemAvailable:")).split()[1]) // 1024


def sandbox_pids(sandbox_id: str) -> set[int]:
    procs = Path(f"/sys/fs/cgroup/pids/sandbar/{sandbox_id}/cgroup.procs")
    if not procs.exists():
        procs = Path(f"/sys/fs/cgroup/sandbar/{sandbox_id}/cgroup.procs")
    return {int(p) for p in procs.read_text().split()}


def kernel_kills_since(mark: str) -> list[tuple[int, str]]:
    log = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    after = log.split(mark, 1)[1] if mark in log else ""
    return [(int(pid), name) for pid, name in KILLED.findall(after)]


def test_host_memory_pressure_kills_only_inside_sandboxes(sandbar):
    headers = {"X-API-Key": sandbar.api_key}
    name = "e2e-pressure-" + secrets.token_hex(4)
    built = Template.build(Template().from_template("base"), name, memory_mb=LIMIT_MIB, cpu_count=1)
    hogs: list[Sandbox] = []
    try:
        for _ in range(HOGS):
            sbx = Sandbox.create(name, timeout=300)
            CREATED_IDS.add(sbx.sandbox_id)
            hogs.append(sbx)
        agents = {sbx.sandbox_id: min(sandbox_pids(sbx.sandbox_id)) for sbx in hogs}

        # Fill the host to half a GiB of available memory, below the server's reserve.
        share = (available_mib() - 512) // HOGS
        push = 1536
        assert share + push + 256 < LIMIT_MIB, f"the host has more memory than {HOGS} sandboxes can fill ({share} MiB each)"
        for sbx in hogs:
            sbx.commands.run(HOG.format(mib=share), background=True, timeout=0)
        for sbx in hogs:
            wait_until(lambda: sbx.files.exists("/tmp/held"), timeout=120, message="a sandbox holding its share")

        r = httpx.post(sandbar.url + "/sandboxes", headers=headers, json={"templateID": "base"}, timeout=60)
        if r.status_code == 201:
            CREATED_IDS.add(r.json()["sandboxID"])
        assert r.status_code == 503, f"a create was admitted with {available_mib()} MiB available: {r.text}"
        assert "memory" in r.json()["message"], r.text
        assert int(r.headers["retry-after"]) > 0
        assert httpx.get(sandbar.url + "/health", timeout=10).status_code in (200, 204)

        # Past the host's memory though within the sandbox's limit: the kernel must kill, and
        # only inside a sandbox.
        owner = {
            pid: sbx.sandbox_id
            for sbx in hogs
            for pid in sandbox_pids(sbx.sandbox_id)
            if pid != agents[sbx.sandbox_id]
        }
        mark = f"sandbar-e2e-pressure-{secrets.token_hex(4)}"
        Path("/dev/kmsg").write_text(mark + "\n")
        hogs[0].commands.run(
            f"python3 -c \"b = b'x' * ({push} << 20); import time; time.sleep(60)\"", background=True, timeout=0
        )
        kills = wait_until(lambda: kernel_kills_since(mark), timeout=60, message="the OOM killer acting")
        assert {pid for pid, _ in kills} <= set(owner), f"the OOM killer took a process outside the sandboxes: {kills}"

        assert sandbar.proc.poll() is None, "the server died"
        assert httpx.get(sandbar.url + "/health", timeout=10).status_code in (200, 204)
        for sbx in hogs:
            assert Path(f"/proc/{agents[sbx.sandbox_id]}").exists(), f"the agent of {sbx.sandbox_id} died"
            assert sbx.commands.run("echo alive").stdout == "alive\n"

        # The victims' logs say what happened (the kernel's count, sampled every few seconds).
        for victim in {owner[pid] for pid, _ in kills}:
            def logged():
                r = httpx.get(f"{sandbar.url}/v2/sandboxes/{victim}/logs", headers=headers, timeout=30)
                assert r.status_code == 200, r.text
                return [e["message"] for e in r.json()["logs"] if "out of memory" in e["message"]]

            wait_until(logged, timeout=30, message=f"an out-of-memory line in the log of {victim}")

        # Memory back: creates work again.
        for sbx in hogs:
            sbx.commands.run("pkill python3; true", timeout=30)
        wait_until(lambda: available_mib() > 2048, timeout=60, message="the host's memory back")
        r = wait_until(
            lambda: (resp := httpx.post(sandbar.url + "/sandboxes", headers=headers,
                                        json={"templateID": "base"}, timeout=60)).status_code == 201 and resp,
            timeout=30,
            message="a create admitted again",
        )
        CREATED_IDS.add(r.json()["sandboxID"])
        httpx.delete(f"{sandbar.url}/sandboxes/{r.json()['sandboxID']}", headers=headers, timeout=60)
    finally:
        for sbx in hogs:
            httpx.delete(f"{sandbar.url}/sandboxes/{sbx.sandbox_id}", headers=headers, timeout=60)
        httpx.delete(f"{sandbar.url}/templates/{built.template_id}", headers=headers, timeout=60)

