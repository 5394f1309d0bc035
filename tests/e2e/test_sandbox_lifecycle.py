"""Sandbox lifecycle through the E2B SDK: create, info, list, timeout, expiry, kill, connect."""

import os
import signal
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from e2b import (
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)

from e2e_util import sandbox_cgroup_dirs, unique, wait_until


def _now():
    return datetime.now(timezone.utc)


def _listed_ids(query=None, limit=None):
    paginator = Sandbox.list(query=query, limit=limit)
    ids = []
    pages = 0
    while paginator.has_next:
        pages += 1
        assert pages <= 50, "paginator never ends"
        ids.extend(s.sandbox_id for s in paginator.next_items())
    return ids


def _unknown(sandbox_id: str) -> bool:
    """Whether get_info answers SandboxNotFoundException for the sandbox."""
    try:
        Sandbox.get_info(sandbox_id)
        return False
    except SandboxNotFoundException:
        return True


def test_create_default_template(sandbox, base_template):
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id
    assert info.template_id in (base_template["templateID"], "base")
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {}
    now = _now()
    assert info.started_at <= now + timedelta(seconds=5)
    assert info.started_at >= now - timedelta(minutes=5)
    # created with timeout=120
    span = (info.end_at - info.started_at).total_seconds()
    assert 110 <= span <= 130, f"end_at - started_at = {span}s, expected ~120s"
    assert info.cpu_count == 2
    assert info.memory_mb == 512
    assert info.envd_version
    assert sandbox.commands.run("echo hi").stdout == "hi\n"


def test_create_named_base_with_metadata_and_envs(make_sandbox, base_template):
    tag = unique()
    sbx = make_sandbox(
        template="base",
        timeout=60,
        metadata={"purpose": "e2e", "tag": tag},
        envs={"E2E_FOO": "bar baz", "E2E_NUM": "7"},
    )
    info = sbx.get_info()
    assert info.template_id in (base_template["templateID"], "base")
    assert info.metadata == {"purpose": "e2e", "tag": tag}
    assert info.state == SandboxState.RUNNING
    span = (info.end_at - info.started_at).total_seconds()
    assert 50 <= span <= 70, f"end_at - started_at = {span}s, expected ~60s"
    out = sbx.commands.run('echo "$E2E_FOO|$E2E_NUM"').stdout
    assert out == "bar baz|7\n"
    # the static get_info gives the same answer
    info2 = Sandbox.get_info(sbx.sandbox_id)
    assert info2.sandbox_id == sbx.sandbox_id
    assert info2.metadata == info.metadata


def test_sandbox_ids_are_unique(make_sandbox):
    a = make_sandbox(timeout=60)
    b = make_sandbox(timeout=60)
    assert a.sandbox_id != b.sandbox_id
    assert a.sandbox_id and b.sandbox_id


def test_list_with_metadata_state_and_pagination(make_sandbox):
    tag = unique("list")
    created = set()
    for i in range(3):
        sbx = make_sandbox(timeout=120, metadata={"e2e-tag": tag, "idx": str(i), "note": "hello world&x=1"})
        created.add(sbx.sandbox_id)

    query = SandboxQuery(metadata={"e2e-tag": tag}, state=[SandboxState.RUNNING])

    # one page with everything
    assert set(_listed_ids(query=query)) == created

    # pages of two
    paginator = Sandbox.list(query=query, limit=2)
    assert paginator.has_next
    first = paginator.next_items()
    assert len(first) == 2, f"first page has {len(first)} items, expected 2"
    assert paginator.has_next, "a second page must be announced (X-Next-Token)"
    seen = [s.sandbox_id for s in first]
    pages = 1
    while paginator.has_next:
        page = paginator.next_items()
        pages += 1
        assert len(page) <= 2
        seen.extend(s.sandbox_id for s in page)
        assert pages <= 5, "pagination does not end"
    assert len(seen) == len(set(seen)), f"duplicates across pages: {seen}"
    assert set(seen) == created
    assert not paginator.has_next

    # listed items carry the metadata and the running state
    items = Sandbox.list(query=query).next_items()
    for item in items:
        assert item.metadata.get("e2e-tag") == tag
        assert item.metadata.get("note") == "hello world&x=1"
        assert item.state == SandboxState.RUNNING
        assert item.template_id
        assert item.cpu_count == 2 and item.memory_mb == 512

    # filter on two keys, one with characters that need encoding
    q2 = SandboxQuery(metadata={"e2e-tag": tag, "idx": "1", "note": "hello world&x=1"})
    assert len(_listed_ids(query=q2)) == 1

    # non-matching filters
    assert _listed_ids(query=SandboxQuery(metadata={"e2e-tag": tag + "-nope"})) == []
    assert _listed_ids(query=SandboxQuery(metadata={"e2e-tag": tag, "idx": "9"})) == []
    assert _listed_ids(query=SandboxQuery(metadata={"e2e-tag": tag}, state=[SandboxState.PAUSED])) == []
    both = SandboxQuery(metadata={"e2e-tag": tag}, state=[SandboxState.RUNNING, SandboxState.PAUSED])
    assert set(_listed_ids(query=both)) == created

    # the unfiltered listing contains them too
    assert created <= set(_listed_ids())


def test_set_timeout_moves_end_at(sandbox):
    before = sandbox.get_info().end_at
    sandbox.set_timeout(600)
    after = sandbox.get_info().end_at
    assert after > before
    remaining = (after - _now()).total_seconds()
    assert 580 <= remaining <= 610, f"end_at is {remaining}s away, expected ~600s"

    # E2B allows shortening with set_timeout
    sandbox.set_timeout(60)
    shorter = sandbox.get_info().end_at
    remaining = (shorter - _now()).total_seconds()
    assert 45 <= remaining <= 65, f"end_at is {remaining}s away, expected ~60s"

    # static variant
    Sandbox.set_timeout(sandbox.sandbox_id, 300)
    remaining = (sandbox.get_info().end_at - _now()).total_seconds()
    assert 285 <= remaining <= 305
    assert sandbox.is_running()


def test_set_timeout_unknown_sandbox_raises(sandbar):
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout("inotexisting0000000000", 30)


def test_expiry(make_sandbox):
    sbx = make_sandbox(timeout=3)
    sid = sbx.sandbox_id
    wait_until(lambda: not sbx.is_running(request_timeout=5), timeout=20, interval=0.5, message="sandbox to expire")
    wait_until(lambda: _unknown(sid), timeout=10, message="get_info to raise SandboxNotFoundException")
    assert sid not in _listed_ids()
    assert Sandbox.kill(sid) is False
    with pytest.raises(SandboxException):
        sbx.commands.run("echo should-not-run", timeout=10)


def test_sandbox_that_dies_is_cleaned_up(make_sandbox):
    """If a sandbox's processes die behind the server's back, it is unlisted and released."""
    sbx = make_sandbox(timeout=300)
    sid = sbx.sandbox_id
    procs = [Path(d) / "cgroup.procs" for d in sandbox_cgroup_dirs(sid)]
    pids = sorted({int(p) for f in procs if f.exists() for p in f.read_text().split()})
    assert pids, f"no host processes found for {sid}"
    # The lowest host PID is the sandbox's init; killing it ends the whole PID namespace.
    os.kill(pids[0], signal.SIGKILL)
    wait_until(lambda: _unknown(sid), timeout=20, interval=0.5, message="the dead sandbox to be cleaned up")
    assert sid not in _listed_ids()
    assert sandbox_cgroup_dirs(sid) == set()


def test_kill_returns_true_then_false(make_sandbox):
    sbx = make_sandbox(timeout=120)
    sid = sbx.sandbox_id
    assert sbx.is_running()
    assert sbx.kill() is True
    assert sbx.kill() is False
    assert Sandbox.kill(sid) is False
    with pytest.raises(SandboxNotFoundException):
        sbx.get_info()
    assert not sbx.is_running()
    assert sid not in _listed_ids()


def test_static_kill(make_sandbox):
    sbx = make_sandbox(timeout=120)
    assert Sandbox.kill(sbx.sandbox_id) is True
    wait_until(lambda: not sbx.is_running(request_timeout=5), timeout=10, message="sandbox to stop")
    assert Sandbox.kill(sbx.sandbox_id) is False


def test_kill_unknown_sandbox_returns_false(sandbar):
    assert Sandbox.kill("inotexisting0000000000") is False


def test_connect_to_running_sandbox(sandbox):
    sandbox.files.write("/home/user/connect-marker.txt", "connected!")
    other = Sandbox.connect(sandbox.sandbox_id)
    assert other.sandbox_id == sandbox.sandbox_id
    assert other.files.read("/home/user/connect-marker.txt") == "connected!"
    assert other.commands.run("cat /home/user/connect-marker.txt").stdout == "connected!"
    assert other.is_running()

    # connect never shortens the timeout (E2B: extend only)
    end_before = sandbox.get_info().end_at
    Sandbox.connect(sandbox.sandbox_id, timeout=5)
    end_after = sandbox.get_info().end_at
    assert end_after >= end_before - timedelta(seconds=1), "connect(timeout=5) shortened the sandbox's life"

    # ...but extends it
    Sandbox.connect(sandbox.sandbox_id, timeout=900)
    remaining = (sandbox.get_info().end_at - _now()).total_seconds()
    assert 880 <= remaining <= 910, f"end_at is {remaining}s away after connect(timeout=900)"

    # instance variant
    assert sandbox.connect() is sandbox
    assert sandbox.commands.run("echo again").stdout == "again\n"


def test_connect_unknown_sandbox_raises(sandbar):
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect("inotexisting0000000000")


def test_concurrent_creates(make_sandbox):
    from concurrent.futures import ThreadPoolExecutor

    def work(i):
        sbx = make_sandbox(timeout=60, metadata={"i": str(i)})
        return sbx.sandbox_id, sbx.commands.run(f"echo sbx{i}").stdout

    with ThreadPoolExecutor(max_workers=5) as pool:
        results = list(pool.map(work, range(5)))
    ids = [r[0] for r in results]
    assert len(set(ids)) == 5
    assert [r[1] for r in results] == [f"sbx{i}\n" for i in range(5)]
    for sid in ids:
        assert Sandbox.kill(sid) is True


def test_context_manager_kills(sandbar):
    with Sandbox.create(timeout=60) as sbx:
        sid = sbx.sandbox_id
        assert sbx.commands.run("echo in-context").stdout == "in-context\n"
    assert Sandbox.kill(sid) is False
