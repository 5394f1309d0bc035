"""The SDK's `sandbox.git` against the default template, which carries git: every method of
the module on repositories the test makes inside one sandbox (a bare repository reached by
path and a smart-HTTP server with basic auth on the sandbox's loopback, serving through
`git-http-backend`), so nothing leaves the sandbox."""

from __future__ import annotations

import shlex

import pytest
from e2b import Sandbox
from e2b.exceptions import GitAuthException, GitUpstreamException, InvalidArgumentException

from e2e_util import created_sandbox, wait_until

HOME = "/home/user"
REMOTE = f"{HOME}/remote.git"
WORK = f"{HOME}/work"
HTTP_PORT = 8418
HTTP_USER, HTTP_PASSWORD = "alice", "s3cret-token"

# A smart-HTTP git server: basic auth in front of git-http-backend run as a CGI program.
GIT_HTTP_SERVER = r"""
import base64, os, subprocess, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

root, port, credentials = sys.argv[1], int(sys.argv[2]), sys.argv[3]
expected = "Basic " + base64.b64encode(credentials.encode()).decode()


class Git(BaseHTTPRequestHandler):
    def handle_one(self):
        if self.headers.get("Authorization") != expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = dict(
            os.environ,
            GIT_PROJECT_ROOT=root,
            GIT_HTTP_EXPORT_ALL="1",
            REQUEST_METHOD=self.command,
            PATH_INFO=path,
            QUERY_STRING=query,
            CONTENT_TYPE=self.headers.get("Content-Type", ""),
            CONTENT_LENGTH=str(len(body)),
            HTTP_CONTENT_ENCODING=self.headers.get("Content-Encoding", ""),
            REMOTE_USER=credentials.split(":")[0],
            REMOTE_ADDR="127.0.0.1",
        )
        out = subprocess.run(
            ["/usr/lib/git-core/git-http-backend"], input=body, env=env, capture_output=True
        ).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        status = 200
        headers = []
        for line in head.decode().split("\r\n"):
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = handle_one

    def log_message(self, *args):
        pass


HTTPServer(("127.0.0.1", port), Git).serve_forever()
"""


def sh(sbx: Sandbox, cmd: str) -> str:
    result = sbx.commands.run(cmd)
    assert result.exit_code == 0, result
    return result.stdout


@pytest.fixture(scope="module")
def sbx(sandbar):
    with created_sandbox(timeout=300) as sandbox:
        yield sandbox


def test_the_default_template_has_git_curl_certificates_and_procps(sbx):
    assert sh(sbx, "git --version").startswith("git version ")
    assert sh(sbx, "curl --version").startswith("curl ")
    assert sh(sbx, "test -s /etc/ssl/certs/ca-certificates.crt && echo ok") == "ok\n"
    assert "PID" in sh(sbx, "ps -e")


def test_local_repository_init_config_commit_branches_reset_restore(sbx):
    git = sbx.git
    repo = f"{HOME}/local"
    git.init(repo, initial_branch="main")
    git.configure_user("Sandbox User", "user@example.test")
    assert git.get_config("user.name") == "Sandbox User"
    assert git.get_config("user.email") == "user@example.test"
    git.set_config("core.fileMode", "false", scope="local", path=repo)
    assert git.get_config("core.fileMode", scope="local", path=repo) == "false"
    assert git.get_config("no.such.key") is None
    with pytest.raises(InvalidArgumentException):
        git.set_config("", "x")

    status = git.status(repo)
    assert status.current_branch == "main" and status.is_clean

    sbx.files.write(f"{repo}/a.txt", "one\n")
    sbx.files.write(f"{repo}/b.txt", "bee\n")
    status = git.status(repo)
    assert status.untracked_count == 2 and status.has_untracked and not status.has_staged
    git.add(repo, files=["a.txt"])
    status = git.status(repo)
    assert status.staged_count == 1 and status.untracked_count == 1
    git.add(repo)
    git.commit(repo, "first", author_name="Someone Else", author_email="else@example.test")
    assert sh(sbx, f"git -C {repo} log -1 --format=%an:%ae:%s") == "Someone Else:else@example.test:first\n"
    assert git.status(repo).is_clean
    git.commit(repo, "empty", allow_empty=True)
    assert sh(sbx, f"git -C {repo} log -1 --format=%an:%s") == "Sandbox User:empty\n"

    git.create_branch(repo, "feature")
    branches = git.branches(repo)
    assert sorted(branches.branches) == ["feature", "main"] and branches.current_branch == "feature"
    sbx.files.write(f"{repo}/a.txt", "two\n")
    git.add(repo)
    git.commit(repo, "second")
    git.checkout_branch(repo, "main")
    assert git.branches(repo).current_branch == "main"
    assert sbx.files.read(f"{repo}/a.txt") == "one\n"
    with pytest.raises(Exception, match="not fully merged"):
        git.delete_branch(repo, "feature")
    git.delete_branch(repo, "feature", force=True)
    assert git.branches(repo).branches == ["main"]

    # restore: the worktree from the index, then the index from HEAD.
    sbx.files.write(f"{repo}/a.txt", "changed\n")
    git.restore(repo, ["a.txt"])
    assert sbx.files.read(f"{repo}/a.txt") == "one\n"
    sbx.files.write(f"{repo}/a.txt", "staged\n")
    git.add(repo, files=["a.txt"])
    git.restore(repo, ["a.txt"], staged=True)
    status = git.status(repo)
    assert status.has_changes and not status.has_staged
    assert sbx.files.read(f"{repo}/a.txt") == "staged\n"
    with pytest.raises(InvalidArgumentException):
        git.restore(repo, [])

    # reset: soft keeps the change staged, hard drops everything.
    git.add(repo)
    git.commit(repo, "third")
    git.reset(repo, mode="soft", target="HEAD~1")
    assert git.status(repo).has_staged
    git.reset(repo, mode="hard", target="HEAD")
    assert git.status(repo).is_clean and sbx.files.read(f"{repo}/a.txt") == "one\n"
    with pytest.raises(InvalidArgumentException):
        git.reset(repo, mode="sideways")


def test_bare_remote_by_path_push_clone_pull(sbx):
    git = sbx.git
    git.configure_user("Sandbox User", "user@example.test")
    git.init(REMOTE, bare=True, initial_branch="main")
    git.init(WORK, initial_branch="main")
    sbx.files.write(f"{WORK}/readme.md", "v1\n")
    git.add(WORK)
    git.commit(WORK, "v1")

    assert git.remote_get(WORK, "origin") is None
    git.remote_add(WORK, "origin", "/nonexistent.git")
    git.remote_add(WORK, "origin", REMOTE, overwrite=True)
    assert git.remote_get(WORK, "origin") == REMOTE
    with pytest.raises(GitUpstreamException):
        git.pull(WORK)
    git.push(WORK, remote="origin", branch="main")
    status = git.status(WORK)
    assert status.upstream == "origin/main" and status.ahead == 0

    clone = f"{HOME}/clone"
    # A path clone ignores --depth; a file:// URL goes through the transport and honours it.
    git.clone(f"file://{REMOTE}", path=clone, branch="main", depth=1)
    assert sbx.files.read(f"{clone}/readme.md") == "v1\n"
    assert sh(sbx, f"git -C {clone} rev-parse --is-shallow-repository") == "true\n"
    sbx.files.write(f"{clone}/readme.md", "v2\n")
    git.add(clone)
    git.commit(clone, "v2")
    assert git.status(clone).ahead == 1
    git.push(clone)

    sh(sbx, f"git -C {WORK} fetch -q origin")
    assert git.status(WORK).behind == 1
    git.pull(WORK)
    assert sbx.files.read(f"{WORK}/readme.md") == "v2\n"
    assert git.status(WORK).behind == 0
    # Explicit remote and branch work without an upstream.
    git.create_branch(WORK, "topic")
    git.push(WORK, remote="origin", branch="topic", set_upstream=False)
    assert git.status(WORK).upstream is None
    git.pull(WORK, remote="origin", branch="main")
    assert "topic" in sh(sbx, f"git -C {REMOTE} branch --format='%(refname:short)'").split()


def test_credentials_over_http(sbx):
    git = sbx.git
    root = f"{HOME}/served"
    sh(sbx, f"mkdir -p {root} && git clone -q --bare {REMOTE} {root}/repo.git")
    sbx.files.write("/tmp/git_http.py", GIT_HTTP_SERVER)
    server = sbx.commands.run(
        "python3 /tmp/git_http.py " + shlex.join([root, str(HTTP_PORT), f"{HTTP_USER}:{HTTP_PASSWORD}"]),
        background=True,
    )
    try:
        url = f"http://127.0.0.1:{HTTP_PORT}/repo.git"
        wait_until(
            lambda: sbx.commands.run(f"curl -s -o /dev/null -w '%{{http_code}}' {url}/info/refs").stdout == "401",
            timeout=10,
        )
        with pytest.raises(GitAuthException, match="requires credentials"):
            git.clone(url, path=f"{HOME}/anonymous")
        with pytest.raises(GitAuthException):
            git.clone(url, path=f"{HOME}/wrong", username=HTTP_USER, password="wrong")
        with pytest.raises(InvalidArgumentException):
            git.clone(url, path=f"{HOME}/nouser", password=HTTP_PASSWORD)

        checkout = f"{HOME}/http-clone"
        git.clone(url, path=checkout, username=HTTP_USER, password=HTTP_PASSWORD)
        # The credentials were used for the clone and are not kept in the remote.
        assert git.remote_get(checkout, "origin") == url
        assert sbx.files.read(f"{checkout}/readme.md") == "v2\n"

        sbx.files.write(f"{checkout}/readme.md", "v3\n")
        git.add(checkout)
        git.commit(checkout, "v3")
        with pytest.raises(GitAuthException):
            git.push(checkout)
        git.push(checkout, username=HTTP_USER, password=HTTP_PASSWORD)
        assert git.remote_get(checkout, "origin") == url
        assert sh(sbx, f"git -C {root}/repo.git log -1 --format=%s main") == "v3\n"

        sh(sbx, f"git -C {root}/repo.git update-ref refs/heads/main $(git -C {root}/repo.git commit-tree -p main -m v4 main^{{tree}})")
        git.pull(checkout, username=HTTP_USER, password=HTTP_PASSWORD)
        assert sh(sbx, f"git -C {checkout} log -1 --format=%s") == "v4\n"
        assert git.remote_get(checkout, "origin") == url

        # Stored credentials: later operations need none.
        git.dangerously_authenticate(HTTP_USER, HTTP_PASSWORD, host=f"127.0.0.1:{HTTP_PORT}", protocol="http")
        assert git.get_config("credential.helper") == "store"
        git.clone(url, path=f"{HOME}/stored")
        assert sh(sbx, f"git -C {HOME}/stored log -1 --format=%s") == "v4\n"
    finally:
        server.kill()
