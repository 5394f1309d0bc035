"""E2B's Desktop SDK (`e2b_desktop`), unchanged, against the built-in `desktop` template: the
screen, mouse and keyboard, screenshots, opening files and applications, window listing and
the noVNC stream.

The stream is viewed in Debian's chromium over HTTPS, from the client namespace of
`test_tls.py` where the stream's https://6080-<id>.<domain> address reaches the server, as a
browser given the SDK's `get_url` would (`test_the_stream_is_viewed_over_https_with_its_key`)."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import pytest
from PIL import Image, ImageChops

from e2b_desktop import Sandbox

from e2e_util import LOG_DIR, TEMPLATE_WAIT_S, created_sandbox, run_node_test, wait_until

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
VIEWER = Path(__file__).with_name("stream_viewer.py")


@pytest.fixture(scope="module")
def desktop_template(sandbar):
    return sandbar.wait_template("desktop", timeout=TEMPLATE_WAIT_S)


@pytest.fixture(scope="module")
def desk(sandbar, desktop_template):
    with created_sandbox(Sandbox, timeout=600) as sandbox:
        yield sandbox


def image(png: bytes) -> Image.Image:
    assert png[:8] == PNG_MAGIC, png[:16]
    return Image.open(io.BytesIO(png)).convert("RGB")


def changed(before: Image.Image, after: Image.Image) -> int:
    """How many pixels differ between two screenshots."""
    diff = ImageChops.difference(before, after).convert("L").point(lambda v: 255 if v else 0)
    return diff.histogram()[255]


def test_the_default_template_is_the_desktop(desk, desktop_template):
    assert desk.get_info().template_id == desktop_template["templateID"]


def test_the_screen_has_the_default_size_and_a_drawn_desktop(desk):
    assert desk.get_screen_size() == (1024, 768)
    shot = image(bytes(desk.screenshot()))
    assert shot.size == (1024, 768)
    # Not a blank frame: the panel and the desktop's background are drawn.
    assert len(shot.getcolors(maxcolors=1 << 20) or []) > 16


def test_a_command_typed_in_a_terminal_writes_a_file(desk):
    desk.launch("xfce4-terminal")
    windows = wait_until(lambda: desk.get_application_windows("xfce4-terminal"), timeout=15, message="a terminal window")
    wait_until(lambda: desk.get_current_window_id() in windows, timeout=15, message="the terminal has the focus")
    desk.write("echo typed-into-the-desktop > /tmp/typed.txt")
    desk.press("enter")
    text = wait_until(
        lambda: desk.files.exists("/tmp/typed.txt") and desk.files.read("/tmp/typed.txt"),
        timeout=15,
        message="the typed command's file",
    )
    assert text == "typed-into-the-desktop\n"
    assert "Terminal" in desk.get_window_title(windows[0])


def test_mouse_and_keys_change_the_screen(desk):
    desk.move_mouse(500, 400)
    assert desk.get_cursor_position() == (500, 400)
    before = image(bytes(desk.screenshot()))
    # A right click on the desktop opens its menu.
    desk.right_click(300, 300)
    menu = wait_until(lambda: (lambda s: changed(before, s) > 2000 and s)(image(bytes(desk.screenshot()))), timeout=15, message="the menu")
    desk.press("esc")
    wait_until(lambda: changed(before, image(bytes(desk.screenshot()))) < changed(before, menu), timeout=15, message="the menu closes")

    # A scroll in a terminal full of lines moves its view.
    desk.write("seq 1 400\n")
    time.sleep(0.5)
    bottom = image(bytes(desk.screenshot()))
    desk.scroll("up", 10)
    wait_until(lambda: changed(bottom, image(bytes(desk.screenshot()))) > 1000, timeout=15, message="the terminal scrolls")

    # A drag across the terminal's lines selects them, which shows.
    geometry = desk.commands.run(f"xdotool getwindowgeometry {desk.get_current_window_id()}").stdout
    x, y = (int(v) for v in geometry.split("Position: ")[1].split(" ")[0].split(","))
    before_drag = image(bytes(desk.screenshot()))
    desk.drag((x + 10, y + 15), (x + 250, y + 80))
    wait_until(lambda: changed(before_drag, image(bytes(desk.screenshot()))) > 500, timeout=15, message="the selection shows")


def test_open_shows_a_file_in_an_editor(desk):
    desk.files.write("/home/user/notes.txt", "notes from the test\n")
    desk.open("/home/user/notes.txt")
    wait_until(lambda: desk.get_application_windows("mousepad"), timeout=15, message="the editor's window")


def test_open_shows_a_url_in_the_browser(desk):
    # A page the sandbox serves itself: nothing leaves the sandbox.
    desk.files.write("/home/user/site/index.html", "<title>served-inside</title><h1>hello</h1>\n")
    server = desk.commands.run(
        "python3 -m http.server 8123 --bind 127.0.0.1", cwd="/home/user/site", background=True, timeout=0
    )
    try:
        desk.open("http://127.0.0.1:8123/")
        wait_until(
            lambda: any(
                "served-inside" in desk.get_window_title(w) for w in desk.get_application_windows("firefox")
            ),
            timeout=120,
            message="the page's title in the browser's window",
        )
    finally:
        desk.commands.run("pkill -x firefox-esr; true")
        server.kill()


def test_another_screen_size_and_dpi_come_from_the_create(sandbar, desktop_template):
    sandbox = Sandbox.create(resolution=(1280, 720), dpi=120, timeout=120)
    try:
        assert sandbox.get_screen_size() == (1280, 720)
        assert image(bytes(sandbox.screenshot())).size == (1280, 720)
        dpi = sandbox.commands.run("xdpyinfo | grep resolution:").stdout.split()[1]
        assert dpi == "120x120"
    finally:
        sandbox.kill()


def test_the_stream_starts_with_a_key_and_stops(desk):
    desk.stream.start(require_auth=True)
    key = desk.stream.get_auth_key()
    url = desk.stream.get_url(auth_key=key)
    assert url.startswith(f"https://6080-{desk.sandbox_id}.")
    assert f"password={key}" in url
    with pytest.raises(RuntimeError, match="already running"):
        desk.stream.start()
    # noVNC's page is served on the stream's port, and x11vnc asks for a password.
    page = desk.commands.run("curl -sf http://127.0.0.1:6080/vnc.html")
    assert "noVNC" in page.stdout
    desk.stream.stop()
    assert desk.commands.run("pgrep -x x11vnc || true").stdout.strip() == ""


def test_the_js_desktop_sdk_drives_it_too(sandbar, desktop_template):
    run_node_test(sandbar, "desktop.test.mjs", timeout=240)


def test_the_stream_is_viewed_over_https_with_its_key(desk, tls_client_ns):
    desk.stream.start(require_auth=True)
    try:
        key = desk.stream.get_auth_key()
        url = desk.stream.get_url(auth_key=key)
        assert url.startswith(f"https://6080-{desk.sandbox_id}.{tls_client_ns.domain}/vnc.html?")
        shots = LOG_DIR / "desktop-stream"
        # Two viewers with the key at once, then one without it and one with a wrong one.
        result = tls_client_ns.run(
            [sys.executable, str(VIEWER), str(tls_client_ns.ca_path), str(shots),
             url, url, desk.stream.get_url(), desk.stream.get_url(auth_key="not-the-key")],
            env=tls_client_ns.env(),
            timeout=150,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        viewers = [json.loads(line) for line in result.stdout.splitlines()]
        assert len(viewers) == 4, result.stdout
        for viewer in viewers[:2]:
            assert viewer["http_status"] == 200, viewer
            assert viewer["connected"], viewer
            # The desktop's own pixels, at the screen's size: not a blank or error page.
            assert (viewer["width"], viewer["height"]) == (1024, 768), viewer
            assert viewer["colours"] > 8, viewer
        no_key, wrong_key = viewers[2:]
        assert no_key["asks_password"] and no_key["colours"] == 0, no_key
        assert not wrong_key["connected"] and wrong_key["colours"] == 0, wrong_key
    finally:
        desk.stream.stop()
