"""Template builds as a hostile tenant: no build may read or change a file of the host.

`sandbar serve` runs as root and builds templates for tenants who hold only an API key. Every
test here aims a build at a victim directory outside the data dir (a fresh
`/var/tmp/sandbar-victim-*` that the module makes and removes, holding root-only files) through
symbolic links: links in the uploaded build context (read through, written through by a second
source of the same COPY, copied as they are), the same from a Dockerfile, and links in the
layers of a base image pushed to the local test registry (`etc`, `home`, `tmp` and other
names pointing at the victim, at `/root` and `/etc/shadow`, up a `../` chain, in a loop) that
the builder's prerequisites (`/etc/passwd`, `/etc/group`, `/etc/shadow`, `/home/user`) and
COPY, WORKDIR and USER steps meet.

Each build may fail, with a message naming the offending path, or succeed with the link kept
inside the template (where it points into the sandbox's own root). Whatever the outcome, the
victim tree must be byte for byte what it was (content, type, mode, owner, no entry added or
removed), and a sandbox of a template that was built must hold none of the victim's bytes,
none of the host's `/etc/shadow` and no owner or mode read from a host directory.

Writing attacks only ever point at the victim directory; `/etc/shadow`, `/etc` and `/root`
only appear as link targets to read from.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import secrets
import shutil
import stat
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import httpx
import pytest

from e2e_util import add_tar_entry, build_log_messages, unique, wait_build_end

# A failing or succeeding build of a tiny image ends well within this.
BUILD_TIMEOUT = 120
VICTIM_PARENT = Path("/var/tmp")
# The user the USER steps add (the image has only root, the prerequisites add `user`).
NEW_USER = "tenant"
# Host files that no test writes to; checked unchanged after every test all the same.
HOST_FILES = ("/etc/passwd", "/etc/group", "/etc/shadow")


# --------------------------------------------------------------------------
# the victim
# --------------------------------------------------------------------------


class Victim:
    """A root-owned directory outside the data dir that every attack aims at.

    ./secret       0600  random bytes
    ./shadow       0600  a shadow-style line with a random token (what /etc/shadow would be)
    ./shells       0644  lists /bin/bash (what /etc/shells would be)
    ./target       0644  random text
    ./sub/         0711  (an unusual mode, so a copy of its metadata shows)
    ./sub/inner    0600  random bytes
    ./sub/deep/    0700
    """

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="sandbar-victim-", dir=VICTIM_PARENT))
        self.secret = b"\x00secret\xff" + secrets.token_bytes(56)
        self.shadow_token = secrets.token_hex(16)
        self.shadow = f"victim{self.shadow_token}:$6$salt$hash:19000:0:99999:7:::\n".encode()
        self.target = f"host target {secrets.token_hex(16)}\n".encode()
        self.inner = b"\x01inner\xfe" + secrets.token_bytes(40)
        self.sub_mode = 0o711
        self._populate()
        self.pristine = self.snapshot()

    def _populate(self) -> None:
        root = self.root
        os.chmod(root, 0o755)
        files = [
            ("secret", self.secret, 0o600),
            ("shadow", self.shadow, 0o600),
            ("shells", b"/bin/sh\n/bin/bash\n", 0o644),
            ("target", self.target, 0o644),
        ]
        for name, data, mode in files:
            (root / name).write_bytes(data)
            os.chmod(root / name, mode)
        (root / "sub").mkdir()
        (root / "sub" / "inner").write_bytes(self.inner)
        os.chmod(root / "sub" / "inner", 0o600)
        (root / "sub" / "deep").mkdir()
        os.chmod(root / "sub" / "deep", 0o700)
        os.chmod(root / "sub", self.sub_mode)
        for p in [root, *root.rglob("*")]:
            os.lchown(p, 0, 0)

    def path(self, rel: str = "") -> str:
        return str(self.root / rel) if rel else str(self.root)

    def needles(self) -> Dict[str, bytes]:
        """Host-only bytes that must never show up in a template."""
        return {
            f"{self.root}/secret": self.secret,
            f"{self.root}/shadow": self.shadow_token.encode(),
            f"{self.root}/target": self.target,
            f"{self.root}/sub/inner": self.inner,
        }

    def snapshot(self) -> Dict[str, dict]:
        """Every entry under the root (the root included), never following a link."""
        out: Dict[str, dict] = {}

        def visit(path: Path, rel: str) -> None:
            st = os.lstat(path)
            entry = {
                "type": stat.S_IFMT(st.st_mode),
                "mode": stat.S_IMODE(st.st_mode),
                "uid": st.st_uid,
                "gid": st.st_gid,
            }
            if stat.S_ISREG(st.st_mode):
                entry["nlink"] = st.st_nlink
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    entry["content"] = f.read()
            elif stat.S_ISLNK(st.st_mode):
                entry["link"] = os.readlink(path)
            out[rel] = entry
            if stat.S_ISDIR(st.st_mode):
                for name in sorted(os.listdir(path)):
                    visit(path / name, name if rel == "." else f"{rel}/{name}")

        visit(self.root, ".")
        return out

    def changes(self) -> List[str]:
        """What differs from the pristine tree, without showing any content."""
        now = self.snapshot()
        found = []
        for rel in sorted(set(self.pristine) | set(now)):
            a, b = self.pristine.get(rel), now.get(rel)
            if a is None:
                kind = stat.filemode(b["type"] | b["mode"])
                found.append(f"{rel}: new entry {kind} {b['uid']}:{b['gid']}" + (f" -> {b['link']}" if "link" in b else ""))
            elif b is None:
                found.append(f"{rel}: removed")
            elif a != b:
                for key in sorted(set(a) | set(b)):
                    if a.get(key) == b.get(key):
                        continue
                    if key == "content":
                        found.append(
                            f"{rel}: content changed ({len(a.get(key) or b'')} -> {len(b.get(key) or b'')} bytes)"
                        )
                    elif key in ("mode", "type"):
                        found.append(f"{rel}: {key} {oct(a.get(key) or 0)} -> {oct(b.get(key) or 0)}")
                    else:
                        found.append(f"{rel}: {key} {a.get(key)!r} -> {b.get(key)!r}")
        return found

    def assert_untouched(self, what: str) -> None:
        found = self.changes()
        assert not found, f"host files in {self.root} changed:\n  " + "\n  ".join(found) + f"\nafter {what}"

    def reset(self) -> None:
        """Back to the pristine tree (after an attack that got through)."""
        if not self.changes():
            return
        if os.path.islink(self.root):
            os.unlink(self.root)
        else:
            shutil.rmtree(self.root)
        os.mkdir(self.root)
        self._populate()
        assert not self.changes(), self.changes()

    def remove(self) -> None:
        if os.path.islink(self.root):
            os.unlink(self.root)
        else:
            shutil.rmtree(self.root, ignore_errors=True)


def host_files_state() -> Dict[str, Optional[Tuple]]:
    out: Dict[str, Optional[Tuple]] = {}
    for p in HOST_FILES:
        try:
            st = os.lstat(p)
            with open(p, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            out[p] = (st.st_ino, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, digest)
        except FileNotFoundError:
            out[p] = None
    return out


def host_shadow() -> bytes:
    try:
        with open("/etc/shadow", "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


# --------------------------------------------------------------------------
# archives and image layers
# --------------------------------------------------------------------------


Entries = Sequence[Tuple[str, str, object]]


def make_tar(entries: Entries, compress: bool = True) -> bytes:
    """A tar of `entries` in their order: (name, "dir" | "file" | "symlink", data or link target)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, kind, value in entries:
            if kind == "symlink":
                add_tar_entry(tar, name, "symlink", target=str(value))
            elif kind == "file":
                add_tar_entry(tar, name, "file", data=value if isinstance(value, bytes) else str(value).encode())
            else:
                add_tar_entry(tar, name, "dir")
    return gzip.compress(raw.getvalue(), mtime=0) if compress else raw.getvalue()


def up_chain(path: str, depth: int = 16) -> str:
    """A relative link target that climbs `depth` levels and comes down to `path`."""
    return "../" * depth + path.lstrip("/")


# --------------------------------------------------------------------------
# the build API, raw
# --------------------------------------------------------------------------


def copy_step(src: str, dest: str, owner: str = "", mode: str = "") -> dict:
    return {"type": "COPY", "args": [src, dest, owner, mode], "force": False}


def workdir_step(path: str) -> dict:
    return {"type": "WORKDIR", "args": [path], "force": False}


def user_step(user: str) -> dict:
    return {"type": "USER", "args": [user], "force": False}


@dataclass
class Outcome:
    name: str
    status: str  # "ready", "error" or "refused" (a 400 when starting)
    message: str  # the upload's refusal, the 400's body and the build's reason, joined
    logs: str
    template_id: Optional[str] = None

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def describe(self) -> str:
        return f"build {self.name!r} ended {self.status!r}: {self.message!r}\nbuild logs:\n{self.logs[-4000:]}"


class Builds:
    """Starts builds through the raw HTTP API and deletes every template it made."""

    def __init__(self, sandbar):
        self.sandbar = sandbar
        self.template_ids: List[str] = []

    def _upload(self, api: httpx.Client, template_id: str, files_hash: str, archive: bytes) -> str:
        r = api.get(f"/templates/{template_id}/files/{files_hash}")
        assert r.status_code == 201, f"GET files/{files_hash}: {r.status_code} {r.text}"
        link = r.json()
        if link.get("present"):
            return ""
        assert link.get("url"), link
        headers = {k: v for k, v in (link.get("headers") or {}).items() if k.lower() != "content-length"}
        put = httpx.put(link["url"], content=archive, headers=headers, timeout=60)
        # The server may refuse a hostile archive right away.
        assert put.status_code < 300 or 400 <= put.status_code < 500, f"PUT: {put.status_code} {put.text}"
        return f"upload refused: {put.text}" if put.status_code >= 400 else ""

    def _wait(self, api: httpx.Client, name: str, template_id: str, build_id: str, early: str) -> Outcome:
        body = wait_build_end(api, template_id, build_id, timeout=BUILD_TIMEOUT, interval=0.2)
        logs = "\n".join(build_log_messages(body))
        reason = (body.get("reason") or {}).get("message", "") or ""
        message = "\n".join(m for m in (early, reason) if m)
        return Outcome(name, body["status"], message, logs, template_id)

    def steps(self, steps: List[dict], archive: Optional[bytes] = None, from_image: Optional[str] = None) -> Outcome:
        """A build of `steps` (COPY steps read `archive`) on `from_image`."""
        name = unique("escape")
        with self.sandbar.client() as api:
            r = api.post("/v3/templates", json={"name": name})
            assert r.status_code == 202, f"POST /v3/templates: {r.status_code} {r.text}"
            template_id, build_id = r.json()["templateID"], r.json()["buildID"]
            self.template_ids.append(template_id)
            early = ""
            files_hash = None
            if archive is not None:
                files_hash = hashlib.sha256(archive + name.encode()).hexdigest()
                early = self._upload(api, template_id, files_hash, archive)
            body_steps = []
            for step in steps:
                step = dict(step)
                if step["type"] == "COPY":
                    assert files_hash, "a COPY step needs an archive"
                    step["filesHash"] = files_hash
                body_steps.append(step)
            r = api.post(
                f"/v2/templates/{template_id}/builds/{build_id}",
                json={"fromImage": from_image, "steps": body_steps},
            )
            if r.status_code == 400:
                return Outcome(name, "refused", "\n".join(m for m in (early, r.text) if m), "", template_id)
            assert r.status_code == 202, f"POST build: {r.status_code} {r.text}"
            return self._wait(api, name, template_id, build_id, early)

    def dockerfile(self, dockerfile: str, context: bytes) -> Outcome:
        """A Dockerfile build (`POST /templates`, the context upload, `POST .../builds/{id}`)."""
        name = unique("escape-df")
        with self.sandbar.client() as api:
            r = api.post("/templates", json={"dockerfile": dockerfile, "alias": name, "memoryMB": 512})
            if r.status_code == 400:
                return Outcome(name, "refused", r.text, "")
            assert r.status_code == 202, f"POST /templates: {r.status_code} {r.text}"
            template_id, build_id = r.json()["templateID"], r.json()["buildID"]
            self.template_ids.append(template_id)
            context_hash = hashlib.sha256(context + name.encode()).hexdigest()
            early = self._upload(api, template_id, context_hash, context)
            r = api.post(f"/templates/{template_id}/builds/{build_id}")
            if r.status_code == 400:
                return Outcome(name, "refused", "\n".join(m for m in (early, r.text) if m), "", template_id)
            assert r.status_code == 202, f"POST build: {r.status_code} {r.text}"
            return self._wait(api, name, template_id, build_id, early)

    def delete_all(self) -> None:
        with self.sandbar.client() as api:
            for template_id in self.template_ids:
                try:
                    api.delete(f"/templates/{template_id}")
                except Exception:  # noqa: BLE001 - best effort
                    pass
        self.template_ids.clear()


def assert_failure_names(outcome: Outcome, names: Sequence[str]) -> None:
    """A failed build's message names the offending path (one of `names`)."""
    assert outcome.status in ("error", "refused"), outcome.describe()
    assert any(n in outcome.message for n in names), (
        f"the failure does not name any of {list(names)}: " + outcome.describe()
    )


def sandbox_of(outcome: Outcome, victim: Victim, make_sandbox, names: Sequence[str]):
    """After a build: the victim is untouched; a build that did not succeed names the offending
    path (one of `names`) and gives None, one that did a sandbox of its template."""
    victim.assert_untouched(outcome.describe())
    if not outcome.ready:
        assert_failure_names(outcome, names)
        return None
    return make_sandbox(template=outcome.name, timeout=60)


# --------------------------------------------------------------------------
# looking into a sandbox
# --------------------------------------------------------------------------


def sh(sbx, cmd: str, user: str = "root") -> str:
    return sbx.commands.run(cmd + " 2>/dev/null; true", user=user, cwd="/", timeout=30).stdout


def host_bytes_in(sbx, roots: Sequence[str], needles: Dict[str, bytes]) -> List[str]:
    """Files under `roots` in the sandbox holding any of `needles` (host-only bytes)."""
    listed = sh(sbx, "find " + " ".join(f"{r.rstrip('/')}/" for r in roots) + " -type f")
    files = sorted({line for line in listed.splitlines() if line.strip()})
    assert len(files) < 500, f"unexpectedly many files under {roots}: {len(files)}"
    found = []
    for path in files:
        data = bytes(sbx.files.read(path, format="bytes", user="root"))
        for label, needle in needles.items():
            if needle and needle in data:
                found.append(f"{path} holds the bytes of the host's {label}")
    return found


def assert_no_host_bytes(sbx, outcome: Outcome, roots: Sequence[str], needles: Dict[str, bytes]) -> None:
    found = host_bytes_in(sbx, roots, needles)
    assert not found, f"a sandbox of {outcome.name!r} sees host files:\n  " + "\n  ".join(found)


def below_a_hidden_link(sbx, victim: Victim, image_dir: str) -> List[str]:
    """`image_dir` (made by a COPY step) and `image_dir/deep` (by a WORKDIR step) are below a
    link of the image to the victim, which a later layer may hide behind a real directory.
    Only the host has `sub` there (mode 0711, holding `inner` and `deep/`): neither its mode,
    nor its entries, nor a directory that WORKDIR takes for existing may show through."""
    problems = []
    mode = sh(sbx, f"stat -c %a {image_dir}").strip()
    if mode == oct(victim.sub_mode)[2:]:
        problems.append(f"{image_dir} has mode {mode}, copied from the host's {victim.path('sub')}")
    if sh(sbx, f"test -e {image_dir}/inner || echo absent").strip() != "absent":
        problems.append(f"{image_dir}/inner exists, as in the host's {victim.path('sub')}")
    if sh(sbx, f"test -d {image_dir}/deep && echo dir").strip() != "dir":
        problems.append(
            f"WORKDIR {image_dir}/deep was not created: the builder took the host's "
            f"{victim.path('sub/deep')} for the image's"
        )
    return problems


def assert_no_problems(outcome: Outcome, problems: List[str]) -> None:
    assert not problems, f"a sandbox of {outcome.name!r}:\n  " + "\n  ".join(problems)


# --------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def victim_dir():
    v = Victim()
    try:
        yield v
    finally:
        v.remove()


@pytest.fixture
def victim(victim_dir):
    """The victim, pristine before the test; put back after an attack that got through.

    Tests call `victim.assert_untouched(...)` themselves (right after their builds and again
    after looking into sandboxes); the host files in HOST_FILES are checked here too.
    """
    victim_dir.reset()
    assert not victim_dir.changes()
    host_before = host_files_state()
    try:
        yield victim_dir
    finally:
        victim_dir.reset()
    host_after = host_files_state()
    assert host_after == host_before, f"host files changed: {[p for p in HOST_FILES if host_before[p] != host_after[p]]}"


@pytest.fixture(scope="module")
def builds(sandbar):
    b = Builds(sandbar)
    try:
        yield b
    finally:
        b.delete_all()


@dataclass
class HostileImages:
    etc_link: str  # top layer: etc -> <victim>
    dir_links: str  # top layer: tmp -> /, home -> <victim>
    host_links: str  # top layer: links at the victim, /root, /etc/shadow, a ../ chain, a loop


@pytest.fixture(scope="module")
def hostile_images(registry, victim_dir, tmp_path_factory) -> HostileImages:
    """Three images on the open test registry: tiny:1 plus one layer of links each."""
    work = tmp_path_factory.mktemp("hostile-layers")
    v = victim_dir.path()
    layers = {
        "etc_link": [("etc", "symlink", v)],
        "dir_links": [("tmp", "symlink", "/"), ("home", "symlink", v)],
        "host_links": [
            ("escdir", "symlink", v),
            ("escfile", "symlink", v + "/target"),
            ("escrel", "symlink", up_chain(v)),
            ("loopa", "symlink", "loopb"),
            ("loopb", "symlink", "loopa"),
            ("hostroot", "symlink", "/root"),
            ("hostshadow", "symlink", "/etc/shadow"),
        ],
    }
    refs = {}
    tag = secrets.token_hex(4)
    for key, entries in layers.items():
        path = work / f"{key}.tar"
        path.write_bytes(make_tar(entries, compress=False))
        repo = "e2e/escape-" + key.replace("_", "-")
        refs[key] = registry.push_layer_image(f"{repo}:{tag}", path, created_by=f"sandbar e2e: {key}")
        names = registry.layer_entries(f"{repo}:{tag}", -1)
        assert sorted(names) == sorted(e[0] for e in entries), f"{refs[key]} top layer: {names}"
    return HostileImages(**refs)


# --------------------------------------------------------------------------
# 1. a file entry under a context link
# --------------------------------------------------------------------------


@pytest.mark.parametrize("src,dest", [("hostlink/x", "/dst"), (".", "/app")])
def test_context_file_under_a_link_to_a_host_dir(sandbar, tiny1, builds, victim, make_sandbox, src, dest):
    """The context holds `hostlink -> <victim>` and then `hostlink/x`."""
    archive = make_tar([("hostlink", "symlink", victim.path()), ("hostlink/x", "file", b"planted by a tenant\n")])
    outcome = builds.steps([copy_step(src, dest)], archive, from_image=tiny1)
    sbx = sandbox_of(outcome, victim, make_sandbox, ["hostlink"])
    if sbx is None:
        return
    assert_no_host_bytes(sbx, outcome, [dest, "/var/tmp"], victim.needles())
    victim.assert_untouched("starting a sandbox of " + outcome.name)


# --------------------------------------------------------------------------
# 2. one source lays a link, another writes through it
# --------------------------------------------------------------------------

# Every case: `s1/hostlink -> <victim>`, then files under `s2/hostlink/`; `COPY s* /app/` copies
# both sources (in that order) into /app, so the second one meets /app/hostlink.
WRITE_CASES = {
    "create": (
        [("s2/hostlink/newfile", "file", b"created\n"), ("s2/hostlink/newdir/nested", "file", b"nested\n")],
        "",
        "",
    ),
    "overwrite": ([("s2/hostlink/target", "file", b"overwritten by a tenant\n")], "", ""),
    # A link where the target is: the builder's removal of an existing destination.
    "delete": ([("s2/hostlink/target", "symlink", "replaced")], "", ""),
    "setuid": ([("s2/hostlink/target", "file", b"#!/bin/sh\nid\n")], "root", "4755"),
}


def write_archive(victim: Victim, case: str) -> bytes:
    entries, _, _ = WRITE_CASES[case]
    return make_tar(
        [
            ("s1", "dir", None),
            ("s1/hostlink", "symlink", victim.path()),
            ("s2", "dir", None),
            ("s2/hostlink", "dir", None),
            ("s2/hostlink/sub", "dir", None),
            *entries,
            ("file.txt", "file", b"a file\n"),
        ]
    )


@pytest.mark.parametrize("case", [*WRITE_CASES, "across_steps"])
def test_second_source_writes_through_a_link_from_the_first(sandbar, tiny1, builds, victim, make_sandbox, case):
    if case == "across_steps":
        # The link comes from an earlier step; later steps write under it.
        archive = write_archive(victim, "create")
        steps = [copy_step("s1", "/app/"), copy_step("s2", "/app/"), copy_step("file.txt", "/app/hostlink/newfile2")]
    else:
        archive = write_archive(victim, case)
        _, owner, mode = WRITE_CASES[case]
        steps = [copy_step("s*", "/app/", owner, mode)]
    outcome = builds.steps(steps, archive, from_image=tiny1)
    sbx = sandbox_of(outcome, victim, make_sandbox, ["hostlink"])
    if sbx is None:
        return
    assert_no_host_bytes(sbx, outcome, ["/app", "/var/tmp"], victim.needles())
    victim.assert_untouched("starting a sandbox of " + outcome.name)


# --------------------------------------------------------------------------
# 3. reading root-only host files through context links
# --------------------------------------------------------------------------

READ_CASES = {
    "file": ("hostlink/secret", "/dst/secret"),
    "dir_with_slash": ("hostlink/", "/dst/"),
    "subdir": ("hostlink/sub", "/dst/sub"),
    "wildcard": ("hostlink/*", "/dst/"),
    "link_to_file": ("secretlink", "/dst/"),
    "host_etc_shadow": ("etclink/shadow", "/dst/shadow"),
}


@pytest.mark.parametrize("case", list(READ_CASES))
def test_copy_reads_root_only_files_through_a_link(sandbar, tiny1, builds, victim, make_sandbox, case):
    """`hostlink -> <victim>`, `secretlink -> <victim>/secret`, `etclink -> /etc` in the context."""
    src, dest = READ_CASES[case]
    shadow = host_shadow()
    if case == "host_etc_shadow" and not shadow:
        pytest.skip("the host has no /etc/shadow")
    archive = make_tar(
        [
            ("hostlink", "symlink", victim.path()),
            ("secretlink", "symlink", victim.path("secret")),
            ("etclink", "symlink", "/etc"),
        ]
    )
    outcome = builds.steps([copy_step(src, dest)], archive, from_image=tiny1)
    sbx = sandbox_of(outcome, victim, make_sandbox, [src.split("/")[0]])
    if sbx is None:
        return
    needles = victim.needles()
    if shadow:
        needles["/etc/shadow"] = shadow
    assert_no_host_bytes(sbx, outcome, ["/dst"], needles)
    victim.assert_untouched("starting a sandbox of " + outcome.name)


# --------------------------------------------------------------------------
# 4. the same from a Dockerfile
# --------------------------------------------------------------------------

DOCKERFILE_CASES = {
    "read": "COPY hostlink/secret /leak/secret\n",
    "read_wildcard": "COPY hostlink/* /leak/\n",
    "write": "COPY --chown=root --chmod=4755 s* /app/\n",
}


@pytest.mark.parametrize("case", list(DOCKERFILE_CASES))
def test_dockerfile_copy_through_links(sandbar, tiny1, builds, victim, make_sandbox, case):
    context = make_tar(
        [
            ("hostlink", "symlink", victim.path()),
            ("s1", "dir", None),
            ("s1/hostlink", "symlink", victim.path()),
            ("s2", "dir", None),
            ("s2/hostlink", "dir", None),
            ("s2/hostlink/target", "file", b"overwritten from a Dockerfile\n"),
            ("s2/hostlink/newfile", "file", b"created from a Dockerfile\n"),
        ]
    )
    outcome = builds.dockerfile(f"FROM {tiny1}\n" + DOCKERFILE_CASES[case], context)
    sbx = sandbox_of(outcome, victim, make_sandbox, ["hostlink"])
    if sbx is None:
        return
    assert_no_host_bytes(sbx, outcome, ["/leak", "/app", "/var/tmp"], victim.needles())
    victim.assert_untouched("starting a sandbox of " + outcome.name)


# --------------------------------------------------------------------------
# 5. links in a base image's layer meet the prerequisites and the steps
# --------------------------------------------------------------------------


def test_image_etc_link_to_a_host_dir(sandbar, hostile_images, builds, victim, make_sandbox):
    """The top layer has `etc -> <victim>`: the prerequisites write /etc/passwd and /etc/group
    (and read /etc/shadow and /etc/shells), a USER step adds a user, a COPY step and a
    WORKDIR step create paths under /etc."""
    archive = make_tar([("file.txt", "file", b"a file under /etc\n")])
    steps = [
        user_step(NEW_USER),
        copy_step("file.txt", "/etc/planted.txt"),
        workdir_step("/etc/wd"),
        workdir_step("/"),
    ]
    outcome = builds.steps(steps, archive, from_image=hostile_images.etc_link)
    sbx = sandbox_of(outcome, victim, make_sandbox, ["/etc", "etc/", victim.path()])
    if sbx is None:
        return
    problems = host_bytes_in(sbx, ["/etc", "/var/tmp", "/home"], victim.needles())
    line = sh(sbx, f"grep '^{NEW_USER}:' /etc/passwd").strip()
    if not line or line.endswith("/bin/bash"):
        problems.append(
            f"{NEW_USER}'s /etc/passwd entry is {line!r}: the image has no /etc/shells, so a /bin/bash "
            f"there comes from the host's {victim.path('shells')}"
        )
    if sh(sbx, "test -d /etc/wd && echo dir").strip() != "dir":
        problems.append("WORKDIR /etc/wd was not created")
    if sh(sbx, "cat /etc/planted.txt") != "a file under /etc\n":
        problems.append("/etc/planted.txt does not hold what the COPY step wrote")
    assert_no_problems(outcome, problems)
    victim.assert_untouched("starting a sandbox of " + outcome.name)


def test_image_tmp_and_home_links(sandbar, hostile_images, builds, victim, make_sandbox):
    """The top layer has `tmp -> /` and `home -> <victim>` (the victim has `sub/deep/`, mode
    0711 on `sub`): the prerequisites make /home/user; WORKDIR, COPY and USER steps create
    paths under /home and /tmp."""
    archive = make_tar([("file.txt", "file", b"a file under the links\n")])
    steps = [
        workdir_step("/home/sub/deep"),
        copy_step("file.txt", "/home/sub/file.txt"),
        copy_step("file.txt", "/tmp/under-tmp/file.txt"),
        user_step(NEW_USER),
        workdir_step("/"),
    ]
    outcome = builds.steps(steps, archive, from_image=hostile_images.dir_links)
    sbx = sandbox_of(outcome, victim, make_sandbox, ["/home", "home/", "/tmp", victim.path()])
    if sbx is None:
        return
    problems = host_bytes_in(sbx, ["/home", "/under-tmp", "/var/tmp", "/etc"], victim.needles())
    problems += below_a_hidden_link(sbx, victim, "/home/sub")
    if sh(sbx, "cat /home/sub/file.txt") != "a file under the links\n":
        problems.append("/home/sub/file.txt does not hold what the COPY step wrote")
    if sh(sbx, "cat /under-tmp/file.txt") != "a file under the links\n":
        problems.append("/tmp/under-tmp/file.txt (with /tmp -> /) is not at /under-tmp/file.txt")
    if sh(sbx, f"test -d /home/{NEW_USER} && echo dir").strip() != "dir":
        problems.append(f"USER {NEW_USER} made no /home/{NEW_USER}")
    assert_no_problems(outcome, problems)
    victim.assert_untouched("starting a sandbox of " + outcome.name)


# --------------------------------------------------------------------------
# 6. an image's links at host paths as COPY destinations
# --------------------------------------------------------------------------


def test_image_links_to_host_paths_as_destinations(sandbar, hostile_images, builds, victim, make_sandbox):
    """`escdir -> <victim>`, `escfile -> <victim>/target`, `escrel -> ../../…<victim>`: COPY
    steps write through each; then a COPY of a tree makes /escdir a real directory in a layer
    above the link, and COPY and WORKDIR steps go below it, where only the host has
    `sub/` (mode 0711) and `sub/deep/`. `hostroot -> /root` and `hostshadow -> /etc/shadow`
    must show the sandbox's own files."""
    archive = make_tar(
        [
            ("file.txt", "file", b"a file through a link\n"),
            ("tree", "dir", None),
            ("tree/escdir", "dir", None),
            ("tree/escdir/own.txt", "file", b"own\n"),
        ]
    )
    steps = [
        copy_step("file.txt", "/escdir/file"),
        copy_step("file.txt", "/escfile"),
        copy_step("file.txt", "/escrel/chain"),
        copy_step("tree", "/"),
        copy_step("file.txt", "/escdir/sub/file.txt"),
        workdir_step("/escdir/sub/deep"),
        workdir_step("/"),
    ]
    outcome = builds.steps(steps, archive, from_image=hostile_images.host_links)
    sbx = sandbox_of(outcome, victim, make_sandbox, ["escdir", "escfile", "escrel", victim.path()])
    if sbx is None:
        return
    needles = victim.needles()
    shadow = host_shadow()
    if shadow:
        needles["/etc/shadow"] = shadow
    problems = host_bytes_in(sbx, ["/escdir", "/var/tmp", "/etc", "/root"], needles)
    problems += below_a_hidden_link(sbx, victim, "/escdir/sub")
    if sh(sbx, "readlink /hostroot").strip() != "/root":
        problems.append("the link /hostroot -> /root was not kept")
    host_root = set(os.listdir("/root"))
    seen = set(sh(sbx, "ls -A /hostroot/").split())
    if seen & host_root:
        problems.append(f"/hostroot lists entries of the host's /root: {sorted(seen & host_root)}")
    if shadow and sh(sbx, "cat /hostshadow").encode() == shadow:
        problems.append("/hostshadow shows the host's /etc/shadow")
    for path in ("/escfile", "/escrel/chain"):
        if sh(sbx, f"cat {path}") != "a file through a link\n":
            problems.append(f"{path} does not show what the COPY step wrote through the link")
    assert_no_problems(outcome, problems)
    victim.assert_untouched("starting a sandbox of " + outcome.name)


def test_image_link_loop_as_destination(sandbar, hostile_images, builds, victim, make_sandbox):
    """`loopa -> loopb -> loopa`: a COPY to /loopa/file cannot resolve."""
    archive = make_tar([("file.txt", "file", b"a file into a loop\n")])
    outcome = builds.steps([copy_step("file.txt", "/loopa/file")], archive, from_image=hostile_images.host_links)
    sbx = sandbox_of(outcome, victim, make_sandbox, ["loopa", "loopb"])
    if sbx is None:
        return
    assert sh(sbx, "readlink /loopa").strip() == "loopb", "the link loop was not kept in the template"
    victim.assert_untouched("starting a sandbox of " + outcome.name)
