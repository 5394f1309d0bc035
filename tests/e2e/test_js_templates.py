"""Custom templates from npm: the e2b SDK's `Template.build` (js/templates.test.mjs) and the
`@e2b/cli` commands `template create`, `template list` and `template delete`."""

from __future__ import annotations

import json
import subprocess

import pytest
from e2b import Template

from e2e_util import JS_DIR, node_binary, run_node_test, sdk_env, unique

CLI = JS_DIR / "node_modules" / "@e2b" / "cli" / "dist" / "index.js"


def _delete_templates(sandbar, *names: str) -> None:
    """Best-effort removal of the templates a test built (the data dir is kept between runs)."""
    with sandbar.client() as api:
        try:
            listed = api.get("/templates").json()
        except Exception:  # noqa: BLE001
            return
        for t in listed:
            if set(t.get("aliases") or []) & set(names):
                try:
                    api.delete(f"/templates/{t['templateID']}")
                except Exception:  # noqa: BLE001
                    pass


def _listed(sandbar, name: str) -> list:
    with sandbar.client() as api:
        r = api.get("/templates")
        assert r.status_code == 200, r.text
        return [t for t in r.json() if name in (t.get("aliases") or []) + (t.get("names") or [])]


def test_js_sdk_template_build(sandbar, registry):
    name = unique("js")
    try:
        run_node_test(
            sandbar,
            "templates.test.mjs",
            timeout=400,
            SANDBAR_E2E_TINY_IMAGE=registry.image("e2e/tiny:1"),
            SANDBAR_E2E_TEMPLATE_NAME=name,
        )
    finally:
        _delete_templates(sandbar, name, f"{name}-fail")


@pytest.fixture
def cli(sandbar, tmp_path):
    node = node_binary()
    assert CLI.is_file(), f"the npm @e2b/cli is not installed: run `npm ci --prefix {JS_DIR}`"
    home = tmp_path / "home"
    home.mkdir()
    env = sdk_env(
        sandbar,
        E2B_DOMAIN=sandbar.domain,
        E2B_VALIDATE_API_KEY="false",
        # No update check against the npm registry, no user config from the real home.
        NO_UPDATE_NOTIFIER="1",
        HOME=str(home),
        XDG_CONFIG_HOME=str(home / ".config"),
        NO_COLOR="1",
    )

    def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            [node, str(CLI), *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    return _cli


def test_cli_template_create_list_delete(sandbar, registry, cli, tmp_path, make_sandbox):
    name = unique("cli")
    project = tmp_path / "project"
    project.mkdir()
    (project / "app.txt").write_text("from the cli\n")
    (project / "e2b.Dockerfile").write_text(
        f"FROM {registry.image('e2e/tiny:1')}\n"
        "RUN echo cli-built > /cli-built.txt\n"
        "COPY app.txt /app/app.txt\n"
        "ENV CLI_VAR=cli\n"
        "WORKDIR /app\n"
    )
    try:
        r = cli("template", "create", name, "--path", str(project), timeout=400)
        out = r.stdout + r.stderr
        assert r.returncode == 0, f"e2b template create exited {r.returncode}:\n{out}"
        assert "finished" in out, out
        assert Template.exists(name) is True
        assert len(_listed(sandbar, name)) == 1

        sbx = make_sandbox(template=name)
        run = lambda cmd: sbx.commands.run(cmd, timeout=30).stdout  # noqa: E731
        assert run("cat /cli-built.txt /app/app.txt") == "cli-built\nfrom the cli\n"
        assert run("echo $CLI_VAR $FROM_IMAGE") == "cli tiny\n"
        assert run("pwd") == "/app\n"
        assert run("whoami") == "user\n"

        r = cli("template", "list", "--format", "json")
        assert r.returncode == 0, f"e2b template list exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        listed = json.loads(r.stdout.strip())
        mine = [t for t in listed if name in (t.get("aliases") or [])]
        assert len(mine) == 1, listed
        assert any(t["templateID"] == mine[0]["templateID"] for t in _listed(sandbar, name))
        r = cli("template", "list")
        assert r.returncode == 0 and name in r.stdout, f"{r.stdout}\n{r.stderr}"

        r = cli("template", "delete", name, "-y")
        assert r.returncode == 0, f"e2b template delete exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
        assert Template.exists(name) is False
        assert _listed(sandbar, name) == []
        r = cli("template", "list", "--format", "json")
        assert r.returncode == 0 and name not in r.stdout, f"{r.stdout}\n{r.stderr}"
        # The sandbox started before the delete keeps running.
        assert run("cat /app/app.txt") == "from the cli\n"
    finally:
        _delete_templates(sandbar, name)
