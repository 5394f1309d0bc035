"""What one tenant's builds may leave behind on the host, through the raw build API.

- Build-context uploads are capped per team (the shared server runs with
  `--max-uploads-per-team 300`): 300 small uploads that no build uses are accepted, one more is
  refused with 429 naming the limit, and all of them are removed once their time to live
  (`--upload-ttl-secs 10`) passed, after which `GET …/files/{hash}` says they are missing again
  and the team may upload anew.
- A `RUN` step printing 1 GiB without a newline leaves the server's resident memory where it
  was, and its build log holds the output split into 8 KiB lines, bounded, with a note on how
  much was not kept.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Set

import httpx
import pytest

from e2e_util import UPLOADS_PER_TEAM, UPLOAD_TTL_S, rss_kib, sandbar_cli, unique, wait_build_end, wait_until

# The server's own caps on a step's output (crates/node/src/build/build_output.rs).
LINE_BYTES = 8 << 10
STEP_BYTES = 1 << 20
RSS_SLACK_KIB = 16 << 10

_BUILT: Set[str] = set()


@pytest.fixture(scope="module")
def team(sandbar) -> dict:
    """A team of its own, so the count cap sees only this module's uploads."""
    return json.loads(sandbar_cli(sandbar, "team", "create", unique("limits"), "--requests-per-minute", "0"))


@pytest.fixture(scope="module", autouse=True)
def _delete_built_templates(sandbar):
    yield
    with sandbar.client() as api:
        for t in api.get("/templates").json():
            if set(t.get("aliases") or []) & _BUILT:
                api.delete(f"/templates/{t['templateID']}")


def _archive(i: int) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        data = f"file {i}\n".encode()
        info = tarfile.TarInfo(f"f{i}.txt")
        info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
        tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def test_uploads_are_capped_per_team_and_removed_after_their_ttl(sandbar, team):
    uploads_dir = sandbar.data_dir / "uploads" / team["teamID"]
    archives = [_archive(i) for i in range(UPLOADS_PER_TEAM + 1)]
    hashes = [hashlib.sha256(a).hexdigest() for a in archives]
    local = threading.local()

    with httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=30) as api:
        r = api.post("/v3/templates", json={"name": unique("uploads")})
        assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
        template_id = r.json()["templateID"]

        def link(files_hash: str) -> dict:
            with httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=30) as c:
                r = c.get(f"/templates/{template_id}/files/{files_hash}")
            assert r.status_code == 201, f"GET files/{files_hash}: {r.status_code} {r.text}"
            return r.json()

        def upload(i: int) -> httpx.Response:
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=sandbar.url, headers={"X-API-Key": team["apiKey"]}, timeout=30)
            got = local.client.get(f"/templates/{template_id}/files/{hashes[i]}")
            assert got.status_code == 201, f"GET files: {got.status_code} {got.text}"
            body = got.json()
            assert body["present"] is False and body["url"], body
            return local.client.put(body["url"], content=archives[i])

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers = list(pool.map(upload, range(UPLOADS_PER_TEAM)))
        uploaded_in = time.monotonic() - started
        last_written = time.monotonic()
        bad = [(i, a.status_code, a.text) for i, a in enumerate(answers) if a.status_code != 201]
        assert not bad, f"uploads refused below the cap: {bad[:5]}"
        # The test relies on every upload still being kept when the next one is tried.
        assert uploaded_in < UPLOAD_TTL_S / 2, f"{UPLOADS_PER_TEAM} uploads took {uploaded_in:.1f} s"
        assert len(list(uploads_dir.iterdir())) == UPLOADS_PER_TEAM

        refused = upload(UPLOADS_PER_TEAM)
        assert refused.status_code == 429, f"one upload past the cap: {refused.status_code} {refused.text}"
        error = refused.json()
        assert error["code"] == 429 and f"{UPLOADS_PER_TEAM} uploads" in error["message"], error
        assert len(list(uploads_dir.iterdir())) == UPLOADS_PER_TEAM, "the refused upload left a file"
        assert link(hashes[0])["present"] is True

        # Nothing is removed before its time to live (the first upload was written no earlier
        # than `started`), everything soon after.
        time.sleep(max(0.0, UPLOAD_TTL_S - 1.5 - (time.monotonic() - started)))
        assert len(list(uploads_dir.iterdir())) == UPLOADS_PER_TEAM, "uploads removed before their time to live"
        wait_until(
            lambda: not uploads_dir.exists() or not any(uploads_dir.iterdir()),
            timeout=UPLOAD_TTL_S + 10,
            interval=0.1,
            message="the uploads to be swept",
        )
        gone_after = time.monotonic() - last_written
        print(f"\n[e2e] {UPLOADS_PER_TEAM} uploads in {uploaded_in:.2f} s; all removed {gone_after:.2f} s after the last")
        assert gone_after < UPLOAD_TTL_S + 5, f"uploads outlived their time to live by {gone_after - UPLOAD_TTL_S:.1f} s"

        # Asked again, the server says the files are missing, so an SDK sends them again.
        for i in (0, UPLOADS_PER_TEAM // 2, UPLOADS_PER_TEAM - 1):
            assert link(hashes[i])["present"] is False
        again = upload(UPLOADS_PER_TEAM)
        assert again.status_code == 201, f"{again.status_code} {again.text}"
        if hasattr(local, "client"):
            local.client.close()


def _build(api: httpx.Client, command: str, timeout: float = 120) -> tuple:
    name = unique("noisy")
    _BUILT.add(name)
    r = api.post("/v3/templates", json={"name": name})
    assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
    template_id, build_id = r.json()["templateID"], r.json()["buildID"]
    r = api.post(
        f"/v2/templates/{template_id}/builds/{build_id}",
        json={"fromTemplate": "base", "steps": [{"type": "RUN", "args": [command], "force": True}]},
    )
    assert r.status_code == 202, f"POST build: {r.status_code} {r.text}"
    # No log lines while waiting: what the server holds is what is measured.
    status = wait_build_end(api, template_id, build_id, timeout, params={"logsOffset": 4294967295, "limit": 0})
    return template_id, build_id, status


def _all_logs(api: httpx.Client, template_id: str, build_id: str) -> List[dict]:
    entries: List[dict] = []
    while True:
        s = api.get(
            f"/templates/{template_id}/builds/{build_id}/status",
            params={"logsOffset": len(entries), "limit": 100},
        )
        assert s.status_code == 200, f"{s.status_code} {s.text}"
        page = s.json().get("logEntries") or []
        if not page:
            return entries
        entries.extend(page)


def test_a_step_printing_a_gigabyte_without_newlines_leaves_the_server_flat(sandbar, base_template):
    pid = sandbar.pid
    with sandbar.client(timeout=60) as api:
        # The same step, smaller, first: allocations made once per process are then behind.
        _, _, warm = _build(api, "head -c 67108864 /dev/zero | tr '\\0' a")
        assert warm["status"] == "ready", warm

        before = rss_kib(pid)
        peak = [before]
        done = threading.Event()

        def sample():
            while not done.wait(0.1):
                peak[0] = max(peak[0], rss_kib(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        try:
            template_id, build_id, status = _build(api, "head -c 1073741824 /dev/zero | tr '\\0' a")
        finally:
            done.set()
            sampler.join()
        took = time.monotonic() - started
        after = rss_kib(pid)
        print(
            f"\n[e2e] 1 GiB step in {took:.1f} s; server VmRSS {before} KiB before, "
            f"{peak[0]} KiB at most, {after} KiB after"
        )
        assert status["status"] == "ready", status
        assert after - before < RSS_SLACK_KIB, f"VmRSS grew from {before} to {after} KiB"
        assert peak[0] - before < RSS_SLACK_KIB, f"VmRSS peaked at {peak[0]} KiB (from {before})"

        logs = _all_logs(api, template_id, build_id)
    messages = [e.get("message", "") for e in logs]
    split = [m for m in messages if m == "a" * LINE_BYTES]
    assert len(split) == STEP_BYTES // LINE_BYTES, (
        f"{len(split)} lines of {LINE_BYTES} bytes; longest message {max(map(len, messages))} bytes"
    )
    assert all(len(m) <= LINE_BYTES for m in messages if set(m) == {"a"})
    dropped = (1 << 30) // LINE_BYTES - len(split)
    notes = [e for e in logs if "not kept" in e.get("message", "")]
    assert notes, "no note on the dropped output:\n" + "\n".join(m[:120] for m in messages[-10:])
    assert notes[0]["message"].startswith(f"{dropped} more output lines ({dropped * LINE_BYTES} bytes) not kept"), notes
    assert notes[0].get("level") == "warn", notes[0]
