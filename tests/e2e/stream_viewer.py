"""Opens a desktop sandbox's noVNC stream in Debian's chromium, headless, driven by Playwright,
and reports what the viewer shows: run inside `tls_client_ns` (test_desktop.py), where the
stream's https://6080-<id>.<domain> name reaches the server's HTTPS listener.

    python3 stream_viewer.py <ca.pem> <screenshot dir> <url> [<url> ...]

The browser trusts the test's CA only: it is put in an NSS database under a HOME of this
run's own, the one chromium reads. Each URL is opened in its own page, all at once (several
viewers of one stream); prints one JSON line per page: whether noVNC connected, asked for a
password or failed, the canvas's size and how many colours it holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the page says, read from noVNC's own elements: its status line, and whether its
# password dialog is open.
STATE_JS = """() => {
  const canvas = document.querySelector('#noVNC_container canvas');
  let colours = 0, width = 0, height = 0;
  if (canvas && canvas.width > 0) {
    width = canvas.width; height = canvas.height;
    const data = canvas.getContext('2d').getImageData(0, 0, width, height).data;
    const seen = new Set();
    for (let i = 0; i < data.length && seen.size < 5000; i += 4 * 7) {
      seen.add((data[i] << 16) | (data[i + 1] << 8) | data[i + 2]);
    }
    colours = seen.size;
  }
  const dialog = document.querySelector('#noVNC_credentials_dlg');
  return {
    status: (document.querySelector('#noVNC_status') || {}).textContent || '',
    asks_password: !!(dialog && dialog.classList.contains('noVNC_open')),
    connected: document.documentElement.classList.contains('noVNC_connected'),
    width, height, colours,
  };
}"""


def trust(ca: str, home: Path) -> None:
    nssdb = home / ".pki" / "nssdb"
    nssdb.mkdir(parents=True)
    subprocess.run(["certutil", "-N", "-d", f"sql:{nssdb}", "--empty-password"], check=True)
    subprocess.run(
        ["certutil", "-A", "-d", f"sql:{nssdb}", "-n", "sandbar-test-ca", "-t", "C,,", "-i", ca],
        check=True,
    )


def main() -> None:
    ca, shots, urls = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    shots.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sandbar-viewer-") as home:
        trust(ca, Path(home))
        os.environ["HOME"] = home
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            # Root in a container has no user namespace for chromium's own sandbox.
            browser = p.chromium.launch(
                executable_path="/usr/bin/chromium", headless=True, args=["--no-sandbox"]
            )
            try:
                pages = []
                for url in urls:
                    page = browser.new_page(viewport={"width": 1100, "height": 850})
                    response = page.goto(url, wait_until="load", timeout=30_000)
                    pages.append((page, response.status if response else None))
                deadline = time.monotonic() + 20
                states = [None] * len(pages)
                while time.monotonic() < deadline:
                    states = [page.evaluate(STATE_JS) for page, _ in pages]
                    settled = all(
                        s["asks_password"] or (s["connected"] and s["colours"] > 8)
                        or "failed" in s["status"].lower()
                        for s in states
                    )
                    if settled:
                        break
                    time.sleep(0.3)
                for i, ((page, status), state) in enumerate(zip(pages, states)):
                    page.screenshot(path=str(shots / f"viewer-{i}.png"))
                    print(json.dumps({"http_status": status, **state}), flush=True)
            finally:
                browser.close()


if __name__ == "__main__":
    main()
