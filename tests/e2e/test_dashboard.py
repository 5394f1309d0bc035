"""The web dashboard under /dashboard, driven in Debian's chromium by Playwright (headless,
never a downloaded browser): sign-in, sandboxes made, listed, paused and killed through the
pages, a command run in the terminal, files uploaded and downloaded, keys made and revoked,
sign-out; a second team sees none of the first one's; the session cookie and the CSRF token
are required, and tenant text is shown escaped. A screenshot of each page is kept under the
e2e log dir."""

import json
import re
import time
import warnings

import httpx
import pytest

from e2e_util import LOG_DIR, sandbar_cli, unique
from e2e_util import wait_js as _wait_js

playwright_api = pytest.importorskip("playwright.sync_api")

SHOTS = LOG_DIR / "dashboard"
# Tenant-controlled text that would run if a page rendered it unescaped.
XSS = "<script>window.__pwned=1</script>"
XSS_FILE = "<script>x=1.txt"


def _signed_in(browser, sandbar, key: str):
    context = browser.new_context(base_url=sandbar.url, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(15_000)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto("/dashboard/")
    assert page.url.endswith("/dashboard/login")
    page.fill("#key", key)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r"/dashboard/$"))
    return context, page, errors


def _terminal_state(page) -> str:
    return page.evaluate(
        "(() => { const t = document.querySelector('#terminal');"
        " return t.dataset.connected === '1' ? 'open' : (t.dataset.closed || ''); })()"
    )


def _open_terminal(page, sandbar, errors) -> None:
    """Opens the terminal; a refused first handshake is reported as a warning with the
    server's reason and retried once through the page's reconnect button, as a user would."""
    for attempt in (1, 2):
        page.click("#open-terminal")
        deadline = time.monotonic() + 30
        while (state := _terminal_state(page)) == "":
            assert time.monotonic() < deadline, f"the terminal neither opened nor closed; page errors: {errors}"
            time.sleep(0.1)
        if state == "open":
            return
        reasons = [line for line in sandbar.log_tail(400).splitlines() if "terminal not opened" in line]
        message = f"terminal attempt {attempt} ended '{state}'; page errors: {errors}; server: {reasons[-3:]}"
        assert attempt == 1, message
        warnings.warn(message)


def _wait_for_files(page) -> None:
    """Waits for the files panel's listing; a panel still loading or showing a failure is
    reported with what it and the error box say."""
    try:
        page.wait_for_selector("#file-table", timeout=30_000)
    except playwright_api.TimeoutError:
        panel = page.locator("#files").inner_html()
        errors = page.locator("#errors").inner_text()
        raise AssertionError(f"no file listing; the panel shows {panel!r}; the error box says {errors!r}") from None


def _shot(page, name: str) -> None:
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _kill(sandbar, sandbox_id: str, key: str) -> None:
    httpx.delete(f"{sandbar.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": key}, timeout=30)


def test_session_cookie_and_csrf_are_required(sandbar):
    url = sandbar.url
    # No session: a page load goes to the sign-in form; anything else is 401.
    reply = httpx.get(f"{url}/dashboard/keys", headers={"Accept": "text/html"})
    assert reply.status_code == 303 and reply.headers["location"] == "/dashboard/login"
    assert reply.headers["x-frame-options"] == "DENY"
    csp = reply.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
    reply = httpx.post(f"{url}/dashboard/keys", data={"name": "x"})
    assert reply.status_code == 401, reply.text
    reply = httpx.get(f"{url}/dashboard", headers={"Accept": "text/html"})
    assert reply.status_code == 303 and reply.headers["location"] == "/dashboard/login"

    # A wrong key is refused with the API's words; the right one gets a strict cookie.
    reply = httpx.post(f"{url}/dashboard/login", data={"key": "e2b_" + "0" * 40})
    assert reply.status_code == 401 and "invalid api key" in reply.text
    reply = httpx.post(f"{url}/dashboard/login", data={"key": sandbar.api_key})
    assert reply.status_code == 303, reply.text
    cookie = reply.headers["set-cookie"]
    for part in ("HttpOnly", "SameSite=Strict", "Path=/dashboard"):
        assert part in cookie, cookie
    session = cookie.split(";")[0]
    page = httpx.get(f"{url}/dashboard/keys", headers={"Cookie": session})
    assert page.status_code == 200
    csrf = re.search(r'X-CSRF-Token&quot;:&quot;([0-9a-f]+)', page.text).group(1)

    # A forged or missing CSRF token changes nothing.
    name = unique("forged")
    for headers in ({"Cookie": session, "X-CSRF-Token": "0" * len(csrf)}, {"Cookie": session}):
        reply = httpx.post(f"{url}/dashboard/keys", data={"name": name}, headers=headers)
        assert reply.status_code == 403, reply.text
    keys = httpx.get(f"{url}/api-keys", headers={"Authorization": f"Bearer {_access_token(sandbar)}"}).json()
    assert name not in [k["name"] for k in keys]

    # The cookie is no credential for the API or the edge.
    reply = httpx.get(f"{url}/v2/sandboxes", headers={"Cookie": session})
    assert reply.status_code == 401, reply.text

    # Unknown paths answer a page or JSON, never a crash.
    reply = httpx.get(f"{url}/dashboard/no/such/page", headers={"Cookie": session})
    assert reply.status_code == 404 and reply.json()["code"] == 404
    reply = httpx.get(f"{url}/dashboard/sandboxes/%00%ff/files?path=%00", headers={"Cookie": session})
    assert reply.status_code in (400, 404), reply.text
    reply = httpx.get(f"{url}/dashboard/assets/..%2f..%2fetc%2fpasswd")
    assert reply.status_code == 404

    # Sign-out ends the session on the server.
    reply = httpx.post(f"{url}/dashboard/logout", headers={"Cookie": session, "X-CSRF-Token": csrf})
    assert reply.status_code == 204 and "Max-Age=0" in reply.headers["set-cookie"]
    assert httpx.get(f"{url}/dashboard/keys", headers={"Cookie": session}).status_code == 401


def _access_token(sandbar) -> str:
    return json.loads((sandbar.data_dir / "credentials.json").read_text())["accessToken"]


def test_dashboard_in_a_browser(sandbar, browser):
    context, page, errors = _signed_in(browser, sandbar, sandbar.api_key)
    sandbox_id = None
    try:
        _shot(page, "overview")
        assert page.locator("#running-count").is_visible()
        assert float(page.locator("#create-rate b").inner_text()) >= 0

        # Create a sandbox through the page, with hostile metadata.
        page.goto("/dashboard/sandboxes")
        page.click("#create summary")
        page.fill("#create-form textarea[name=metadata]", f"xss={XSS}\nsuite=dashboard")
        page.fill("#create-form input[name=timeout]", "120")
        page.click("#create-form button[type=submit]")
        page.wait_for_url(re.compile(r"/dashboard/sandboxes/[a-z0-9]+$"), timeout=60_000)
        sandbox_id = page.url.rsplit("/", 1)[1]
        assert page.locator("#metadata").inner_text().count(XSS) == 1
        assert page.evaluate("window.__pwned") is None
        assert page.locator("#sandbox-state").inner_text() == "running"

        # The terminal runs a command and shows its output.
        _open_terminal(page, sandbar, errors)
        page.click("#terminal")
        page.keyboard.type("echo dash-$((6*7))\n")
        _wait_js(page, "document.querySelector('#terminal .xterm-rows').textContent.includes('dash-42')")

        # The chart and the log are polled; the log's filters apply to what is polled.
        _wait_js(page, "document.querySelector('#chart .disk') !== null", 30)
        page.fill("#log-filter input[name=search]", "no-line-says-this")
        page.wait_for_selector("#no-log")
        page.select_option("#log-filter select[name=level]", "error")
        page.fill("#log-filter input[name=search]", "")
        page.wait_for_selector("#log-box")
        assert page.locator("#log-filter select[name=level]").input_value() == "error"

        # Files: upload one with a hostile name, see it listed, download it, delete it.
        _wait_for_files(page)
        # Past the 2 MB axum holds ordinary bodies to: the upload is streamed.
        content = b"uploaded through the dashboard\n" * 100_000
        page.set_input_files("#upload-file", files=[{"name": XSS_FILE, "mimeType": "text/plain", "buffer": content}])
        page.click("#upload-form button[type=submit]")
        row = page.locator("#file-table tr", has_text=XSS_FILE)
        row.wait_for()
        assert page.evaluate("window.__pwned") is None
        with page.expect_download() as download:
            row.locator("a.download").click()
        # The browser makes the name safe for its disk (`<`, `>` become `_`).
        assert download.value.suggested_filename.endswith("script_x=1.txt")
        assert open(download.value.path(), "rb").read() == content
        _shot(page, "sandbox")
        row.locator("button.delete").click()
        row.wait_for(state="detached")

        # Paused elsewhere (through the API): the page shows it; resumed from the page.
        reply = httpx.post(
            f"{sandbar.url}/sandboxes/{sandbox_id}/pause", headers={"X-API-Key": sandbar.api_key}, timeout=60
        )
        assert reply.status_code == 204, reply.text
        _wait_js(page, "document.querySelector('#sandbox-state').textContent === 'paused'", 5)
        # The pause closed the terminal's connection; the page says so and offers it again.
        _wait_js(page, "document.querySelector('#terminal').dataset.closed === 'closed'", 10)
        assert "the terminal closed" in page.locator("#terminal .xterm-rows").inner_text()
        # A listing while paused is said in the panel, which tries again by itself.
        panel = page.evaluate(f"fetch('/dashboard/sandboxes/{sandbox_id}/files').then(async r => r.status + ' ' + await r.text())")
        assert panel.startswith("200 ") and "Cannot list" in panel and "is not running" in panel, panel
        assert 'hx-trigger="load delay:2s"' in panel, panel
        exhausted = page.evaluate(
            f"fetch('/dashboard/sandboxes/{sandbox_id}/files?failed=5').then(r => r.text())"
        )
        assert "files-retry" in exhausted and "load delay" not in exhausted, exhausted
        _shot(page, "sandbox-paused")
        page.click("#resume")
        _wait_js(page, "document.querySelector('#sandbox-state').textContent === 'running'", 30)
        _open_terminal(page, sandbar, errors)
        page.click("#terminal")
        page.keyboard.type("echo again-$((6*7))\n")
        _wait_js(page, "document.querySelector('#terminal .xterm-rows').textContent.includes('again-42')")

        # The list shows it, and the metadata filter keeps it or leaves it out.
        page.goto("/dashboard/sandboxes")
        page.wait_for_selector(f"tr[data-sandbox='{sandbox_id}']")
        assert page.evaluate("window.__pwned") is None
        page.fill("#filter input[name=metadata]", "suite=nothing-like-it")
        page.wait_for_selector(f"tr[data-sandbox='{sandbox_id}']", state="detached")
        page.fill("#filter input[name=metadata]", "suite=dashboard")
        page.wait_for_selector(f"tr[data-sandbox='{sandbox_id}']")
        _shot(page, "sandboxes")
        # Usable at a phone's width: nothing wider than the screen but the scrolled tables.
        page.set_viewport_size({"width": 390, "height": 844})
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        _shot(page, "sandboxes-phone")
        page.set_viewport_size({"width": 1280, "height": 720})

        # Killed from its page: back to the list, and gone from the API.
        page.goto(f"/dashboard/sandboxes/{sandbox_id}")
        page.click("#kill")
        page.wait_for_url(re.compile(r"/dashboard/sandboxes$"))
        reply = httpx.get(f"{sandbar.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": sandbar.api_key})
        assert reply.status_code == 404
        sandbox_id = None

        # An action that fails shows the API's message in the error box.
        page.goto("/dashboard/sandboxes")
        page.click("#create summary")
        page.fill("#create-form input[name=template]", "no-such-template-here")
        page.click("#create-form button[type=submit]")
        page.wait_for_selector("#errors .error")
        assert "no-such-template-here" in page.locator("#errors .error").inner_text()

        # Templates, and the base template's build with its log.
        page.goto("/dashboard/templates")
        _shot(page, "templates")
        page.locator("#template-table a.mono").first.click()
        page.wait_for_selector("#build-status")
        assert page.locator("#build-status").inner_text() in ("ready", "building", "waiting", "error")
        _shot(page, "build")

        # A key made on the page works until it is revoked there.
        name = unique("dash")
        page.goto("/dashboard/keys")
        page.fill("#key-form input[name=name]", name)
        page.click("#key-form button[type=submit]")
        key = page.locator("#new-key-value").inner_text().strip()
        assert key.startswith("e2b_")
        assert httpx.get(f"{sandbar.url}/v2/sandboxes", headers={"X-API-Key": key}).status_code == 200
        _shot(page, "keys")
        page.locator(f"tr[data-key='{name}'] button.revoke").click()
        page.wait_for_selector(f"tr[data-key='{name}']", state="detached")
        assert httpx.get(f"{sandbar.url}/v2/sandboxes", headers={"X-API-Key": key}).status_code == 401

        # Sign out: the pages ask for a key again.
        page.click("#sign-out")
        page.wait_for_url(re.compile(r"/dashboard/login$"))
        page.goto("/dashboard/sandboxes")
        assert page.url.endswith("/dashboard/login")
        _shot(page, "login")
        assert errors == []
    finally:
        if sandbox_id:
            _kill(sandbar, sandbox_id, sandbar.api_key)
        context.close()


def _csrf(page) -> str:
    found = re.search(r'X-CSRF-Token&quot;:&quot;([0-9a-f]+)', page.content()) or re.search(
        r'"X-CSRF-Token":"([0-9a-f]+)"', page.content()
    )
    return found.group(1)


def test_second_team_sees_none_of_the_first_ones(sandbar, browser, sandbox):
    team = json.loads(sandbar_cli(sandbar, "team", "create", unique("dashteam")))
    context, page, _ = _signed_in(browser, sandbar, team["apiKey"])
    try:
        page.goto("/dashboard/sandboxes")
        page.wait_for_selector("#no-sandboxes")
        assert sandbox.sandbox_id not in page.content()
        for path in (
            f"/dashboard/sandboxes/{sandbox.sandbox_id}",
            f"/dashboard/sandboxes/{sandbox.sandbox_id}/files",
            f"/dashboard/sandboxes/{sandbox.sandbox_id}/files/download?path=/etc/hostname",
        ):
            reply = page.request.get(path)
            assert reply.status == 404, (path, reply.status)
        # Its own actions on the first team's sandbox are refused too.
        reply = page.request.post(
            f"/dashboard/sandboxes/{sandbox.sandbox_id}/kill", headers={"X-CSRF-Token": _csrf(page)}
        )
        assert reply.status == 404
        assert sandbox.is_running()
        page.goto("/dashboard/keys")
        listed = page.locator("#key-table tbody tr").all_inner_texts()
        assert len(listed) == 1, listed
        page.goto("/dashboard/")
        assert page.locator("#running-count b").inner_text() == "0"
    finally:
        context.close()


def test_snapshot_fork_and_usage_pages(sandbar, browser, make_sandbox):
    """A running sandbox's page takes a snapshot and a fork; the snapshots page lists the
    snapshot, starts a sandbox from it and deletes it; the usage page shows the team's
    limits. Each started copy holds the file the source wrote."""
    source = make_sandbox(metadata={"suite": "dashboard-copies"})
    source.files.write("/home/user/copied.txt", "written before the copy\n")
    context, page, errors = _signed_in(browser, sandbar, sandbar.api_key)
    started = []
    try:
        page.goto(f"/dashboard/sandboxes/{source.sandbox_id}")
        page.click("#snapshot")
        page.wait_for_url(re.compile(r"/dashboard/snapshots$"), timeout=120_000)
        row = page.locator("#snapshot-table tbody tr", has_text=source.sandbox_id)
        row.wait_for()
        snapshot_template = row.get_attribute("data-snapshot")
        _shot(page, "snapshots")

        # A sandbox started from the snapshot holds the source's file.
        row.locator("button.start-from").click()
        page.wait_for_url(re.compile(r"/dashboard/sandboxes/[a-z0-9]+$"), timeout=120_000)
        started.append(page.url.rsplit("/", 1)[1])
        assert started[-1] != source.sandbox_id

        # A fork from the source's page opens the fork, which holds the file too.
        page.goto(f"/dashboard/sandboxes/{source.sandbox_id}")
        page.click("#fork")
        page.wait_for_url(lambda url: url.rsplit("/", 1)[1] not in (source.sandbox_id, started[-1]) and "/sandboxes/" in url, timeout=120_000)
        started.append(page.url.rsplit("/", 1)[1])
        assert page.locator("#sandbox-state").inner_text() == "running"

        from e2b import Sandbox

        for sandbox_id in started:
            copy = Sandbox.connect(sandbox_id)
            assert copy.files.read("/home/user/copied.txt") == "written before the copy\n", sandbox_id
        # The source ran on through both.
        assert source.commands.run("echo still-$((6*7))").stdout.strip() == "still-42"

        # Deleted from the snapshots page: gone from the API's list too.
        page.goto("/dashboard/snapshots")
        page.locator(f"tr[data-snapshot='{snapshot_template}'] button.delete-snapshot").click()
        page.wait_for_selector(f"tr[data-snapshot='{snapshot_template}']", state="detached")
        listed = httpx.get(
            f"{sandbar.url}/snapshots", headers={"X-API-Key": sandbar.api_key}, params={"sandboxID": source.sandbox_id}
        )
        assert listed.status_code == 200 and listed.json() == [], listed.text

        # A paused sandbox offers neither: only running sandboxes are copied.
        source.pause()
        page.goto(f"/dashboard/sandboxes/{source.sandbox_id}")
        assert page.locator("#snapshot").count() == 0 and page.locator("#fork").count() == 0
        # Asked anyway, the action is refused with the core's reason, for the error box.
        reply = page.request.post(
            f"/dashboard/sandboxes/{source.sandbox_id}/fork", headers={"X-CSRF-Token": _csrf(page)}
        )
        assert reply.status == 409 and "paused" in reply.text(), (reply.status, reply.text())
        assert reply.headers.get("hx-retarget") == "#errors"

        # The events page lists what happened to them, the newest first.
        page.goto("/dashboard/events")
        page.wait_for_selector(f"#event-table tr[data-sandbox='{started[-1]}'][data-event='sandbox.lifecycle.created']")
        _shot(page, "events")

        page.goto("/dashboard/usage")
        assert page.locator("#limits").is_visible()
        assert "sandboxes at once" in page.locator("#usage-peak").inner_text()
        _shot(page, "usage")
        assert errors == []
    finally:
        for sandbox_id in started:
            _kill(sandbar, sandbox_id, sandbar.api_key)
        context.close()


def _fill_webhook_form(page, name, url):
    """Opens the page's form for a new webhook and fills in its name, URL and a secret."""
    page.click("#webhook-create summary")
    page.fill("#webhook-form input[name=name]", name)
    page.fill("#webhook-form input[name=url]", url)
    page.fill("#webhook-form input[name=secret]", "a-secret-for-the-page")


def test_webhooks_page_registers_shows_deliveries_and_deletes(sandbar, browser, make_sandbox):
    from test_webhooks import Receiver

    receiver = Receiver()
    receiver.fail_first = False
    context, page, errors = _signed_in(browser, sandbar, sandbar.api_key)
    name = unique("pagehook")
    try:
        page.goto("/dashboard/webhooks")
        _fill_webhook_form(page, name, receiver.url)
        for unticked in ("updated", "paused", "resumed", "checkpointed"):
            page.uncheck(f"#webhook-form input[name={unticked}]")
        page.click("#webhook-form button[type=submit]")
        hook = page.locator(f"section.webhook[data-webhook='{name}']")
        hook.wait_for()
        assert "created killed" in hook.inner_text()

        sbx = make_sandbox()
        sbx.kill()
        deadline = time.monotonic() + 20
        while len(receiver.events(sbx.sandbox_id)) < 2:
            assert time.monotonic() < deadline, receiver.requests
            time.sleep(0.1)
        page.reload()
        delivered = page.locator(f"section.webhook[data-webhook='{name}'] tr.delivery[data-delivered='true']")
        assert delivered.count() >= 2
        _shot(page, "webhooks")

        # A refused registration shows the core's reason.
        _fill_webhook_form(page, unique("badhook"), "ftp://127.0.0.1/hook")
        page.evaluate("document.querySelector('#webhook-form input[name=url]').type = 'text'")
        page.click("#webhook-form button[type=submit]")
        page.wait_for_selector("#errors .error")
        assert "http or https" in page.locator("#errors .error").inner_text()

        hook.locator("button.delete-webhook").click()
        page.wait_for_selector(f"section.webhook[data-webhook='{name}']", state="detached")
        assert errors == []
    finally:
        for h in httpx.get(f"{sandbar.url}/events/webhooks", headers={"X-API-Key": sandbar.api_key}).json():
            if h["name"] == name:
                httpx.delete(f"{sandbar.url}/events/webhooks/{h['id']}", headers={"X-API-Key": sandbar.api_key})
        receiver.close()
        context.close()


def test_a_template_from_a_pasted_dockerfile_builds_on_its_page(sandbar, browser, tiny1, make_sandbox):
    context, page, errors = _signed_in(browser, sandbar, sandbar.api_key)
    name = unique("pasted")
    try:
        page.goto("/dashboard/templates")
        page.click("#template-create summary")
        page.fill("#dockerfile-form input[name=name]", name)
        page.fill("#dockerfile-form textarea[name=dockerfile]", f"FROM {tiny1}\nRUN echo from-the-page > /page.txt\n")
        page.click("#dockerfile-form button[type=submit]")
        page.wait_for_url(re.compile(r"/dashboard/templates/[a-z0-9]+/builds/[a-z0-9-]+$"), timeout=30_000)
        _wait_js(page, "['ready', 'error'].includes(document.querySelector('#build-status').textContent)", 180)
        assert page.locator("#build-status").inner_text() == "ready", page.locator("#build-log").inner_text()
        _shot(page, "build-from-page")
        sbx = make_sandbox(template=name)
        assert sbx.commands.run("cat /page.txt").stdout == "from-the-page\n"

        # A COPY has no context to copy from here: refused with the reason, nothing built.
        page.goto("/dashboard/templates")
        page.click("#template-create summary")
        refused = unique("pasted-copy")
        page.fill("#dockerfile-form input[name=name]", refused)
        # Loaded from a file this time: the page reads it into the text that is sent.
        dockerfile = f"FROM {tiny1}\nCOPY app.txt /app/\n"
        page.set_input_files("#dockerfile-file", files=[{"name": "Dockerfile", "mimeType": "text/plain",
                                                         "buffer": dockerfile.encode()}])
        _wait_js(page, f"document.querySelector('#dockerfile').value === {json.dumps(dockerfile)}")
        page.click("#dockerfile-form button[type=submit]")
        page.wait_for_selector("#errors .error")
        assert "build context" in page.locator("#errors .error").inner_text()
        listed = httpx.get(f"{sandbar.url}/templates", headers={"X-API-Key": sandbar.api_key}).json()
        assert refused not in [a for t in listed for a in t.get("aliases", [])]
        assert errors == []
    finally:
        context.close()


def test_volumes_page_makes_browses_downloads_and_deletes(sandbar, browser, make_sandbox):
    context, page, errors = _signed_in(browser, sandbar, sandbar.api_key)
    name = unique("pagevol")
    try:
        page.goto("/dashboard/volumes")
        page.fill("#volume-form input[name=name]", name)
        page.click("#volume-form button[type=submit]")
        row = page.locator(f"#volume-table tr[data-volume='{name}']")
        row.wait_for()

        # Filled from a sandbox that mounts it, with a hostile file name.
        sbx = make_sandbox(volume_mounts={"/mnt/vol": name})
        sbx.commands.run(f"mkdir -p /mnt/vol/dir && printf 'in the volume\\n' > '/mnt/vol/dir/{XSS_FILE}'")
        sbx.kill()

        row.locator("a").click()
        page.wait_for_selector("#volume-files tr[data-entry='dir'] a.open-dir")
        page.click("#volume-files tr[data-entry='dir'] a.open-dir")
        assert page.locator("#volume-dir").inner_text() == "/dir"
        file_row = page.locator("#volume-files tr", has_text=XSS_FILE)
        file_row.wait_for()
        assert page.evaluate("window.__pwned") is None
        with page.expect_download() as download:
            file_row.locator("a.download").click()
        assert open(download.value.path(), "rb").read() == b"in the volume\n"
        _shot(page, "volume")
        # Paths that leave the volume are refused.
        reply = page.request.get(f"{page.url.split('?')[0]}/download?path=/../../etc/hostname")
        assert reply.status in (400, 404), reply.status

        page.goto("/dashboard/volumes")
        page.locator(f"#volume-table tr[data-volume='{name}'] button.delete-volume").click()
        page.wait_for_selector(f"#volume-table tr[data-volume='{name}']", state="detached")
        assert errors == []
    finally:
        context.close()
