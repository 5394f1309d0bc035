"""Local OCI registries and fixture images for the custom-template tests.

Two `docker-registry` (distribution) processes listen on 127.0.0.1 over plain HTTP with
filesystem storage in a temporary directory: an open one and one behind htpasswd (bcrypt)
basic auth. The images are built with `umoci` from a busybox-static rootfs and pushed with
`skopeo`; nothing here talks to a host other than 127.0.0.1.

Images:

  <host>/e2e/tiny:1          busybox rootfs; config Env has PATH and FROM_IMAGE=tiny
  <host>/e2e/tiny:2          tiny:1 plus a layer with a whiteout (`etc/.wh.motd`) and an
                             opaque directory (`opt/data/.wh..wh..opq` + `opt/data/new.txt`)
  <auth_host>/e2e/private:1  tiny:1 again, on the registry that needs credentials

The OCI layout is cached under `<cache_dir>/oci-<key>` (the key covers the busybox binary and
FIXTURE_VERSION); the registries start empty every time. The server refuses pulls from
loopback unless allowed, so the suite reserves the registries' ports (`RegistryPorts`) before
it starts the server and allows exactly those.

Run `python3 tests/e2e/registry.py` to build, push and check everything once by hand.
"""

from __future__ import annotations

import atexit
import gzip
import hashlib
import io
import json
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import httpx

# Bump when the images below change, so cached layouts are rebuilt.
FIXTURE_VERSION = "1"

BUSYBOX = Path("/bin/busybox")
IMAGE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
REQUIRED_TOOLS = ("docker-registry", "umoci", "skopeo", "htpasswd", "tar")

# Layout tags inside the OCI layout -> repository:tag in the registries.
TINY1 = "tiny1"
TINY2 = "tiny2"

MOTD = "tiny motd\n"
OLD_TXT = "old\n"
NEW_TXT = "new\n"

# Processes started by this module that are still running, killed at interpreter exit too.
_LIVE: List[subprocess.Popen] = []


def _kill_live() -> None:
    for proc in list(_LIVE):
        _stop(proc)


atexit.register(_kill_live)


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the test process dies, even by SIGKILL."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    if proc in _LIVE:
        _LIVE.remove(proc)


def _run(args: List[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited with {r.returncode}:\n{r.stdout}\n{r.stderr}")
    return r


def missing_tools() -> List[str]:
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if not BUSYBOX.is_file():
        missing.append(f"{BUSYBOX} (busybox-static)")
    return missing


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------
# images
# --------------------------------------------------------------------------


def _fill_rootfs(rootfs: Path) -> None:
    """busybox + one /bin symlink per applet, root-only passwd/group, /tmp, /root, the layer-1 files."""
    for d in ("bin", "etc", "root", "tmp", "opt/data"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
    os.chmod(rootfs / "bin" / "busybox", 0o755)
    applets = _run([str(BUSYBOX), "--list"]).stdout.split()
    for applet in applets:
        link = rootfs / "bin" / applet
        if applet != "busybox" and not os.path.lexists(link):
            os.symlink("busybox", link)
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\n")
    (rootfs / "etc" / "motd").write_text(MOTD)
    (rootfs / "opt" / "data" / "old.txt").write_text(OLD_TXT)
    os.chmod(rootfs / "tmp", 0o1777)
    os.chmod(rootfs / "root", 0o700)
    for p in [rootfs, *rootfs.rglob("*")]:
        os.lchown(p, 0, 0)


def _layer2_tar(path: Path) -> None:
    """An uncompressed layer that whiteouts /etc/motd and makes /opt/data opaque with only new.txt."""
    mtime = 1_700_000_000

    def dir_entry(name: str) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = tarfile.DIRTYPE
        ti.mode = 0o755
        ti.mtime = mtime
        return ti

    def file_entry(name: str, data: bytes, mode: int = 0o644) -> tuple:
        ti = tarfile.TarInfo(name)
        ti.size = len(data)
        ti.mode = mode
        ti.mtime = mtime
        return ti, io.BytesIO(data)

    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(dir_entry("etc/"))
        tar.addfile(*file_entry("etc/.wh.motd", b"", 0o000))
        tar.addfile(dir_entry("opt/"))
        tar.addfile(dir_entry("opt/data/"))
        tar.addfile(*file_entry("opt/data/.wh..wh..opq", b"", 0o000))
        tar.addfile(*file_entry("opt/data/new.txt", NEW_TXT.encode()))


def _cache_key() -> str:
    h = hashlib.sha256()
    h.update(FIXTURE_VERSION.encode())
    h.update(IMAGE_PATH.encode())
    with open(BUSYBOX, "rb") as f:
        h.update(f.read())
    return h.hexdigest()[:16]


def build_layout(cache_dir: Optional[Path]) -> Path:
    """Build (or reuse) the OCI layout holding tags `tiny1` and `tiny2`; returns its path."""
    if cache_dir is not None:
        cached = cache_dir / f"oci-{_cache_key()}"
        if (cached / "index.json").is_file() and (cached / ".complete").is_file():
            return cached
        cache_dir.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="oci-build-", dir=cache_dir))
    else:
        cached = None
        work = Path(tempfile.mkdtemp(prefix="sandbar-e2e-oci-"))
    try:
        layout = work / "layout"
        bundle = work / "bundle"
        _run(["umoci", "init", "--layout", str(layout)])
        _run(["umoci", "new", "--image", f"{layout}:{TINY1}"])
        _run(["umoci", "unpack", "--image", f"{layout}:{TINY1}", str(bundle)])
        _fill_rootfs(bundle / "rootfs")
        _run(
            [
                "umoci", "repack", "--image", f"{layout}:{TINY1}",
                "--history.created_by", "sandbar e2e: busybox rootfs", str(bundle),
            ]
        )
        _run(
            [
                "umoci", "config", "--image", f"{layout}:{TINY1}",
                "--config.env", f"PATH={IMAGE_PATH}",
                "--config.env", "FROM_IMAGE=tiny",
                "--config.cmd", "/bin/sh",
                "--config.workingdir", "/",
                "--history.created_by", "sandbar e2e: config",
            ]
        )
        layer2 = work / "layer2.tar"
        _layer2_tar(layer2)
        _run(
            [
                "umoci", "raw", "add-layer", "--image", f"{layout}:{TINY1}", "--tag", TINY2,
                "--history.created_by", "sandbar e2e: whiteout /etc/motd, opaque /opt/data", str(layer2),
            ]
        )
        _run(["umoci", "gc", "--layout", str(layout)])
        if cached is None:
            return layout
        (layout / ".complete").write_text(FIXTURE_VERSION + "\n")
        try:
            os.rename(layout, cached)
        except OSError:
            # Another run put it there first.
            if not (cached / ".complete").is_file():
                raise
        return cached
    finally:
        if cached is not None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            shutil.rmtree(work / "bundle", ignore_errors=True)


# --------------------------------------------------------------------------
# registries
# --------------------------------------------------------------------------


class PortReservation:
    """A port of 127.0.0.1 chosen ahead of time, held by a bound socket that never listens
    (connections to it are refused, and nobody else can bind it) until `release()`."""

    def __init__(self) -> None:
        self._sock: Optional[socket.socket] = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def release(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class RegistryPorts:
    """The ports of the open, auth and closed registries, reserved before the server starts:
    the server refuses pulls from loopback unless told `--allow-registry 127.0.0.1:<port>`,
    and these are the ports it is told about."""

    def __init__(self) -> None:
        self.open = PortReservation()
        self.auth = PortReservation()
        self.closed = PortReservation()

    def allow_args(self) -> List[str]:
        return [arg for r in (self.open, self.auth, self.closed) for arg in ("--allow-registry", r.host)]


class RegistryProcess:
    """One `docker-registry serve` on 127.0.0.1:<port> with its own storage and log; on a free
    port, or on `reserved` (released just before the registry binds it)."""

    def __init__(self, workdir: Path, htpasswd: Optional[Path] = None, reserved: Optional[PortReservation] = None):
        self.workdir = workdir
        self.htpasswd = htpasswd
        self.reserved = reserved
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = workdir / "registry.log"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _config(self) -> str:
        lines = [
            "version: 0.1",
            "log:",
            "  level: warn",
            "  fields:",
            f"    service: sandbar-e2e-{self.workdir.name}",
            "storage:",
            "  filesystem:",
            f"    rootdirectory: {self.workdir / 'storage'}",
            "  delete:",
            "    enabled: true",
            "  maintenance:",
            "    uploadpurging:",
            "      enabled: false",
            "http:",
            f"  addr: 127.0.0.1:{self.port}",
            f"  secret: {secrets.token_hex(16)}",
        ]
        if self.htpasswd is not None:
            lines += [
                "auth:",
                "  htpasswd:",
                "    realm: sandbar-e2e",
                f"    path: {self.htpasswd}",
            ]
        return "\n".join(lines) + "\n"

    def start(self, attempts: int = 5) -> None:
        last = ""
        for _ in range(attempts):
            if self.reserved is not None:
                # The server allows this port only, so a retry takes it again.
                self.port = self.reserved.port
                self.reserved.release()
            else:
                self.port = _free_port()
            config = self.workdir / "config.yml"
            config.write_text(self._config())
            log = open(self.log_path, "ab")
            try:
                self.proc = subprocess.Popen(
                    ["docker-registry", "serve", str(config)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            finally:
                log.close()
            _LIVE.append(self.proc)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    r = httpx.get(f"http://{self.host}/v2/", timeout=2)
                    if r.status_code in (200, 401):
                        return
                    last = f"GET /v2/ -> {r.status_code}"
                except httpx.HTTPError as e:
                    last = repr(e)
                time.sleep(0.1)
            _stop(self.proc)
            last += "\n" + self.log_tail()
        raise RuntimeError(f"docker-registry did not start: {last}")

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)
            self.proc = None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no registry log)"
        return "\n".join(text.splitlines()[-lines:])


class LocalRegistries:
    """The session's registries and images. Use `LocalRegistries.start(cache_dir)` and `.close()`.

    Attributes:
      host        "127.0.0.1:<port>" of the open registry
      auth_host   "127.0.0.1:<port>" of the registry that wants basic auth
      username, password   the credentials of auth_host
      auth_image  "<auth_host>/e2e/private:1"
      closed_host "127.0.0.1:<port>" where nothing listens (the port is held but never listened on)
    """

    TINY_1 = "e2e/tiny:1"
    TINY_2 = "e2e/tiny:2"
    PRIVATE_1 = "e2e/private:1"

    def __init__(self, workdir: Path, layout: Path, ports: Optional[RegistryPorts] = None):
        self.workdir = workdir
        self.layout = layout
        self.ports = ports
        self.username = "e2e"
        self.password = "pw-" + secrets.token_hex(8)
        self.open = RegistryProcess(workdir / "open", reserved=ports.open if ports else None)
        self.auth = RegistryProcess(
            workdir / "auth", htpasswd=workdir / "htpasswd", reserved=ports.auth if ports else None
        )
        self._closed_sock: Optional[socket.socket] = None
        self.closed_host = ""
        self.digests: Dict[str, str] = {}

    # ---- public API ------------------------------------------------------

    @property
    def host(self) -> str:
        return self.open.host

    @property
    def auth_host(self) -> str:
        return self.auth.host

    def image(self, name: str) -> str:
        """Reference of `name` ("repo:tag") on the open registry, e.g. image("e2e/tiny:1")."""
        return f"{self.host}/{name}"

    def auth_image_ref(self, name: str = PRIVATE_1) -> str:
        return f"{self.auth_host}/{name}"

    @property
    def auth_image(self) -> str:
        return self.auth_image_ref(self.PRIVATE_1)

    def log_tail(self, lines: int = 40) -> str:
        return (
            f"--- open registry {self.host} ---\n{self.open.log_tail(lines)}\n"
            f"--- auth registry {self.auth_host} ---\n{self.auth.log_tail(lines)}"
        )

    # ---- lifecycle ---------------------------------------------------------

    @classmethod
    def start(cls, cache_dir: Optional[Path] = None, ports: Optional[RegistryPorts] = None) -> "LocalRegistries":
        missing = missing_tools()
        if missing:
            raise RuntimeError(
                "missing tools for the registry fixture: " + ", ".join(missing)
                + " (run `scripts/install-deps.sh --test`)"
            )
        layout = build_layout(cache_dir)
        workdir = Path(tempfile.mkdtemp(prefix="sandbar-e2e-registry-"))
        for d in ("open", "auth"):
            (workdir / d).mkdir()
        reg = cls(workdir, layout, ports)
        try:
            _run(["htpasswd", "-Bbc", str(workdir / "htpasswd"), reg.username, reg.password])
            reg.open.start()
            reg.auth.start()
            reg._hold_closed_port()
            reg._push_all()
            reg.verify()
        except BaseException:
            reg.close()
            raise
        return reg

    def close(self) -> None:
        self.open.stop()
        self.auth.stop()
        if self._closed_sock is not None:
            self._closed_sock.close()
            self._closed_sock = None
        if self.ports is not None:
            self.ports.closed.release()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "LocalRegistries":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------

    def _hold_closed_port(self) -> None:
        if self.ports is not None:
            # Reserved (bound, never listening) since before the server started.
            self.closed_host = self.ports.closed.host
            return
        # Bound but not listening: connections are refused, and no one else can take the port.
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        self._closed_sock = s
        self.closed_host = f"127.0.0.1:{s.getsockname()[1]}"

    def _skopeo(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        # No user-wide auth files or registries configuration leak in.
        env["REGISTRY_AUTH_FILE"] = str(self.workdir / "auth.json")
        return subprocess.run(
            ["skopeo", "--insecure-policy", "--tmpdir", str(self.workdir), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )

    def _push(
        self, layout_tag: str, dest: str, creds: Optional[str] = None, layout: Optional[Path] = None
    ) -> None:
        args = ["copy", "--dest-tls-verify=false"]
        args += ["--dest-creds", creds] if creds else ["--dest-no-creds"]
        args += [f"oci:{layout or self.layout}:{layout_tag}", f"docker://{dest}"]
        r = self._skopeo(*args)
        if r.returncode != 0:
            raise RuntimeError(f"skopeo {' '.join(args)} failed:\n{r.stdout}\n{r.stderr}\n{self.log_tail()}")

    def _push_all(self) -> None:
        self._push(TINY1, self.image(self.TINY_1))
        self._push(TINY2, self.image(self.TINY_2))
        self._push(TINY1, self.auth_image, creds=f"{self.username}:{self.password}")

    def push_layer_image(self, name: str, layer: Path, base: str = TINY1, created_by: str = "sandbar e2e") -> str:
        """Pushes `name` ("repo:tag") to the open registry: the fixture image `base` (a layout
        tag, TINY1 or TINY2) with `layer`, an uncompressed tar made by the caller, as a new top
        layer (`umoci raw add-layer`, which takes the tar as it is). Returns the reference.

        The cached layout is never changed: the first call copies it into the registries'
        working directory, and every image gets a tag of its own there.
        """
        work = self.workdir / "extra-layout"
        if not (work / "index.json").is_file():
            shutil.copytree(self.layout, work, symlinks=True)
        tag = "extra-" + secrets.token_hex(6)
        _run(
            [
                "umoci", "raw", "add-layer", "--image", f"{work}:{base}", "--tag", tag,
                "--history.created_by", created_by, str(layer),
            ]
        )
        ref = self.image(name)
        self._push(tag, ref, layout=work)
        return ref

    def inspect(self, ref: str, creds: Optional[str] = None, raw: bool = False) -> dict:
        """`skopeo inspect` of docker://ref (plain HTTP); raises with skopeo's stderr on failure."""
        args = ["inspect", "--tls-verify=false"]
        args += ["--creds", creds] if creds else ["--no-creds"]
        if raw:
            args.append("--raw")
        args.append(f"docker://{ref}")
        r = self._skopeo(*args, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"skopeo {' '.join(args)} failed: {r.stderr.strip()}")
        return json.loads(r.stdout)

    def verify(self) -> None:
        """Pull every image's description back and check what the tests rely on."""
        creds = f"{self.username}:{self.password}"
        for ref, c in (
            (self.image(self.TINY_1), None),
            (self.image(self.TINY_2), None),
            (self.auth_image, creds),
        ):
            info = self.inspect(ref, creds=c)
            env = info.get("Env") or []
            assert f"PATH={IMAGE_PATH}" in env and "FROM_IMAGE=tiny" in env, f"{ref}: Env is {env}"
            assert info.get("Os") == "linux", f"{ref}: {info}"
            self.digests[ref] = info["Digest"]
        assert len(self.inspect(self.image(self.TINY_1))["Layers"]) == 1
        assert len(self.inspect(self.image(self.TINY_2))["Layers"]) == 2

        # The auth registry really wants the credentials.
        for bad in (None, f"{self.username}:wrong-{secrets.token_hex(4)}"):
            try:
                self.inspect(self.auth_image, creds=bad)
            except RuntimeError:
                pass
            else:
                raise AssertionError(f"{self.auth_image} is readable with credentials {bad!r}")

        # The pushed top layer of tiny:2 carries a whiteout and an opaque marker.
        names = self.layer_entries(self.TINY_2, -1)
        for want in ("etc/.wh.motd", "opt/data/.wh..wh..opq", "opt/data/new.txt"):
            assert want in names, f"{self.TINY_2} top layer lacks {want}: {names}"
        base = self.layer_entries(self.TINY_1, 0)
        for want in ("etc/motd", "opt/data/old.txt", "bin/busybox", "bin/sh", "etc/passwd", "etc/group"):
            assert want in base, f"{self.TINY_1} layer lacks {want}"

    def layer_entries(self, name: str, index: int) -> List[str]:
        """Entry names (`tar tzf`) of layer `index` of `name`, downloaded from the open registry."""
        repo, tag = name.rsplit(":", 1)
        manifest = self.inspect(self.image(name), raw=True)
        if "layers" not in manifest:
            raise AssertionError(f"unexpected manifest for {name}: {manifest}")
        digest = manifest["layers"][index]["digest"]
        r = httpx.get(f"http://{self.host}/v2/{repo}/blobs/{digest}", timeout=30, follow_redirects=True)
        r.raise_for_status()
        assert "sha256:" + hashlib.sha256(r.content).hexdigest() == digest, f"blob {digest} does not match"
        blob = self.workdir / f"layer-{digest.split(':')[1][:12]}.tar.gz"
        blob.write_bytes(r.content)
        try:
            out = _run(["tar", "tzf", str(blob)]).stdout
        finally:
            blob.unlink()
        return [line.rstrip("/").removeprefix("./") for line in out.splitlines() if line.strip()]


def _main() -> None:
    cache = Path(os.environ.get("SANDBAR_E2E_DATA_DIR") or "/var/tmp/sandbar-e2e") / "e2e-fixtures"
    t0 = time.monotonic()
    with LocalRegistries.start(cache_dir=cache) as reg:
        print(f"started and verified in {time.monotonic() - t0:.1f}s; layout {reg.layout}")
        print(f"open registry {reg.host}, auth registry {reg.auth_host} ({reg.username}), closed {reg.closed_host}")
        for ref, digest in reg.digests.items():
            print(f"  {ref}  {digest}")
        print("tiny:2 top layer:", reg.layer_entries(reg.TINY_2, -1))
        layers = reg.inspect(reg.image(reg.TINY_2))["Layers"]
        print("tiny:2 layers:", layers)
        with gzip.open(io.BytesIO(httpx.get(f"http://{reg.host}/v2/e2e/tiny/blobs/{layers[-1]}").content)) as f:
            with tarfile.open(fileobj=f) as t:
                for m in t.getmembers():
                    print(f"    {m.name} type={m.type!r} mode={oct(m.mode)} size={m.size}")


if __name__ == "__main__":
    _main()
