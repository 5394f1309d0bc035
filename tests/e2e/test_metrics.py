"""Sandbox metrics as the SDK reads them: real samples of the sandbox's cgroups and disk; the
server's Prometheus metrics only to a scrape with the operator's token (the suite's servers
run with `SANDBAR_METRICS_TOKEN`)."""

from __future__ import annotations

import json

from e2b import Sandbox

from e2e_util import METRICS_HEADERS, wait_until
from test_js_templates import cli  # noqa: F401 - the npm CLI fixture


def test_busy_sandbox_shows_cpu_and_idle_one_does_not(sandbar, make_sandbox):
    busy = make_sandbox()
    idle = make_sandbox()
    busy.commands.run("sh -c 'while :; do :; done'", background=True)
    # sync: disk usage is counted at the filesystem's next commit, which this forces.
    busy.commands.run("head -c 20000000 /dev/urandom > /home/user/blob && sync", timeout=60)

    def hot():
        points = busy.get_metrics()
        if points and points[-1].cpu_used_pct > 15 and points[-1].disk_used >= 20_000_000:
            return points
        return None

    points = wait_until(hot, timeout=30, message="a busy sample")
    last = points[-1]
    assert last.cpu_count >= 1
    assert last.mem_total > 0 and 0 < last.mem_used < last.mem_total
    assert last.disk_total > 0 and last.disk_used >= 20_000_000, last

    # One spinning core is 50 % of two; on a host busy with other work the spinner gets less,
    # so the bounds leave room on both sides.
    quiet = wait_until(lambda: len(idle.get_metrics()) >= 2 and idle.get_metrics(), timeout=30)
    assert quiet[-1].cpu_used_pct < 10, quiet[-1]


def test_metrics_of_unknown_sandbox_and_batch(sandbar, make_sandbox):
    sbx = make_sandbox()
    wait_until(lambda: sbx.get_metrics(), timeout=30)
    with sandbar.client() as api:
        assert api.get("/sandboxes/nosuchsandbox/metrics").status_code == 404
        r = api.get("/sandboxes/metrics", params={"sandbox_ids": f"{sbx.sandbox_id},nosuchsandbox"})
        assert r.status_code == 200, r.text
        assert list(r.json()["sandboxes"]) == [sbx.sandbox_id], r.json()
        assert api.get("/sandboxes/metrics").status_code == 400
        r = api.get(f"/sandboxes/{sbx.sandbox_id}/metrics", params={"start": 10, "end": 5})
        assert r.status_code == 400, r.text
        r = api.get(f"/sandboxes/{sbx.sandbox_id}/metrics", params={"start": 0, "end": 1})
        assert r.status_code == 200 and r.json() == [], r.text


def test_prometheus_endpoint_counts_real_sandboxes(sandbar, make_sandbox):
    sbx = make_sandbox()
    sbx.commands.run("true")
    with sandbar.client() as api:
        r = api.get("/metrics", headers={"X-API-Key": "", **METRICS_HEADERS})
        assert r.status_code == 200, r.text
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values['sandbar_sandboxes{state="running"}'] >= 1, r.text
    assert values["sandbar_sandbox_create_duration_seconds_count"] >= 1, r.text
    # The SDK's agent calls went through the edge and were counted as such.
    assert any(k.startswith('sandbar_edge_requests_total{target="agent"') for k in values), r.text
    assert sbx.sandbox_id not in r.text


def test_prometheus_endpoint_wants_the_operators_token(sandbar, make_sandbox):
    sbx = make_sandbox()
    sbx.commands.run("true")
    with sandbar.client(api_key=None) as anyone:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            # A tenant's own credentials are not the operator's.
            {"X-API-Key": sandbar.api_key},
            {"Authorization": f"Bearer {sandbar.api_key}"},
        ):
            r = anyone.get("/metrics", headers=headers)
            assert r.status_code == 401, f"{headers}: {r.status_code} {r.text}"
            assert r.headers.get("www-authenticate") == 'Bearer realm="metrics"', r.headers
            assert "sandbar_" not in r.text, r.text
        r = anyone.get("/metrics", headers=METRICS_HEADERS)
        assert r.status_code == 200 and "sandbar_sandboxes" in r.text, r.text


def test_cli_sandbox_metrics(sandbar, make_sandbox, cli):  # noqa: F811
    sbx = make_sandbox()
    wait_until(lambda: sbx.get_metrics(), timeout=30)
    r = cli("sandbox", "metrics", sbx.sandbox_id, "--format", "json")
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    points = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert points, r.stdout
    last = points[-1]
    assert last["cpuCount"] >= 1 and last["memTotal"] > 0 and last["diskTotal"] > 0, last
    r = cli("sandbox", "metrics", sbx.sandbox_id)
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    assert f"Metrics for sandbox {sbx.sandbox_id}" in r.stdout and "CPU" in r.stdout, r.stdout
