"""Disk rates: each sandbox is held to the server's per-sandbox read and write rates on the
disks under its files, or to its team's where the operator set them; root inside cannot lift
them, and /metrics reports them.

Only direct I/O is measured: it is what the kernel holds to a group's rate on every cgroup
version (on v1 the kernel's own writeback of buffered pages is not attributed to the writer).
A rate is checked only from above, with a margin for the throttle's first slice: a loaded
machine may make I/O slower, never faster than the limit.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from e2e_util import METRICS_HEADERS, sandbar_cli, unique

# The throttle lets a short burst through before it starts to account, and dd's own clock
# starts before its first write: a measured rate may be a little above the limit.
MARGIN = 1.25


def _metric(sandbar, name: str, direction: str) -> int:
    text = httpx.get(f"{sandbar.url}/metrics", headers=METRICS_HEADERS, timeout=30).text
    for line in text.splitlines():
        if line.startswith(f'sandbar_{name}{{direction="{direction}"}} '):
            return int(float(line.split()[-1]))
    raise AssertionError(f"/metrics has no {name} for {direction}:\n{text}")


def _dd_rate(output: str) -> float:
    """Bytes per second from dd's last line ("N bytes (...) copied, S s, ...")."""
    match = re.search(r"^(\d+) bytes .* copied, ([0-9.]+) s", output, re.M)
    assert match, output
    return int(match.group(1)) / float(match.group(2))


@pytest.fixture(scope="module")
def limits(sandbar):
    write = _metric(sandbar, "sandbox_disk_limit_bytes_per_second", "write")
    read = _metric(sandbar, "sandbox_disk_limit_bytes_per_second", "read")
    if not write or not read:
        pytest.skip("the server holds sandboxes to no disk rate on this host (see its log)")
    return read, write


def test_a_sandbox_writes_and_reads_at_its_limits(sandbar, limits):
    read_limit, write_limit = limits
    written_before = _metric(sandbar, "sandbox_disk_bytes", "write")
    sbx = Sandbox.create(timeout=120)
    try:
        # About two seconds at the write limit: long enough that the first slice's burst
        # is small beside it.
        mib = max(8, 2 * write_limit >> 20)
        wrote = sbx.commands.run(
            f"dd if=/dev/zero of=/home/user/rate bs=1M count={mib} oflag=direct 2>&1", timeout=120
        )
        write_rate = _dd_rate(wrote.stdout)
        assert write_rate <= write_limit * MARGIN, (
            f"wrote at {write_rate / 2**20:.0f} MiB/s, limit {write_limit / 2**20:.0f} MiB/s"
        )
        read = sbx.commands.run(
            "dd if=/home/user/rate of=/dev/null bs=1M iflag=direct 2>&1", timeout=120
        )
        read_rate = _dd_rate(read.stdout)
        assert read_rate <= read_limit * MARGIN, (
            f"read at {read_rate / 2**20:.0f} MiB/s, limit {read_limit / 2**20:.0f} MiB/s"
        )
        print(f"\n[disk-io] write {write_rate / 2**20:.0f} MiB/s (limit {write_limit >> 20}), "
              f"read {read_rate / 2**20:.0f} MiB/s (limit {read_limit >> 20})")
        # What it wrote is counted while it runs. Nearly all of it: on a loaded host the
        # block layer's counts for the sandboxes' group once missed 4 of 200 MiB written with
        # O_DIRECT on the btrfs pool (196.3 MiB counted), so a tenth is left as slack.
        counted = _metric(sandbar, "sandbox_disk_bytes", "write") - written_before
        assert counted >= (mib << 20) * 9 // 10, f"{counted} bytes counted of {mib} MiB written"
    finally:
        sbx.kill()


def test_root_in_a_sandbox_cannot_lift_its_limit(sandbar, limits):
    sbx = Sandbox.create(timeout=120)
    try:
        for path in (
            "/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device",
            "/sys/fs/cgroup/io.max",
        ):
            with pytest.raises(CommandExitException) as refused:
                sbx.commands.run(f"echo '7:0 0' > {path}", user="root")
            assert refused.value.exit_code != 0
        # The limit is still the server's, read from the host side of its cgroup.
        assert str(limits[1]) in _host_write_limit(sbx.sandbox_id)
    finally:
        sbx.kill()


def _host_write_limit(sandbox_id: str) -> str:
    """The write limit the host holds sandbox `sandbox_id` to, as its cgroup file says it."""
    for candidate in (
        f"/sys/fs/cgroup/blkio/sandbar/{sandbox_id}/blkio.throttle.write_bps_device",
        f"/sys/fs/cgroup/sandbar/{sandbox_id}/io.max",
    ):
        try:
            return open(candidate).read()
        except OSError:
            continue
    raise AssertionError(f"no disk limit file for {sandbox_id} on the host")


def test_a_team_s_own_rates_hold_its_sandboxes(sandbar, limits):
    team = json.loads(sandbar_cli(sandbar, "team", "create", unique("disk-rates"), "--disk-write-mbps", "40"))
    key = team["apiKey"]
    team_limit = 40 << 20
    # Taken from the warm pool, which booted it at the server's rates: the take sets the team's.
    sbx = Sandbox.create(api_key=key, timeout=120)
    try:
        assert str(team_limit) in _host_write_limit(sbx.sandbox_id)
        wrote = sbx.commands.run(
            "dd if=/dev/zero of=/home/user/rate bs=1M count=80 oflag=direct 2>&1", timeout=120
        )
        write_rate = _dd_rate(wrote.stdout)
        # Below the server's own limit: only the team's rate holds it here.
        assert write_rate <= team_limit * MARGIN < limits[1], (
            f"wrote at {write_rate / 2**20:.0f} MiB/s, the team's limit is 40 MiB/s"
        )
        print(f"\n[disk-io] team write {write_rate / 2**20:.0f} MiB/s (limit 40)")
    finally:
        sbx.kill()
    # Set back to the server's own: the team's next sandbox gets the server's rate.
    sandbar_cli(sandbar, "team", "set-limits", team["teamID"], "--disk-write-mbps", "0")
    shown = json.loads(sandbar_cli(sandbar, "team", "show", team["teamID"]))
    assert shown["diskWriteMBps"] == 0
    sbx = Sandbox.create(api_key=key, timeout=120)
    try:
        assert str(limits[1]) in _host_write_limit(sbx.sandbox_id)
    finally:
        sbx.kill()
