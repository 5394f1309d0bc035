"""A full disk never wrecks the sandbox pool, and the pool admits disks by what it really holds.

The module runs a server of its own whose data dir sits on a small ext4 filesystem it makes in
a loop-mounted image file, with a 1 GiB pool and 384 MiB sandbox disks. It stops the shared
server while it runs (two servers on one host would share network and cgroup names) and starts
it again afterwards; the default template's Debian root is borrowed, read-only, from the
shared server's data dir, so nothing is downloaded.

- The host fills the data filesystem: writes answer 507 naming the disk within a second or
  two, reads and running sandboxes go on (the pool's blocks were allocated when it was made),
  `/health` and `/metrics` say so; once the space is freed everything works again, also after
  kill -9, and the pool was never read-only.
- A pool turned read-only is mounted afresh: by a create once nothing holds it, and at start.
- One sandbox filling its disk leaves its neighbour able to write; creates are then refused
  with 503 and Retry-After, naming the disk pool.
- The pool's size and what it holds are in `/health?detail=true`; a larger `--disk-pool-gb`
  grows it in place, its sandboxes running; a pool too small for one sandbox refuses to start.
About a minute in all.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

import conftest
from e2e_util import (
    METRICS_HEADERS,
    SHARED_BASE,
    bind_shared_base,
    free_port,
    module_server,
    point_sdk_at,
    sh,
    shared_server_set_aside,
    unmount_under,
    wait_until,
)

FS_MIB = 3072
POOL_GB = 1
DISK_MB = 384
POOL_RESERVE_MB = 128
DATA_RESERVE_MB = 64


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def pool_read_only(pool: Path) -> bool:
    return bool(os.statvfs(pool).f_flag & os.ST_RDONLY)


def metric(api: httpx.Client, name: str, disk: str) -> float:
    text = api.get("/metrics", headers=METRICS_HEADERS).text
    found = re.search(rf'^{name}{{disk="{disk}"}} (\S+)$', text, re.M)
    assert found, f"no {name} for the {disk} disk in /metrics"
    return float(found.group(1))


class SmallDisk:
    def __init__(self):
        tag = uuid.uuid4().hex[:10]
        self.image = Path(f"/var/tmp/sandbar-e2e-disk-{tag}.img")
        self.mount = Path(f"/var/tmp/sandbar-e2e-disk-{tag}")
        self.data_dir = self.mount / "data"
        self.pool = self.data_dir / "sandboxes"
        self.filler = self.mount / "filler"
        # The checks measure the pool's free space to a few MiB: the server boots no
        # sandboxes ahead of demand to share the 1 GiB pool with the ones under test.
        self.server = module_server(
            self.data_dir,
            f"disk-full-{tag}",
            conftest.FAKE_DNS.address,
            [
                "--base-disk-mb", str(DISK_MB),
                "--disk-pool-gb", str(POOL_GB),
                "--disk-pool-reserve-mb", str(POOL_RESERVE_MB),
                "--data-disk-reserve-mb", str(DATA_RESERVE_MB),
            ],
        )
        self.binary = self.server.binary

    def make(self) -> None:
        with open(self.image, "wb") as f:
            f.truncate(FS_MIB << 20)
        sh("mkfs.ext4", "-q", "-F", "-m", "0", str(self.image))
        self.mount.mkdir()
        sh("mount", "-o", "loop", str(self.image), str(self.mount))
        bind_shared_base(self.data_dir)

    def fill(self) -> None:
        """Takes every free block of the data filesystem but one MiB, from the host."""
        size = free_bytes(self.mount) - (1 << 20)
        sh("fallocate", "-l", str(size), str(self.filler))

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def cleanup(self) -> list:
        problems = []
        self.free()
        if self.server.proc is not None:
            self.server.delete_sandboxes_in_teardown(problems)
            self.server.stop_in_teardown(problems)
        left = unmount_under(self.mount)
        if left:
            problems.append(f"mounts left under {self.mount}: {left}")
        else:
            shutil.rmtree(self.mount, ignore_errors=True)
        self.image.unlink(missing_ok=True)
        shutil.rmtree(self.binary.parent, ignore_errors=True)
        return problems


@pytest.fixture(scope="module")
def disk(sandbar):
    if os.geteuid() != 0:
        pytest.skip("needs root")
    with shared_server_set_aside(sandbar, SHARED_BASE):
        small = SmallDisk()
        try:
            small.make()
            small.server.start()
            small.server.wait_healthy(timeout=60)
            small.server.wait_base_template()
            point_sdk_at(small.server.url)
            yield small
        finally:
            problems = small.cleanup()
            assert not problems, "; ".join(problems)


def create(api: httpx.Client) -> httpx.Response:
    return api.post("/sandboxes", json={"templateID": "base", "timeout": 300})


def run(sandbox_id: str, command: str, timeout: float = 60) -> str:
    from e2b import Sandbox

    return Sandbox.connect(sandbox_id).commands.run(command, timeout=timeout).stdout


def test_a_full_data_disk_refuses_writes_early_and_heals(disk):
    with disk.server.client(timeout=30) as api:
        first = create(api)
        assert first.status_code == 201, first.text
        sandbox_id = first.json()["sandboxID"]
        assert api.get("/health").status_code == 204
        assert metric(api, "sandbar_disk_read_only", "pool") == 0

        disk.fill()
        # The node measures at each request: no cache to wait out.
        for path, body in (("/sandboxes", {"templateID": "base"}), ("/volumes", {"name": "late"})):
            started = time.monotonic()
            r = api.post(path, json=body)
            assert time.monotonic() - started < 2, f"POST {path} took {time.monotonic() - started:.1f}s"
            assert r.status_code == 507, f"POST {path} -> {r.status_code} {r.text}"
            assert "data disk" in r.json()["message"], r.text
            assert str(disk.mount) not in r.text, "a host path reached a tenant"
        health = api.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert any("data disk" in p for p in health.json()["problems"]), health.text
        assert metric(api, "sandbar_disk_free_bytes", "data") < DATA_RESERVE_MB << 20
        # Reads, and what keeps a sandbox going, still answer.
        assert api.get("/v2/sandboxes").status_code == 200
        assert api.post(f"/sandboxes/{sandbox_id}/timeout", json={"timeout": 300}).status_code in (204, 507)

        # The sandbox writes to the pool, whose blocks the host can no longer take.
        out = run(sandbox_id, "dd if=/dev/urandom of=/home/user/big bs=1M count=64 status=none && sync && du -m /home/user/big")
        assert out.startswith("64"), out
        assert not pool_read_only(disk.pool)

        disk.free()
        wait_until(lambda: api.get("/health").status_code == 204, timeout=5, message="/health healthy again")
        again = create(api)
        assert again.status_code == 201, again.text
        assert run(again.json()["sandboxID"], "echo fine") == "fine\n"
        volume = api.post("/volumes", json={"name": "later"})
        assert volume.status_code in (200, 201), volume.text
        assert api.delete(f"/volumes/{volume.json()['volumeID']}").status_code == 204

    disk.server.restart(kill9=True)
    with disk.server.client(timeout=30) as api:
        assert api.get("/health").status_code == 204
        assert not pool_read_only(disk.pool)
        assert run(sandbox_id, "cat /home/user/big | wc -c").strip() == str(64 << 20)
        third = create(api)
        assert third.status_code == 201, third.text
        for s in api.get("/v2/sandboxes").json():
            assert api.delete(f"/sandboxes/{s['sandboxID']}").status_code == 204


def test_a_read_only_pool_is_mounted_afresh(disk):
    # What a failed btrfs looks like to the node: read-only, with nothing holding it.
    sh("mount", "-o", "remount,ro", str(disk.pool))
    with disk.server.client(timeout=30) as api:
        health = api.get("/health")
        assert health.status_code == 200 and "read-only" in " ".join(health.json()["problems"]), health.text
        assert metric(api, "sandbar_disk_read_only", "pool") == 1
        r = create(api)
        assert r.status_code == 201, r.text
        assert not pool_read_only(disk.pool)
        assert run(r.json()["sandboxID"], "echo 1 > /home/user/f && cat /home/user/f") == "1\n"
        assert api.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204

    # Found read-only at start (after a crash): mounted afresh instead of failing the start.
    sh("mount", "-o", "remount,ro", str(disk.pool))
    disk.server.restart(kill9=True)
    with disk.server.client(timeout=30) as api:
        assert not pool_read_only(disk.pool)
        assert api.get("/health").status_code == 204
        r = create(api)
        assert r.status_code == 201, r.text
        assert api.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204


def test_one_full_sandbox_leaves_its_neighbour_room_and_creates_are_refused(disk):
    with disk.server.client(timeout=30) as api:
        ids = []
        for _ in range(2):
            r = create(api)
            assert r.status_code == 201, r.text
            ids.append(r.json()["sandboxID"])
        greedy, neighbour = ids
        # Fills its disk to its quota: the write fails there, and only there.
        out = run(greedy, f"dd if=/dev/urandom of=/home/user/all bs=1M count={DISK_MB} status=none; sync; echo done", timeout=120)
        assert "done" in out
        wait_until(
            lambda: api.get(f"/sandboxes/{greedy}/metrics").json()[-1]["diskUsed"] > (DISK_MB - 64) << 20,
            timeout=15,
            message="the full sandbox's disk use in its metrics",
        )
        assert run(neighbour, "dd if=/dev/urandom of=/home/user/mine bs=1M count=32 status=none && sync && echo ok") == "ok\n"
        # How much of a 1 GiB btrfs a quota lets one sandbox write depends on its metadata
        # reservations, so the full one may have left more than a disk and the reserve free:
        # the neighbour takes what is left over, as a second tenant would.
        threshold = (DISK_MB + POOL_RESERVE_MB) << 20
        over = free_bytes(disk.pool) - threshold
        if over > -(8 << 20):
            more = (over >> 20) + 24
            out = run(neighbour, f"dd if=/dev/urandom of=/home/user/more bs=1M count={more} status=none && sync && echo ok")
            assert out == "ok\n", out
        # Free space moves at the pool's next commit (every 5 s).
        wait_until(lambda: free_bytes(disk.pool) < threshold, timeout=15,
                   message=f"the pool's free space below {threshold >> 20} MiB")

        refused = create(api)
        assert refused.status_code == 503, refused.text
        assert "disk pool" in refused.json()["message"], refused.text
        assert int(refused.headers["retry-after"]) > 0
        assert metric(api, "sandbar_disk_free_bytes", "pool") < (DISK_MB + POOL_RESERVE_MB) << 20

        # The pool admits again as soon as the space comes back.
        assert api.delete(f"/sandboxes/{greedy}").status_code == 204
        r = wait_until(lambda: (lambda r: r if r.status_code == 201 else None)(create(api)), timeout=20,
                       message="a create admitted once the full sandbox is gone")
        ids.append(r.json()["sandboxID"])
        for sandbox_id in ids[1:]:
            assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204


def test_the_pool_grows_in_place_and_a_pool_too_small_refuses_to_start(disk):
    with disk.server.client(timeout=30) as api:
        report = api.get("/health", params={"detail": "true"})
        assert report.status_code == 200, report.text
        pool = report.json()["diskPool"]
        assert 900 <= pool["sizeMB"] <= 1024, pool
        assert pool["reserveMB"] == POOL_RESERVE_MB and pool["defaultDiskMB"] == DISK_MB, pool
        assert pool["holdsFilled"] == (pool["sizeMB"] - POOL_RESERVE_MB) // DISK_MB, pool
        r = create(api)
        assert r.status_code == 201, r.text
        kept = r.json()["sandboxID"]
        assert run(kept, "echo before > /home/user/kept && cat /home/user/kept") == "before\n"

    args = disk.server.extra_args
    at = args.index("--disk-pool-gb") + 1
    args[at] = str(POOL_GB + 1)
    try:
        # A kill -9 leaves the sandbox running; the new server grows the mounted pool under it.
        disk.server.restart(kill9=True)
        with disk.server.client(timeout=30) as api:
            pool = api.get("/health", params={"detail": "true"}).json()["diskPool"]
            assert pool["sizeMB"] > 1900, pool
            assert run(kept, "cat /home/user/kept") == "before\n"
            assert api.delete(f"/sandboxes/{kept}").status_code == 204
    finally:
        args[at] = str(POOL_GB)

    # Refused before anything is set up, so it may run beside the serving server.
    empty = disk.mount / "too-small"
    refused = subprocess.run(
        [str(disk.binary), "serve", "--data-dir", str(empty), "--listen", f"127.0.0.1:{free_port()}",
         "--disk-pool-gb", "1", "--base-disk-mb", "2048"],
        capture_output=True, text=True, timeout=60,
    )
    assert refused.returncode != 0, refused.stderr
    assert "--disk-pool-gb" in refused.stderr and "at least 3" in refused.stderr, refused.stderr
    assert not (empty / "sandboxes.img").exists()
