"""Sandboxes booted ahead of demand: a create takes one, and what it gets is the sandbox it
asked for (its environment, limits, disk and token), sharing nothing with the next one."""

from __future__ import annotations

from e2e_util import METRICS_HEADERS, wait_until


def metric(sandbar, name: str) -> float:
    with sandbar.client() as api:
        r = api.get("/metrics", headers={"X-API-Key": "", **METRICS_HEADERS})
        assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} is not in /metrics:\n{r.text}")


def test_a_create_takes_a_waiting_sandbox_and_gets_its_own_settings(sandbar, make_sandbox):
    # Asks for the default template, which is what the pool then keeps ready.
    make_sandbox()
    wait_until(
        lambda: metric(sandbar, "sandbar_warm_sandboxes") >= 2,
        timeout=30,
        message="warm sandboxes of the default template",
    )
    taken = metric(sandbar, "sandbar_warm_sandbox_takes_total")

    sbx = make_sandbox(envs={"WARM_CHECK": "yes"})
    assert metric(sandbar, "sandbar_warm_sandbox_takes_total") == taken + 1
    r = sbx.commands.run('echo "$WARM_CHECK $(whoami) $(pwd) $(hostname)"')
    assert r.stdout.strip() == "yes user /home/user e2b.local", r

    # A warm sandbox boots with a 64 MiB memory limit and disk quota; the create gives it the
    # template's.
    r = sbx.commands.run(
        "python3 -c \"b = b'x' * (300 << 20); print(len(b) >> 20)\"", timeout=60
    )
    assert r.exit_code == 0 and r.stdout.strip() == "300", r
    with sandbar.client() as api:
        r = api.get(f"/sandboxes/{sbx.sandbox_id}")
        assert r.status_code == 200, r.text
        disk_mb = r.json()["diskSizeMB"]
    points = wait_until(lambda: sbx.get_metrics(), timeout=30, message="a metrics sample")
    assert disk_mb > 64 and points[-1].disk_total == disk_mb << 20, (disk_mb, points[-1])

    other = make_sandbox()
    sbx.files.write("/home/user/mine", "x")
    assert not other.files.exists("/home/user/mine")
    assert other.commands.run("echo ${WARM_CHECK:-unset}").stdout.strip() == "unset"
