#!/usr/bin/env python3
"""Template builds from a multi-layer registry image against a running server, through the
official Python SDK.

Starts a private `docker-registry` on a free port of 127.0.0.1 (storage in a temporary
directory under $TMPDIR, default /var/tmp), and pushes a fixture image made from a Debian root
filesystem in three layers, split as scripts/bench-pull.sh splits it (everything but /usr's
contents, /usr without /usr/share's contents, /usr/share). Each cold build gets an image of its
own: every layer carries one extra file with a fresh nonce, so no layer is in the server's
image cache and the pull is timed too. The template is

    fromImage <fixture>, COPY files/ /app/ (a context of --files small files), RUN

and the benchmark times, through `Template.build`:

- `--cold` first builds, each a new template from a new image (pull, unpack, both steps);
- `--iterations` forced rebuilds (`skip_cache`, the build API's `force`) of the last one: the
  image is cached, both steps run again.

    E2B_API_URL=http://127.0.0.1:3000 E2B_API_KEY=e2b_... \\
    python3 scripts/bench-build-image.py --rootfs ROOTFS [--cold 3] [--iterations 10]

ROOTFS is a Debian root such as `<data-dir>/templates/base-v2/rootfs` of a server that has built
`base`. The server must accept 127.0.0.1 as a registry (`sandbar serve --allow-registry
127.0.0.1`, where that flag exists). Must run as root (the fixture keeps the root's owners);
needs docker-registry and tar. Nothing is contacted but 127.0.0.1. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from e2b import Template
from bench_common import row_p90, timed

PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The SDK polls the build's status every 0.2 s; a finer poll keeps that out of the numbers.
Template._logs_refresh_frequency = 0.05


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_registry(work: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    (work / "storage").mkdir()
    config = work / "registry.yml"
    config.write_text(
        "version: 0.1\n"
        "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {work / 'storage'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n  secret: {uuid.uuid4().hex}\n"
    )
    log = open(work / "registry.log", "wb")
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1).read()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.terminate()
    raise SystemExit(f"docker-registry did not start; see {work / 'registry.log'}")


def base_layers(rootfs: Path, work: Path) -> list[Path]:
    """The three layers' tars, made once; each variant prepends a nonce entry."""
    splits = [
        ["--exclude=./usr/*", "."],
        ["--exclude=./usr/share/*", "./usr"],
        ["./usr/share"],
    ]
    out = []
    for i, args in enumerate(splits):
        path = work / f"layer{i}.tar"
        subprocess.run(
            ["tar", "-C", str(rootfs), "--numeric-owner", "-cf", str(path), *args],
            check=True,
        )
        out.append(path)
    return out


def push_blob(registry: str, repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    start = urllib.request.Request(
        f"http://{registry}/v2/{repo}/blobs/uploads/", method="POST", data=b""
    )
    with urllib.request.urlopen(start) as resp:
        location = resp.headers["Location"]
    if location.startswith("/"):
        location = f"http://{registry}{location}"
    sep = "&" if "?" in location else "?"
    put = urllib.request.Request(
        f"{location}{sep}digest={digest}",
        method="PUT",
        data=data,
        headers={"Content-Type": "application/octet-stream"},
    )
    urllib.request.urlopen(put).read()
    return digest


def push_variant(registry: str, layers: list[Path], nonce: str) -> str:
    """Pushes the fixture with `nonce` in every layer; returns the image reference."""
    repo = "bench/fixture"
    descriptors, diff_ids = [], []
    for i, layer in enumerate(layers):
        member = tarfile.TarInfo(f".bench-nonce-{i}")
        content = f"{nonce}\n".encode()
        member.size, member.mode, member.mtime = len(content), 0o644, 0
        head = member.tobuf(format=tarfile.USTAR_FORMAT) + content
        head += b"\0" * (-len(head) % 512)
        plain = head + layer.read_bytes()
        diff_ids.append("sha256:" + hashlib.sha256(plain).hexdigest())
        blob = gzip.compress(plain, compresslevel=6, mtime=0)
        descriptors.append(
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": push_blob(registry, repo, blob),
                "size": len(blob),
            }
        )
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": [PATH_ENV], "Cmd": ["/bin/bash"], "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created_by": f"bench-build-image.py: layer {i}"} for i in range(3)],
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": push_blob(registry, repo, config),
                "size": len(config),
            },
            "layers": descriptors,
        }
    ).encode()
    urllib.request.urlopen(
        urllib.request.Request(
            f"http://{registry}/v2/{repo}/manifests/{nonce}",
            method="PUT",
            data=manifest,
            headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
        )
    ).read()
    return f"{registry}/{repo}:{nonce}"


def row(name: str, samples: list) -> str:
    return row_p90(name, samples, digits=0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rootfs", type=Path, required=True)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--files", type=int, default=1000)
    args = parser.parse_args()
    if not (args.rootfs / "usr/share").is_dir():
        raise SystemExit(f"{args.rootfs} is not a Debian root filesystem")
    tmp_root = os.environ.get("TMPDIR", "/var/tmp")
    work = Path(tempfile.mkdtemp(prefix="sandbar-bench-build-image.", dir=tmp_root))
    registry_proc = None
    try:
        registry_proc, registry = start_registry(work)
        layers = base_layers(args.rootfs, work)
        ctx = work / "ctx"
        for i in range(args.files):
            sub = ctx / "files" / f"d{i // 100}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"f{i}.txt").write_bytes(os.urandom(512).hex().encode())
        cold, name, template = [], "", None
        for _ in range(args.cold):
            nonce = uuid.uuid4().hex[:12]
            image = push_variant(registry, layers, nonce)
            name = f"bench-image-{nonce}"
            template = (
                Template(file_context_path=str(ctx))
                .from_image(image)
                .copy("files", "/app/")
                .run_cmd(f"test $(find /app -type f | wc -l) -eq {args.files}", user="root")
            )
            cold.append(timed(lambda: Template.build(template, name)))
        forced = [
            timed(lambda: Template.build(template, name, skip_cache=True))
            for _ in range(args.iterations)
        ]
    finally:
        if registry_proc is not None:
            registry_proc.terminate()
            registry_proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print("| measurement | n | p50 ms | p90 ms | min ms |")
    print("|---|--:|--:|--:|--:|")
    print(row(f"first build (3-layer image pulled; COPY of {args.files} files; RUN)", cold))
    print(row("forced rebuild (image cached; COPY and RUN again)", forced))


if __name__ == "__main__":
    main()
