"""Benchmark of the web dashboard in Debian's chromium (Playwright, headless): bytes a first
visit transfers (as sent, gzipped assets) and its time to interactive, for the Overview and a
sandbox's page (which adds xterm.js), cold and with a warm cache; then the sandbox list with
many sandboxes: the rows fragment's server time and the page until every row shows.

Not collected by the suite (no `test_` file name); run it on its own, as root, from the
repository's root:

    [SANDBAR_BENCH_DASHBOARD_SANDBOXES=50] python3 -m pytest tests/e2e/bench_dashboard.py -q -s -p no:cacheprovider

It uses the suite's shared server and prints one line per measurement; the numbers also go to
`$SANDBAR_E2E_LOG_DIR/dashboard/bench.json`.
"""

import json
import os
import statistics
import time

import httpx

from e2e_util import LOG_DIR

CHROMIUM = "/usr/bin/chromium"
OUT = LOG_DIR / "dashboard"
LOADS = 10

# Milliseconds from navigation start until the page is usable: its scripts ran (`load`) and
# htmx has processed the body (`htmx` defined, the polled areas wired).
TIMING_JS = """() => {
  const nav = performance.getEntriesByType('navigation')[0];
  const resources = performance.getEntriesByType('resource');
  return {
    interactive_ms: nav.loadEventEnd,
    dom_ms: nav.domContentLoadedEventEnd,
    bytes: nav.transferSize + resources.reduce((sum, r) => sum + r.transferSize, 0),
    decoded: nav.decodedBodySize + resources.reduce((sum, r) => sum + r.decodedBodySize, 0),
    htmx: typeof htmx !== 'undefined',
  };
}"""


def _cookie(sandbar) -> dict:
    reply = httpx.post(f"{sandbar.url}/dashboard/login", data={"key": sandbar.api_key})
    assert reply.status_code == 303, reply.text
    name, value = reply.headers["set-cookie"].split(";")[0].split("=", 1)
    return {"name": name, "value": value, "url": f"{sandbar.url}/dashboard"}


def _visit(browser, sandbar, cookie, path, loads):
    """First load in a fresh context (empty cache), then `loads` reloads with the cache warm."""
    context = browser.new_context(base_url=sandbar.url)
    context.add_cookies([cookie])
    page = context.new_page()
    try:
        page.goto(path, wait_until="load")
        cold = page.evaluate(TIMING_JS)
        assert cold["htmx"]
        warm = []
        for _ in range(loads):
            page.goto(path, wait_until="load")
            warm.append(page.evaluate(TIMING_JS))
        return cold, warm
    finally:
        context.close()


def test_dashboard_bench(sandbar):
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    results = {}
    headers = {"X-API-Key": sandbar.api_key}
    count = int(os.environ.get("SANDBAR_BENCH_DASHBOARD_SANDBOXES") or 50)
    made = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            cookie = _cookie(sandbar)
            sandbox = httpx.post(
                f"{sandbar.url}/sandboxes", headers=headers, json={"templateID": "base", "timeout": 300}, timeout=120
            ).json()
            made.append(sandbox["sandboxID"])
            for name, path in (("overview", "/dashboard/"), ("sandbox", f"/dashboard/sandboxes/{sandbox['sandboxID']}")):
                cold, warm = _visit(browser, sandbar, cookie, path, LOADS)
                results[name] = {
                    "cold_bytes": cold["bytes"],
                    "cold_decoded_bytes": cold["decoded"],
                    "cold_interactive_ms": round(cold["interactive_ms"], 1),
                    "warm_interactive_ms_median": round(statistics.median(w["interactive_ms"] for w in warm), 1),
                }
                print(f"[bench] {name}: {results[name]}")

            # The list with many sandboxes.
            for i in range(count - 1):
                reply = httpx.post(
                    f"{sandbar.url}/sandboxes",
                    headers=headers,
                    json={"templateID": "base", "timeout": 300, "metadata": {"bench": "dashboard", "n": str(i)}},
                    timeout=120,
                )
                assert reply.status_code == 201, reply.text
                made.append(reply.json()["sandboxID"])
            session = {"Cookie": f"{cookie['name']}={cookie['value']}"}
            times = []
            for _ in range(20):
                started = time.perf_counter()
                reply = httpx.get(f"{sandbar.url}/dashboard/sandboxes/rows", headers=session)
                times.append((time.perf_counter() - started) * 1000)
                assert reply.status_code == 200 and reply.text.count("data-sandbox=") >= count
            context = browser.new_context(base_url=sandbar.url)
            context.add_cookies([cookie])
            page = context.new_page()
            started = time.perf_counter()
            page.goto("/dashboard/sandboxes")
            # Polled from outside: the page's CSP forbids Playwright's in-page evaluation.
            while page.evaluate("document.querySelectorAll('tr[data-sandbox]').length") < count:
                time.sleep(0.02)
            shown = (time.perf_counter() - started) * 1000
            context.close()
            results["list"] = {
                "sandboxes": count,
                "rows_fragment_ms_median": round(statistics.median(times), 1),
                "rows_fragment_bytes": len(reply.content),
                "page_until_rows_ms": round(shown, 1),
            }
            print(f"[bench] list: {results['list']}")
        finally:
            browser.close()
            for sandbox_id in made:
                httpx.delete(f"{sandbar.url}/sandboxes/{sandbox_id}", headers=headers, timeout=60)
    (OUT / "bench.json").write_text(json.dumps(results, indent=2))
