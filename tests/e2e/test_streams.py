"""Bytes a tenant controls move through the server as streams, never whole in its memory.

- A 4 GiB sparse file made inside a sandbox in a mounted volume is read through the volume
  content API while the server's resident memory is sampled: it stays within 64 MiB of where
  it started, and every byte arrives.
- A large file written through the content API lands intact (same SHA-256 inside a sandbox
  that mounts the volume), with the server's memory flat meanwhile.
- The content API holds each team to a request rate (the shared server runs with
  `--volume-requests-per-minute`): past it, 429 with the API's error body naming the limit and
  a `Retry-After`; another team is not affected.
- Build-context uploads go with their template: deleting the template removes the uploads that
  belonged to it alone, and keeps one another template of the team also asked for until that
  template goes too.
- A kill of a sandbox running hundreds of processes answers 204 and leaves no cgroup behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Tuple

import httpx
import pytest
from e2b import Sandbox, Volume

from e2e_util import (
    UPLOAD_TTL_S,
    VOLUME_REQUESTS_PER_MINUTE,
    destroy_volume,
    rss_kib,
    sandbar_cli,
    sandbox_cgroup_dirs,
    unique,
    wait_until,
)

RSS_SLACK_KIB = 64 << 10
SPARSE_BYTES = 4 << 30
WRITE_BYTES = 200 << 20


def _while_sampling(pid: int, work: Callable[[], object]) -> Tuple[object, int, int]:
    """Runs `work` while sampling the server's VmRSS; its result, the RSS before and the peak."""
    before = rss_kib(pid)
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss_kib(pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result = work()
    finally:
        done.set()
        sampler.join()
    return result, before, max(peak[0], rss_kib(pid))


@pytest.fixture
def volume_api(sandbar, monkeypatch):
    monkeypatch.setenv("E2B_VOLUME_API_URL", sandbar.url)
    return sandbar


@pytest.fixture
def volume(sandbar, volume_api):
    vol = Volume.create(unique("streams"))
    try:
        yield vol
    finally:
        try:
            destroy_volume(sandbar.url, sandbar.api_key, vol.volume_id, vol.name)
        except Exception:  # noqa: BLE001 - teardown must not mask the test result
            pass


@pytest.fixture(scope="module")
def team(sandbar) -> dict:
    """A team of its own: its request bucket and uploads are this module's alone."""
    return json.loads(sandbar_cli(sandbar, "team", "create", unique("streams"), "--requests-per-minute", "0"))


def test_a_4_gib_sparse_file_reads_through_with_the_server_flat(sandbar, make_sandbox, volume):
    sbx = make_sandbox(volume_mounts={"/mnt/data": volume}, timeout=300)
    made = sbx.commands.run("truncate -s 4G /mnt/data/sparse && stat -c %s /mnt/data/sparse", user="root")
    assert made.stdout.strip() == str(SPARSE_BYTES), made
    sbx.kill()

    pid = sandbar.proc.pid

    def read_all() -> int:
        total = 0
        for chunk in volume.read_file("/sparse", format="stream"):
            total += len(chunk)
        return total

    # One small streamed read first: allocations made once per process are then behind.
    volume.write_file("/small", b"x" * (1 << 20))
    assert sum(len(c) for c in volume.read_file("/small", format="stream")) == 1 << 20
    started = time.monotonic()
    total, before, peak = _while_sampling(pid, read_all)
    took = time.monotonic() - started
    print(
        f"\n[e2e] read {total} bytes in {took:.1f} s; server VmRSS {before // 1024} MiB before, "
        f"peak {peak // 1024} MiB (+{(peak - before) // 1024} MiB)"
    )
    assert total == SPARSE_BYTES
    assert peak - before < RSS_SLACK_KIB, f"the server's RSS grew by {(peak - before) // 1024} MiB reading 4 GiB"


def test_a_large_streamed_write_lands_intact_with_the_server_flat(sandbar, make_sandbox, volume):
    pid = sandbar.proc.pid
    digest = hashlib.sha256()
    with tempfile.TemporaryFile() as source:
        block = os.urandom(1 << 20)
        for i in range(WRITE_BYTES >> 20):
            # A different MiB each time, so a misplaced chunk changes the digest.
            chunk = i.to_bytes(8, "little") + block[8:]
            digest.update(chunk)
            source.write(chunk)
        source.seek(0)
        entry, before, peak = _while_sampling(pid, lambda: volume.write_file("/dir/upload.bin", source, force=True))
    print(
        f"\n[e2e] wrote {WRITE_BYTES} bytes; server VmRSS {before // 1024} MiB before, "
        f"peak {peak // 1024} MiB (+{(peak - before) // 1024} MiB)"
    )
    assert entry.size == WRITE_BYTES
    assert peak - before < RSS_SLACK_KIB, f"the server's RSS grew by {(peak - before) // 1024} MiB writing 200 MiB"

    sbx = make_sandbox(volume_mounts={"/mnt/data": volume})
    inside = sbx.commands.run("sha256sum /mnt/data/dir/upload.bin", user="root").stdout.split()[0]
    assert inside == digest.hexdigest()
    # Nothing of the upload is left beside it.
    listed = sbx.commands.run("ls -A /mnt/data/dir", user="root").stdout.split()
    assert listed == ["upload.bin"], listed


def test_the_content_api_holds_each_team_to_its_rate(sandbar, team):
    with httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=30) as api:
        r = api.post("/volumes", json={"name": unique("rate")})
        assert r.status_code == 201, r.text
        vol = r.json()
    try:
        auth = {"Authorization": f"Bearer {vol['token']}"}
        url = f"/volumecontent/{vol['volumeID']}/path"
        local = threading.local()

        def ask(_: int) -> httpx.Response:
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=sandbar.url, headers=auth, timeout=30)
            return local.client.get(url, params={"path": "/"})

        # A wrong token is refused without spending the team's requests.
        with httpx.Client(base_url=sandbar.url, timeout=30) as stranger:
            for _ in range(5):
                r = stranger.get(url, params={"path": "/"}, headers={"Authorization": "Bearer vol_wrong"})
                assert r.status_code == 401, r.text

        attempts = VOLUME_REQUESTS_PER_MINUTE + 200
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers: List[httpx.Response] = list(pool.map(ask, range(attempts)))
        took = time.monotonic() - started
        statuses = [a.status_code for a in answers]
        assert set(statuses) <= {200, 429}, sorted(set(statuses))
        accepted = statuses.count(200)
        # The bucket holds a minute's worth; what refilled while asking may pass too.
        refill = int(took * VOLUME_REQUESTS_PER_MINUTE / 60) + 1
        assert VOLUME_REQUESTS_PER_MINUTE <= accepted <= VOLUME_REQUESTS_PER_MINUTE + refill, (accepted, took)
        refused = next(a for a in answers if a.status_code == 429)
        body = refused.json()
        assert body["code"] == 429, body
        assert f"{VOLUME_REQUESTS_PER_MINUTE} volume content requests per minute" in body["message"], body
        assert int(refused.headers["Retry-After"]) >= 1
        print(f"\n[e2e] {accepted} of {attempts} content requests accepted in {took:.1f} s; then: {body['message']}")

        # The team's other API is not the content API's bucket, and another team has its own.
        with httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=30) as api:
            assert api.get("/volumes").status_code == 200
        with httpx.Client(base_url=sandbar.url, headers={"X-API-Key": sandbar.api_key}, timeout=30) as other:
            r = other.post("/volumes", json={"name": unique("other")})
            assert r.status_code == 201, r.text
            theirs = r.json()
            try:
                r = httpx.get(
                    f"{sandbar.url}/volumecontent/{theirs['volumeID']}/path",
                    params={"path": "/"},
                    headers={"Authorization": f"Bearer {theirs['token']}"},
                    timeout=30,
                )
                assert r.status_code == 200, r.text
            finally:
                other.delete(f"/volumes/{theirs['volumeID']}")
        if hasattr(local, "client"):
            local.client.close()
    finally:
        with httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=30) as api:
            api.delete(f"/volumes/{vol['volumeID']}")


def test_uploads_go_with_their_template(sandbar, team):
    uploads_dir = sandbar.data_dir / "uploads" / team["teamID"]
    # Not gzip: kept as sent, so each file's size on disk is the upload's.
    archives = [os.urandom(32 << 20) for _ in range(3)]
    hashes = [hashlib.sha256(a).hexdigest() for a in archives]
    with httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=60) as api:
        templates = []
        for _ in range(2):
            r = api.post("/v3/templates", json={"name": unique("uploads")})
            assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
            templates.append(r.json()["templateID"])
        first, second = templates
        try:
            started = time.monotonic()
            for files_hash, archive in zip(hashes, archives):
                link = api.get(f"/templates/{first}/files/{files_hash}")
                assert link.status_code == 201, link.text
                assert link.json()["present"] is False
                put = api.put(link.json()["url"], content=archive)
                assert put.status_code == 201, put.text
            # The second template asks for the first files too: they are its as well now.
            shared = api.get(f"/templates/{second}/files/{hashes[0]}")
            assert shared.status_code == 201 and shared.json()["present"] is True, shared.text
            assert sorted(p.name for p in uploads_dir.iterdir()) == sorted(hashes)

            r = api.delete(f"/templates/{first}")
            assert r.status_code == 204, r.text
            wait_until(
                lambda: sorted(p.name for p in uploads_dir.iterdir()) == [hashes[0]],
                timeout=2,
                interval=0.05,
                message="the deleted template's uploads to go",
            )
            # Well within the uploads' time to live: the sweep did not remove them.
            assert time.monotonic() - started < UPLOAD_TTL_S, "too slow to tell the delete from the sweep"

            r = api.delete(f"/templates/{second}")
            assert r.status_code == 204, r.text
            wait_until(
                lambda: not uploads_dir.exists() or not any(uploads_dir.iterdir()),
                timeout=2,
                interval=0.05,
                message="the last template's upload to go",
            )
            assert time.monotonic() - started < UPLOAD_TTL_S, "too slow to tell the delete from the sweep"
            templates.clear()
        finally:
            for template_id in templates:
                api.delete(f"/templates/{template_id}")


def test_a_kill_waits_for_hundreds_of_processes(sandbar):
    sbx = Sandbox.create(timeout=120)
    try:
        started = sbx.commands.run(
            "for i in $(seq 400); do sleep 1000 & done; sleep 0.5; pgrep -c sleep",
            user="root",
            timeout=60,
        )
        assert int(started.stdout.strip()) >= 400, started
        assert sandbox_cgroup_dirs(sbx.sandbox_id)
    except BaseException:
        sbx.kill()
        raise
    r = httpx.delete(
        f"{sandbar.url}/sandboxes/{sbx.sandbox_id}",
        headers={"X-API-Key": sandbar.api_key},
        timeout=60,
    )
    assert r.status_code == 204, f"{r.status_code} {r.text}"
    assert not sandbox_cgroup_dirs(sbx.sandbox_id)
    assert Path(f"/proc/{sandbar.proc.pid}").exists()
