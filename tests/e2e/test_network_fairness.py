"""Network fairness: each sandbox's bandwidth is shaped on both ends of its veth pair, sandbox
root cannot remove the shaping, and floods out of or into sandboxes are held to the configured
rate while the API and new sandboxes keep working.

The only peer is a network namespace this module creates (`sbtest-nf-*`) that stands in for the
internet: it counts what it receives on one address of the retired 6to4 relay range (reached
through a /32 route the fixture adds, checks and removes) and sends as fast as it can to a
client that asks it to. Nothing is sent anywhere else, and every flood stops by itself.

Rates are compared with the rate the server configured (read from the qdisc on the host end of
a sandbox's veth pair) with a generous margin; nothing here times latency.
"""

import re
import time
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException

from e2e_util import running_in_namespace, sh, stand_in_internet, wait_until
from netflood import FLOOD, SINK

SINK_ADDR = "192.88.99.31"
# How far above the configured rate a measured rate may be: the bucket lets a burst through at
# full speed, and the two clocks the counts are read against are not the shaper's.
MARGIN = 1.5
FLOOD_SECS = 8
# Not on an ordinary user's PATH.
TC = "/usr/sbin/tc"

@pytest.fixture(scope="module")
def internet():
    """A namespace counting what reaches SINK_ADDR, through a /32 host route; removed at the end."""
    with stand_in_internet("sbtest-nf-", "sbtf", "10.253", (SINK_ADDR,), "sbtest-nf-") as (ns, port, workdir):
        state = Path(workdir, "counts")
        with running_in_namespace(ns, ["python3", "-c", SINK, str(port), str(state)]):
            wait_until(state.exists, timeout=10, message="the sink to start")
            yield {"port": port, "state": state}


def counts(internet):
    """(sink clock, UDP bytes, TCP bytes) received so far."""
    t, udp, tcp = internet["state"].read_text().split()
    return float(t), int(udp), int(tcp)


def host_link(sbx):
    """The host end of the sandbox's veth pair: the link holding the address below its own."""
    inside = sbx.commands.run("ip -o -4 addr show eth0").stdout.split()[3].split("/")[0]
    a, b, c, d = (int(x) for x in inside.split("."))
    gateway = f"{a}.{b}.{c}.{d - 1}"
    for line in sh("ip", "-o", "-4", "addr", "show").stdout.splitlines():
        fields = line.split()
        if fields[3].split("/")[0] == gateway:
            return fields[1].split("@")[0]
    raise AssertionError(f"no host link holds {gateway}")


_UNITS = {"bit": 1, "Kbit": 10**3, "Mbit": 10**6, "Gbit": 10**9}


def tbf(text):
    """Rate (bit/s) and overlimits of the tbf in `tc -s qdisc show` output, or None."""
    m = re.search(r"qdisc tbf \S+ root .*?rate (\d+(?:\.\d+)?)(bit|Kbit|Mbit|Gbit)", text)
    if not m:
        return None
    over = re.search(r"overlimits (\d+)", text[m.end():])
    return float(m.group(1)) * _UNITS[m.group(2)], int(over.group(1)) if over else 0


def inside_tbf(sbx):
    return tbf(sbx.commands.run(f"{TC} -s qdisc show dev eth0").stdout)


def host_tbf(link):
    return tbf(sh("tc", "-s", "qdisc", "show", "dev", link).stdout)


def configured_rate(sbx):
    shaped = host_tbf(host_link(sbx))
    assert shaped, "the host end of the sandbox's veth has no tbf: is --sandbox-bandwidth-mbit 0?"
    return shaped[0]


def start_flood(sbx, internet, kind):
    sbx.files.write("/tmp/flood.py", FLOOD)
    cmd = f"python3 /tmp/flood.py {kind} {SINK_ADDR} {internet['port']} {FLOOD_SECS}"
    return sbx.commands.run(cmd, background=True, timeout=FLOOD_SECS + 60)


def test_sandbox_root_cannot_remove_its_shaping(sandbox):
    rate = configured_rate(sandbox)
    assert inside_tbf(sandbox)[0] == rate, "eth0 inside is shaped at the host end's rate"
    for cmd in (
        f"sudo {TC} qdisc del dev eth0 root",
        f"sudo {TC} qdisc replace dev eth0 root pfifo",
        f"sudo {TC} qdisc change dev eth0 root tbf rate 10gbit burst 1mb latency 1ms",
    ):
        r = sandbox.commands.run(f"{cmd} 2>&1; echo rc=$?", user="user")
        assert "rc=0" not in r.stdout, f"sandbox root could run '{cmd}': {r.stdout}"
    try:
        sandbox.commands.run(f"{TC} qdisc del dev eth0 root", user="root")
        raise AssertionError("root removed the qdisc")
    except CommandExitException as e:
        assert "Operation not permitted" in e.stderr, e.stderr
    assert inside_tbf(sandbox)[0] == rate, "the qdisc is still there, unchanged"


def test_floods_out_are_held_to_the_rate_while_the_server_answers(make_sandbox, sandbar, internet):
    udp_sbx, tcp_sbx = make_sandbox(), make_sandbox()
    rate = configured_rate(udp_sbx)
    before = {name: inside_tbf(s)[1] for name, s in (("udp", udp_sbx), ("tcp", tcp_sbx))}
    floods = [start_flood(udp_sbx, internet, "udp"), start_flood(tcp_sbx, internet, "tcp")]
    try:
        time.sleep(1.5)
        t0, udp0, tcp0 = counts(internet)
        # While both flood: the API answers, and a new sandbox starts and runs a command.
        assert httpx.get(f"{sandbar.url}/health", timeout=30).status_code in (200, 204)
        fresh = make_sandbox()
        assert fresh.commands.run("echo ready", timeout=60).stdout == "ready\n"
        time.sleep(max(0.0, 3.0 - (time.monotonic() - t0)))
        t1, udp1, tcp1 = counts(internet)
    finally:
        for flood in floods:
            try:
                flood.wait()
            except CommandExitException:
                pass
    udp_rate = (udp1 - udp0) * 8 / (t1 - t0)
    tcp_rate = (tcp1 - tcp0) * 8 / (t1 - t0)
    limit = rate * MARGIN
    print(f"rate {rate / 1e6:.0f} Mbit/s: UDP flood {udp_rate / 1e6:.1f}, TCP flood {tcp_rate / 1e6:.1f}")
    assert udp_rate <= limit, f"UDP flood reached {udp_rate / 1e6:.0f} Mbit/s, limit {rate / 1e6:.0f}"
    assert tcp_rate <= limit, f"TCP flood reached {tcp_rate / 1e6:.0f} Mbit/s, limit {rate / 1e6:.0f}"
    assert udp1 > udp0 and tcp1 > tcp0, "both floods arrived"
    # Each flood pushed against its sandbox's shaper (otherwise the bound proves nothing).
    assert inside_tbf(udp_sbx)[1] > before["udp"], "the UDP flood never exceeded the rate"
    assert inside_tbf(tcp_sbx)[1] > before["tcp"], "the TCP flood never exceeded the rate"


def test_a_flood_into_a_sandbox_is_held_to_the_rate(make_sandbox, internet):
    sbx = make_sandbox()
    link = host_link(sbx)
    rate, before = host_tbf(link)
    sbx.files.write("/tmp/flood.py", FLOOD)
    cmd = f"python3 /tmp/flood.py download {SINK_ADDR} {internet['port']} 5"
    got, secs = sbx.commands.run(cmd, timeout=60).stdout.split()
    received = int(got) * 8 / float(secs)
    print(f"rate {rate / 1e6:.0f} Mbit/s: download {received / 1e6:.1f}")
    assert 0 < received <= rate * MARGIN, f"download at {received / 1e6:.0f} Mbit/s, limit {rate / 1e6:.0f}"
    assert host_tbf(link)[1] > before, "the download never exceeded the rate"

