"""Custom templates: `Template.build` from the Python SDK (and the raw build API) against images
in the local registries of the `registry` fixture and against the `base` template.

Covers the build flow (POST /v3/templates, file uploads, POST /v2/templates/{id}/builds/{buildID},
status polling), what a built template gives its sandboxes (files, envs, default user and
workdir, start and ready commands), image layer semantics (whiteouts, opaque directories), the
per-step build cache, failures with clear messages and nothing left behind, hostile upload
archives, private registries, and the template listing, tags and deletion.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set

import httpx
import pytest
from e2b import BuildException, Sandbox, Template, wait_for_file

from e2e_util import (
    CREATED_IDS,
    add_tar_entry,
    build_log_messages,
    checkpoints_off,
    all_pids,
    host_mounts_mentioning,
    other_sandbar_servers,
    sandbox_cgroup_dirs,
    sandbox_like_processes,
    unique,
    wait_build_end,
    wait_until,
)

# Upper bound for one successful build; the SDK itself polls without a limit.
BUILD_TIMEOUT = 300
# Failing builds, including a ready command that never succeeds, must end within this.
FAILURE_TIMEOUT = 120
STEP_RE = re.compile(r"\[(\d+)/(\d+)\]")

# Names of every template this module builds, deleted when the module ends.
_BUILT: Set[str] = set()


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


@dataclass
class Build:
    name: str
    info: object = None
    error: Optional[BaseException] = None
    logs: List[object] = field(default_factory=list)
    elapsed: float = 0.0

    def messages(self) -> List[str]:
        return [str(getattr(e, "message", e)) for e in self.logs]

    def log_text(self) -> str:
        return "\n".join(self.messages())


def _run_build(template, name: str, timeout: float, **kwargs) -> Build:
    """Template.build in a thread, bounded by `timeout`, with every log entry collected."""
    _BUILT.add(name.split(":", 1)[0])
    b = Build(name=name)
    done = threading.Event()

    def target():
        try:
            b.info = Template.build(template, name, on_build_logs=b.logs.append, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            b.error = e
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=target, daemon=True, name=f"build-{name}").start()
    finished = done.wait(timeout)
    b.elapsed = time.monotonic() - t0
    if not finished:
        raise AssertionError(
            f"Template.build({name!r}) did not finish within {timeout}s; logs so far:\n{b.log_text()}"
        )
    return b


def build_ok(template, name: str, timeout: float = BUILD_TIMEOUT, **kwargs) -> Build:
    b = _run_build(template, name, timeout, **kwargs)
    if b.error is not None:
        raise AssertionError(f"build of {name!r} failed: {b.error!r}\nbuild logs:\n{b.log_text()}") from b.error
    return b


def build_fails(template, name: str, timeout: float = FAILURE_TIMEOUT, **kwargs) -> Build:
    b = _run_build(template, name, timeout, **kwargs)
    assert b.error is not None, f"build of {name!r} succeeded but should have failed\nlogs:\n{b.log_text()}"
    assert isinstance(b.error, BuildException), f"expected BuildException, got {b.error!r}\n{b.log_text()}"
    return b


def step_lines(b: Build) -> Dict[int, List[str]]:
    """Build-step log messages grouped by their `[n/total]` marker; checks the numbering."""
    by_n: Dict[int, List[str]] = {}
    totals = set()
    for msg in b.messages():
        m = STEP_RE.search(msg)
        if m:
            by_n.setdefault(int(m.group(1)), []).append(msg)
            totals.add(int(m.group(2)))
    assert by_n, f"no `[n/total]` step lines in the build logs:\n{b.log_text()}"
    assert len(totals) == 1, f"step lines disagree on the total {sorted(totals)}:\n{b.log_text()}"
    total = totals.pop()
    assert sorted(by_n) == list(range(1, total + 1)), (
        f"step lines {sorted(by_n)} do not cover 1..{total}:\n{b.log_text()}"
    )
    return by_n


def locate_steps(by_n: Dict[int, List[str]], types: List[str]) -> List[int]:
    """Step numbers of the template's own steps, given their types in order (COPY, RUN, ...)."""

    def has(n: int, t: str) -> bool:
        return any(re.search(rf"\b{t}\b", m) for m in by_n[n])

    ns = sorted(by_n)
    for start in range(len(ns) - len(types) + 1):
        window = ns[start : start + len(types)]
        if all(has(n, t) for n, t in zip(window, types)):
            return window
    found, i = [], 0
    for t in types:
        while i < len(ns) and not has(ns[i], t):
            i += 1
        assert i < len(ns), f"no step line for {t} (steps {types}) in:\n" + "\n".join(
            m for n in ns for m in by_n[n]
        )
        found.append(ns[i])
        i += 1
    return found


def cached(by_n: Dict[int, List[str]], n: int) -> bool:
    return any("CACHED" in m for m in by_n[n])


def run(sbx, cmd: str, **kw) -> str:
    return sbx.commands.run(cmd, timeout=30, **kw).stdout


def context_dir(root: Path, files: Dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def tmp_named_dirs(data_dir: Path) -> List[str]:
    """Directories named `.tmp-*` at depth 1 or 2 under images/, sandboxes/.images/ (where image
    layers are unpacked) and sandboxes/layers/."""
    found = []
    for top in (data_dir / "images", data_dir / "sandboxes" / ".images", data_dir / "sandboxes" / "layers"):
        try:
            level1 = list(top.iterdir())
        except OSError:
            continue
        for p in level1:
            if p.name.startswith(".tmp-"):
                found.append(str(p))
            if p.is_dir() and not p.is_symlink():
                try:
                    found.extend(str(q) for q in p.iterdir() if q.name.startswith(".tmp-"))
                except OSError:
                    pass
    return found


class Baseline:
    """Host state before a build that is expected to fail."""

    def __init__(self, sandbar):
        self.sandbar = sandbar
        self.pids = all_pids()
        self.cgroups = sandbox_cgroup_dirs()
        # The server keeps some mounts of its own under the data dir (the sandbox disk pool).
        self.mounts = set(host_mounts_mentioning(str(sandbar.data_dir)))

    def leftovers(self, extra: Callable[[], List[str]] = lambda: []) -> List[str]:
        data_dir = Path(self.sandbar.data_dir)
        own = [self.sandbar.proc.pid, self.sandbar.pid] if self.sandbar.proc is not None else []
        strict = not other_sandbar_servers(exclude=own)
        out = []
        mounts = [m for m in host_mounts_mentioning(str(data_dir)) if m not in self.mounts]
        if mounts:
            out.append(f"new mounts mentioning the data dir: {mounts[:5]}")
        procs = sandbox_like_processes(data_dir, self.pids, CREATED_IDS)
        # Sandboxes the server boots ahead of demand come and go on their own.
        stray = sorted(
            (p, d["desc"])
            for p, d in procs.items()
            if (strict or d["mine"]) and "cgroup sandbar/warm-" not in d["desc"]
        )
        if stray:
            out.append("processes left: " + "; ".join(f"{p}: {d}" for p, d in stray[:10]))
        if strict:
            cgroups = {c for c in sandbox_cgroup_dirs() - self.cgroups if not Path(c).name.startswith("warm-")}
            if cgroups:
                out.append(f"sandbox cgroups left: {sorted(cgroups)}")
        tmp = tmp_named_dirs(data_dir)
        if tmp:
            out.append(f".tmp-* directories left: {tmp}")
        out.extend(extra())
        return out

    def assert_clean(self, extra: Callable[[], List[str]] = lambda: [], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        found = self.leftovers(extra)
        while found and time.monotonic() < deadline:
            time.sleep(0.5)
            found = self.leftovers(extra)
        assert not found, "after a failed build:\n  " + "\n  ".join(found)


def processes_matching(text: str, exclude: Set[int]) -> List[str]:
    out = []
    for pid in all_pids() - exclude:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue
        if text in cmd:
            out.append(f"{pid}: {cmd}")
    return out


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _delete_built_templates(sandbar):
    """Templates built here do not outlive the module (the data dir is kept between runs)."""
    yield
    with sandbar.client() as api:
        try:
            listed = api.get("/templates").json()
        except Exception:  # noqa: BLE001 - best effort
            return
        for t in listed:
            names = set(t.get("aliases") or []) | {n.split(":", 1)[0] for n in (t.get("names") or [])}
            if names & _BUILT:
                try:
                    api.delete(f"/templates/{t['templateID']}")
                except Exception:  # noqa: BLE001 - best effort
                    pass
    _BUILT.clear()


@dataclass
class GoodTemplate:
    name: str
    marker: str


@pytest.fixture(scope="module")
def good_template(sandbar, tiny1) -> GoodTemplate:
    """A successfully built template; the failing builds below reuse its name."""
    name = unique("keep")
    marker = unique("good")
    build_ok(Template().from_image(tiny1).run_cmd(f"echo {marker} > /tmp/good-marker"), name)
    return GoodTemplate(name, marker)


def assert_good_build_intact(good: GoodTemplate) -> None:
    """`Sandbox.create(name)` still gets the last good build of the name."""
    sbx = Sandbox.create(good.name, timeout=60)
    try:
        assert run(sbx, "cat /tmp/good-marker") == good.marker + "\n"
    finally:
        sbx.kill()


# --------------------------------------------------------------------------
# building and using templates
# --------------------------------------------------------------------------


def test_build_from_registry_image(sandbar, tiny1, tmp_path, make_sandbox):
    """from_image + COPY (file and dir) + RUN + ENV + WORKDIR + USER + start/ready commands."""
    ctx = context_dir(
        tmp_path / "ctx",
        {"hello.txt": "hello from the context\n", "dir/a.txt": "a\n", "dir/sub/b.txt": "b\n"},
    )
    name = unique("tiny")
    template = (
        Template(file_context_path=str(ctx))
        .from_image(tiny1)
        .copy("hello.txt", "/app/hello.txt")
        .copy("dir", "/app/dir")
        .run_cmd("echo built > /built.txt", user="root")
        .set_envs({"GREETING": "hi"})
        .set_workdir("/app")
        .set_user("user")
        .set_start_cmd(
            "sh -c 'cat /proc/sys/kernel/random/uuid > /tmp/nonce; echo started > /tmp/started; sleep 3600'",
            wait_for_file("/tmp/started"),
        )
    )
    b = build_ok(template, name)
    assert b.info.template_id and b.info.build_id
    by_n = step_lines(b)
    locate_steps(by_n, ["COPY", "COPY", "RUN", "ENV", "WORKDIR", "USER"])

    sbx = make_sandbox(template=name)
    assert run(sbx, "cat /app/hello.txt") == "hello from the context\n"
    assert run(sbx, "cat /app/dir/a.txt /app/dir/sub/b.txt") == "a\nb\n"
    assert run(sbx, "cat /built.txt") == "built\n"
    assert run(sbx, "echo $GREETING $FROM_IMAGE") == "hi tiny\n"
    assert run(sbx, "pwd") == "/app\n"
    assert run(sbx, "whoami") == "user\n"
    assert run(sbx, "id -un") == "user\n"
    # The E2B prerequisites: user `user` with home /home/user, added to an image that had only root.
    passwd = run(sbx, "grep '^user:' /etc/passwd")
    assert passwd.split(":")[5] == "/home/user", passwd
    assert run(sbx, "test -d /home/user && echo yes") == "yes\n"
    # The start command runs in the sandbox, and create returned only once it was ready.
    assert run(sbx, "cat /tmp/started") == "started\n"
    ps = run(sbx, "ps -o pid,args")
    assert "sleep 3600" in ps, ps
    if not checkpoints_off(sandbar):
        # Captured once ready at the build: the sandbox was restored with the start command
        # already run, not started again.
        second = make_sandbox(template=name)
        assert run(second, "cat /tmp/nonce") == run(sbx, "cat /tmp/nonce")
    # Envs and the workdir apply to explicit users too.
    assert run(sbx, "echo $GREETING; pwd", user="root") == "hi\n/app\n"

    # Paused with its memory and checkpointed, where the server can: the start command's
    # process is in the checkpoint (the server no longer holds a connection to the agent for
    # it, which no dump could contain) and runs on after the resume.
    if checkpoints_off(sandbar) is None:
        sleeper = [l.strip() for l in ps.splitlines() if "sleep 3600" in l]
        assert sbx.pause() is True
        wait_until(lambda: (sandbar.data_dir / "checkpoints" / sbx.sandbox_id / "header").exists(),
                   timeout=30, message="the checkpoint")
        sbx = Sandbox.connect(sbx.sandbox_id, timeout=60)
        ps = run(sbx, "ps -o pid,args")
        assert [l.strip() for l in ps.splitlines() if "sleep 3600" in l] == sleeper, ps

    # Paused without memory, it boots again on its files when resumed: same image, user and
    # environment, and the start command runs anew.
    run(sbx, "echo mine > /app/mark")
    assert sbx.pause(mode="filesystem") is True
    again = Sandbox.connect(sbx.sandbox_id, timeout=60)
    assert run(again, "cat /app/mark /built.txt") == "mine\nbuilt\n"
    assert run(again, "echo $GREETING; whoami; pwd") == "hi\nuser\n/app\n"
    ps = run(again, "ps -o pid,args")
    assert "sleep 3600" in ps, ps


def test_build_from_base_template(sandbar, base_template, make_sandbox):
    """from_template("base"): steps run on top of the default template, envs apply to later steps."""
    name = unique("frombase")
    template = (
        Template()
        .from_template("base")
        .run_cmd("python3 -c 'print(6*7)' > /x", user="root")
        .set_envs({"FROM_BASE": "yes"})
        .run_cmd("echo $FROM_BASE > /tmp/env-at-build")
    )
    b = build_ok(template, name)
    locate_steps(step_lines(b), ["RUN", "ENV", "RUN"])
    sbx = make_sandbox(template=name)
    assert run(sbx, "cat /x") == "42\n"
    assert run(sbx, "cat /tmp/env-at-build") == "yes\n"
    assert run(sbx, "echo $FROM_BASE") == "yes\n"
    assert run(sbx, "python3 -c 'print(1)'") == "1\n"
    assert run(sbx, "id -un user") == "user\n"


def test_image_layers_apply_whiteouts_and_opaque_dirs(sandbar, registry, make_sandbox):
    """tiny:2's top layer deletes /etc/motd and replaces /opt/data with only new.txt."""
    name = unique("layers")
    build_ok(Template().from_image(registry.image("e2e/tiny:2")), name)
    sbx = make_sandbox(template=name)
    assert run(sbx, "test -e /etc/motd && echo present || echo absent") == "absent\n"
    assert run(sbx, "ls -A /opt/data") == "new.txt\n"
    assert run(sbx, "cat /opt/data/new.txt") == "new\n"
    assert run(sbx, "echo $FROM_IMAGE") == "tiny\n"


def test_build_cache(sandbar, tiny1, tmp_path, make_sandbox):
    """Identical rebuild: every step CACHED; a changed step reruns from there; skip_cache reruns all."""
    token = unique("cache")
    ctx = context_dir(tmp_path / "ctx", {"a.txt": token + "\n"})
    name = unique("cache")
    types = ["RUN", "COPY", "RUN", "RUN"]

    def template(variant: str):
        return (
            Template(file_context_path=str(ctx))
            .from_image(tiny1)
            .run_cmd(f"echo {token} > /tmp/token")
            .copy("a.txt", "/c/a.txt")
            .run_cmd(f"echo {variant} > /tmp/variant")
            .run_cmd("cat /proc/sys/kernel/random/uuid > /tmp/stamp")
        )

    def contents() -> List[str]:
        """[a.txt, variant, stamp] as a sandbox of the current build sees them."""
        sbx = make_sandbox(template=name)
        out = run(sbx, "cat /c/a.txt /tmp/variant /tmp/stamp").splitlines()
        sbx.kill()
        return out

    first = build_ok(template("v1"), name)
    by_n = step_lines(first)
    steps = locate_steps(by_n, types)
    assert not any(cached(by_n, n) for n in steps), "a fresh template's steps came from the cache:\n" + first.log_text()
    c1 = contents()
    assert c1[:2] == [token, "v1"] and len(c1) == 3, c1

    again = build_ok(template("v1"), name)
    by_n = step_lines(again)
    not_cached = [by_n[n] for n in sorted(by_n) if not cached(by_n, n)]
    assert not not_cached, f"identical rebuild reran steps {not_cached}:\n{again.log_text()}"
    assert contents() == c1, "the identical rebuild did not reuse the RUN layers"

    changed = build_ok(template("v2"), name)
    by_n = step_lines(changed)
    run_token, copy, run_variant, run_stamp = locate_steps(by_n, types)
    assert cached(by_n, run_token) and cached(by_n, copy), changed.log_text()
    assert not cached(by_n, run_variant) and not cached(by_n, run_stamp), changed.log_text()
    c3 = contents()
    assert c3[:2] == [token, "v2"] and c3[2] != c1[2], (c1, c3)

    forced = build_ok(template("v2"), name, skip_cache=True)
    by_n = step_lines(forced)
    reused = [by_n[n] for n in sorted(by_n) if cached(by_n, n)]
    assert not reused, f"skip_cache=True still reused {reused}:\n{forced.log_text()}"
    c4 = contents()
    assert c4[:2] == [token, "v2"] and c4[2] != c3[2], (c3, c4)


def test_private_registry_with_credentials(sandbar, registry, make_sandbox):
    name = unique("private")
    template = (
        Template()
        .from_image(registry.auth_image, username=registry.username, password=registry.password)
        .run_cmd("echo private > /tmp/private")
    )
    build_ok(template, name)
    sbx = make_sandbox(template=name)
    assert run(sbx, "cat /tmp/private") == "private\n"
    assert run(sbx, "echo $FROM_IMAGE") == "tiny\n"


def test_exists_list_tags_and_delete(sandbar, tiny1, make_sandbox):
    name = unique("tags")
    b = build_ok(Template().from_image(tiny1).run_cmd(f"echo {name} > /tmp/which"), name, tags=["v1"])
    assert "v1" in (b.info.tags or []), b.info
    assert Template.exists(name) is True
    assert Template.exists(unique("absent")) is False

    with sandbar.client() as api:
        listed = api.get("/templates")
        assert listed.status_code == 200, listed.text
        mine = [t for t in listed.json() if name in (t.get("aliases") or []) + (t.get("names") or [])]
        assert [t["templateID"] for t in mine] == [b.info.template_id], listed.json()
        assert mine[0]["buildStatus"] == "ready", mine[0]

        tagged = make_sandbox(template=f"{name}:v1")
        assert run(tagged, "cat /tmp/which") == name + "\n"
        running = make_sandbox(template=name)

        # Tags move between builds through the SDK's own calls.
        assigned = Template.assign_tags(f"{name}:v1", ["stable"])
        assert assigned.tags == ["stable"] and assigned.build_id == b.info.build_id, assigned
        assert sorted(t.tag for t in Template.get_tags(b.info.template_id)) == ["stable", "v1"]
        assert run(make_sandbox(template=f"{name}:stable"), "cat /tmp/which") == name + "\n"
        Template.remove_tags(name, ["stable"])
        assert [t.tag for t in Template.get_tags(b.info.template_id)] == ["v1"]
        r = api.post("/v2/sandboxes", json={"templateID": f"{name}:stable", "timeout": 30})
        assert r.status_code == 404, f"create from a removed tag: {r.status_code} {r.text}"

        r = api.delete(f"/templates/{b.info.template_id}")
        assert r.status_code in (200, 204), f"{r.status_code} {r.text}"
        assert Template.exists(name) is False
        assert not [t for t in api.get("/templates").json() if name in (t.get("aliases") or [])]
        r = api.post("/v2/sandboxes", json={"templateID": name, "timeout": 30})
        assert r.status_code == 404, f"create from a deleted template: {r.status_code} {r.text}"

    # Sandboxes that were already running keep working.
    assert run(running, "cat /tmp/which") == name + "\n"
    assert run(tagged, "echo still here") == "still here\n"


# --------------------------------------------------------------------------
# failures: clear message, nothing left behind, the last good build stays
# --------------------------------------------------------------------------


def test_failing_run_cmd(sandbar, tiny1, good_template):
    token = unique("fail")
    base = Baseline(sandbar)
    template = Template().from_image(tiny1).run_cmd(f"echo {token}-stdout; echo {token}-stderr >&2; exit 173")
    b = build_fails(template, good_template.name)
    msg = str(b.error)
    assert re.search(r"\b173\b", msg), f"exit code missing from {msg!r}"
    assert "RUN" in msg or token in msg or re.search(r"step\s*\d", msg, re.I), f"step not named in {msg!r}"
    assert f"{token}-stdout" in b.log_text(), f"command output not in the build logs:\n{b.log_text()}"
    base.assert_clean()
    assert_good_build_intact(good_template)


@pytest.mark.parametrize(
    "case", ["bad_reference", "unreachable_registry", "missing_tag", "wrong_password", "no_credentials"]
)
def test_base_image_problems_fail_clearly(sandbar, registry, good_template, case):
    bad_password = "wrong-" + unique("pw")
    ref, creds = {
        "bad_reference": (f"{registry.host}/e2e/Tiny::1", None),
        "unreachable_registry": (f"{registry.closed_host}/e2e/tiny:1", None),
        "missing_tag": (registry.image("e2e/tiny:no-such-tag"), None),
        "wrong_password": (registry.auth_image, (registry.username, bad_password)),
        "no_credentials": (registry.auth_image, None),
    }[case]
    base = Baseline(sandbar)
    template = Template()
    template = (
        template.from_image(ref, username=creds[0], password=creds[1]) if creds else template.from_image(ref)
    )
    b = build_fails(template.run_cmd("echo unreachable > /tmp/never"), good_template.name)
    msg = str(b.error)
    assert ref in msg, f"{case}: the image {ref!r} is not named in {msg!r}"
    assert bad_password not in msg and bad_password not in b.log_text(), "the password leaked into the build output"
    base.assert_clean()
    assert_good_build_intact(good_template)


def test_ready_cmd_that_never_succeeds_fails_the_build(sandbar, tiny1, good_template):
    base = Baseline(sandbar)
    template = Template().from_image(tiny1).set_start_cmd("sleep 3607", "exit 3")
    b = build_fails(template, good_template.name, timeout=FAILURE_TIMEOUT)
    assert b.elapsed < FAILURE_TIMEOUT
    base.assert_clean(extra=lambda: processes_matching("sleep 3607", base.pids))
    assert_good_build_intact(good_template)


def test_ready_cmd_that_never_ends_fails_the_build(sandbar, tiny1, good_template):
    """A ready command that never exits is held to the ready timeout like one that fails."""
    base = Baseline(sandbar)
    template = Template().from_image(tiny1).set_start_cmd("sleep 3608", "sleep 3609")
    b = build_fails(template, good_template.name, timeout=FAILURE_TIMEOUT)
    assert b.elapsed < FAILURE_TIMEOUT
    assert "did not end within" in str(b.error) + b.log_text(), f"{b.error}\n{b.log_text()}"
    base.assert_clean(
        extra=lambda: processes_matching("sleep 3608", base.pids)
        + processes_matching("sleep 3609", base.pids)
    )
    assert_good_build_intact(good_template)


# --------------------------------------------------------------------------
# hostile upload archives, through the raw API
# --------------------------------------------------------------------------


def hostile_archive(case: str, canary: Path, token: str):
    """(gzip tar bytes, text the failure reason must contain) for one kind of bad entry."""
    deep_up = "../" * 16 + str(canary).lstrip("/")
    entries = {
        "dotdot": ([(f"../escape-{token}", "file", "")], f"escape-{token}"),
        "dotdot_deep": ([(f"{deep_up}/escape", "file", "")], f"{canary.name}/escape"),
        "absolute": ([(f"{canary}/abs-escape", "file", "")], f"{canary.name}/abs-escape"),
        "symlink_parent": (
            [("ctx/evil-link", "symlink", str(canary)), ("ctx/evil-link/pwn", "file", "")],
            "evil-link",
        ),
        "hardlink_etc_passwd": ([("ctx/hardlink-to-passwd", "hardlink", "/etc/passwd")], "hardlink-to-passwd"),
        "hardlink_parent": ([("ctx/hardlink-to-parent", "hardlink", "../x")], "hardlink-to-parent"),
        "chardev": ([("ctx/chardev-mem", "chardev", "")], "chardev-mem"),
    }
    bad, named = entries[case]
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        add_tar_entry(tar, "ctx", "dir")
        add_tar_entry(tar, "ctx/ok.txt", "file", b"ok\n")
        for name, kind, target in bad:
            add_tar_entry(tar, name, kind, target=target)
    return gzip.compress(raw.getvalue()), named


def _tar_names(gz: bytes) -> List[str]:
    with tarfile.open(fileobj=io.BytesIO(gz), mode="r:gz") as tar:
        return tar.getnames()


HOSTILE_CASES = [
    "dotdot",
    "dotdot_deep",
    "absolute",
    "symlink_parent",
    "hardlink_etc_passwd",
    "hardlink_parent",
    "chardev",
]


@pytest.mark.parametrize("case", HOSTILE_CASES)
def test_hostile_upload_archive_fails_the_build(sandbar, base_template, good_template, case):
    token = unique("canary")
    canary = Path("/tmp") / f"sbtest-{token}"
    canary.mkdir(mode=0o755)
    target = canary / "target"
    target.write_text("canary\n")
    passwd_before = os.stat("/etc/passwd")
    with open("/etc/passwd", "rb") as f:
        passwd_bytes = f.read()
    try:
        archive, named = hostile_archive(case, canary, token)
        assert len(_tar_names(archive)) >= 3, _tar_names(archive)
        files_hash = hashlib.sha256(archive + token.encode()).hexdigest()
        base = Baseline(sandbar)

        with sandbar.client() as api:
            r = api.post("/v3/templates", json={"name": good_template.name})
            assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
            template_id, build_id = r.json()["templateID"], r.json()["buildID"]

            r = api.get(f"/templates/{template_id}/files/{files_hash}")
            assert r.status_code == 201, f"GET files/{files_hash}: {r.status_code} {r.text}"
            link = r.json()
            assert link.get("present") is False and link.get("url"), link
            headers = {k: v for k, v in (link.get("headers") or {}).items() if k.lower() != "content-length"}
            put = httpx.put(link["url"], content=archive, headers=headers, timeout=60)
            # A server may refuse the archive right away; the build must fail either way.
            assert put.status_code < 300 or 400 <= put.status_code < 500, f"PUT: {put.status_code} {put.text}"
            early = put.text if put.status_code >= 400 else ""

            r = api.post(
                f"/v2/templates/{template_id}/builds/{build_id}",
                json={
                    "fromTemplate": "base",
                    "steps": [
                        {"type": "COPY", "args": ["ctx", "/dst", "", ""], "filesHash": files_hash, "force": False}
                    ],
                },
            )
            assert r.status_code == 202, f"POST build: {r.status_code} {r.text}"
            status = wait_build_end(api, template_id, build_id, timeout=FAILURE_TIMEOUT, interval=0.5)

        logs = "\n".join(build_log_messages(status))
        assert status["status"] == "error", f"{case}: the build succeeded:\n{logs}"
        reason = (status.get("reason") or {}).get("message", "")
        assert named in reason or named in early, (
            f"{case}: {named!r} not named in the reason {reason!r} (upload answer {early!r})\nlogs:\n{logs}"
        )

        # Nothing was created outside the template.
        assert sorted(os.listdir(canary)) == ["target"], f"{case}: canary dir now has {os.listdir(canary)}"
        assert os.stat(target).st_nlink == 1
        after = os.stat("/etc/passwd")
        assert (after.st_ino, after.st_nlink) == (passwd_before.st_ino, passwd_before.st_nlink)
        with open("/etc/passwd", "rb") as f:
            assert f.read() == passwd_bytes
        strays = subprocess.run(
            ["find", str(sandbar.data_dir), "/tmp", "/var/tmp", "-xdev", "-name", f"*{token}*",
             "-not", "-path", f"{canary}*"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout.split()
        assert not strays, f"{case}: files named after the canary appeared: {strays}"
        base.assert_clean()
        assert_good_build_intact(good_template)
    finally:
        shutil.rmtree(canary, ignore_errors=True)


# --------------------------------------------------------------------------
# Dockerfile builds (POST /templates, the seed's v1 flow)
# --------------------------------------------------------------------------


def test_dockerfile_build_with_context_and_access_token(sandbar, tiny1, make_sandbox):
    name = unique("dockerfile")
    dockerfile = (
        f"ARG FLAVOUR=plain\nFROM {tiny1}\nENV GREETING=hello\n"
        "RUN echo built-$FLAVOUR > /built.txt\n"
        "COPY --chown=user --chmod=640 app.txt /app/\nWORKDIR /app\nUSER user\nLABEL purpose=test\n"
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        add_tar_entry(tar, "app.txt", data=f"{name}\n".encode())
    context = buf.getvalue()
    context_hash = hashlib.sha256(context).hexdigest()
    token = __import__("json").loads((sandbar.data_dir / "credentials.json").read_text())["accessToken"]
    # The seed's Dockerfile routes take an access token as a bearer.
    with httpx.Client(base_url=sandbar.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as bearer:
        r = bearer.post("/templates", json={"dockerfile": dockerfile, "alias": name, "memoryMB": 512})
        assert r.status_code == 202, f"{r.status_code} {r.text}"
        template_id, build_id = r.json()["templateID"], r.json()["buildID"]
        assert name in r.json()["aliases"], r.json()
        link = bearer.get(f"/templates/{template_id}/files/{context_hash}").json()
        assert httpx.put(link["url"], content=context, timeout=60).status_code < 300
        r = bearer.post(f"/templates/{template_id}/builds/{build_id}")
        assert r.status_code == 202, f"{r.status_code} {r.text}"
        status = wait_build_end(bearer, template_id, build_id, timeout=BUILD_TIMEOUT)
        assert status["status"] == "ready", status
    sbx = make_sandbox(template=name)
    assert run(sbx, "cat /app/app.txt /built.txt") == f"{name}\nbuilt-plain\n"
    assert run(sbx, "pwd; whoami; echo $GREETING") == "/app\nuser\nhello\n"
    assert run(sbx, "stat -c %a:%U /app/app.txt") == "640:user\n"


@pytest.mark.parametrize(
    "dockerfile,expected",
    [
        ("FROM alpine\nRUN true\nHEALTHCHECK CMD true\n", ["line 3", "HEALTHCHECK"]),
        ("FROM alpine AS one\nFROM alpine\n", ["line 2", "FROM"]),
        ("FROM alpine\nADD https://example.invalid/x /x\n", ["line 2", "ADD"]),
        ("FROM alpine\nFROBNICATE x\n", ["line 2"]),
        ("RUN echo no base\n", ["FROM"]),
    ],
)
def test_unsupported_or_malformed_dockerfiles_are_refused(sandbar, dockerfile, expected):
    with sandbar.client() as api:
        r = api.post("/templates", json={"dockerfile": dockerfile, "alias": unique("bad")})
        assert r.status_code == 400, f"{r.status_code} {r.text}"
        message = r.json()["message"]
        for part in expected:
            assert part in message, message


def test_dockerfile_copy_without_context_is_refused(sandbar, tiny1):
    with sandbar.client() as api:
        r = api.post("/templates", json={"dockerfile": f"FROM {tiny1}\nCOPY a.txt /a.txt\n", "alias": unique("noctx")})
        assert r.status_code == 202, f"{r.status_code} {r.text}"
        r = api.post(f"/templates/{r.json()['templateID']}/builds/{r.json()['buildID']}")
        assert r.status_code == 400 and "build context" in r.json()["message"], f"{r.status_code} {r.text}"
