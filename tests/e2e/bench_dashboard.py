"""Benchmark of the web dashboard in Debian's chromium (Playwright, headless): bytes a first
visit transfers (as sent, gzipped assets) and its time to interactive, for the Overview and a
sandbox's page (which adds xterm.js), cold and with a warm cache; then the sandbox list with
many sandboxes (a team of its own, whose limit is raised to the count): the rows fragment's
server time and the page until every row shows; then 20 dashboards left open on that list,
each polling it every second, and what they cost the server (CPU time and resident memory
over 30 s).

Not collected by the suite (no `test_` file name); run it on its own, as root, from the
repository's root:

    [SANDBAR_BENCH_DASHBOARD_SANDBOXES=1000] python3 -m pytest tests/e2e/bench_dashboard.py -q -s -p no:cacheprovider

It uses the suite's shared server and prints one line per measurement; the numbers also go to
`$SANDBAR_E2E_LOG_DIR/dashboard/bench.json`.
"""

import json
import os
import statistics
import time

import httpx

from concurrent.futures import ThreadPoolExecutor

from e2e_util import LOG_DIR, sandbar_cli, unique

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


# Sandboxes on one page of the list.
PAGE = 100
OPEN_DASHBOARDS = 20
OPEN_SECONDS = 30


def _cookie(sandbar, key: str) -> dict:
    reply = httpx.post(f"{sandbar.url}/dashboard/login", data={"key": key})
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
    many = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            cookie = _cookie(sandbar, sandbar.api_key)
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

            # The list with many sandboxes, of a team whose limit allows them.
            team = json.loads(sandbar_cli(sandbar, "team", "create", unique("dash-bench"), "--requests-per-minute", "0"))
            sandbar_cli(sandbar, "team", "set-limits", team["teamID"], "--max-sandboxes", str(count))
            headers = {"X-API-Key": team["apiKey"]}
            cookie = _cookie(sandbar, team["apiKey"])

            def create(i: int) -> str:
                reply = httpx.post(
                    f"{sandbar.url}/sandboxes",
                    headers=headers,
                    json={"templateID": "base", "timeout": 1800, "metadata": {"bench": "dashboard", "n": str(i)}},
                    timeout=120,
                )
                assert reply.status_code == 201, reply.text
                return reply.json()["sandboxID"]

            with ThreadPoolExecutor(16) as pool:
                many = list(pool.map(create, range(count)))
            session = {"Cookie": f"{cookie['name']}={cookie['value']}"}
            times = []
            for _ in range(20):
                started = time.perf_counter()
                reply = httpx.get(f"{sandbar.url}/dashboard/sandboxes/rows", headers=session)
                times.append((time.perf_counter() - started) * 1000)
                assert reply.status_code == 200 and reply.text.count("data-sandbox=") == min(count, PAGE)
            context = browser.new_context(base_url=sandbar.url)
            context.add_cookies([cookie])
            page = context.new_page()
            started = time.perf_counter()
            page.goto("/dashboard/sandboxes")
            # Polled from outside: the page's CSP forbids Playwright's in-page evaluation.
            while page.evaluate("document.querySelectorAll('tr[data-sandbox]').length") < min(count, PAGE):
                time.sleep(0.02)
            shown = (time.perf_counter() - started) * 1000
            context.close()
            results["list"] = {
                "sandboxes": count,
                "rows_shown": min(count, PAGE),
                "rows_fragment_ms_median": round(statistics.median(times), 1),
                "rows_fragment_bytes": len(reply.content),
                # As sent: httpx asks for gzip and counts what came over the wire.
                "rows_fragment_sent_bytes": reply.num_bytes_downloaded,
                "page_until_rows_ms": round(shown, 1),
            }
            print(f"[bench] list: {results['list']}")
            results["open_dashboards"] = _open_dashboards(browser, sandbar, cookie, count)
            print(f"[bench] {OPEN_DASHBOARDS} open dashboards: {results['open_dashboards']}")
        finally:
            browser.close()
            for sandbox_id in made:
                httpx.delete(f"{sandbar.url}/sandboxes/{sandbox_id}", headers={"X-API-Key": sandbar.api_key}, timeout=60)
            if many:
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(lambda sid: httpx.delete(f"{sandbar.url}/sandboxes/{sid}", headers=headers, timeout=60), many))
    (OUT / "bench.json").write_text(json.dumps(results, indent=2))


def _server_cpu_and_rss(pid: int):
    """The server's CPU seconds so far (user + system) and its resident memory in MiB."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss_mib = int(fields[21]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    return cpu, rss_mib


def _open_dashboards(browser, sandbar, cookie, count):
    """Leaves OPEN_DASHBOARDS pages on the list (each polls its rows every second) for
    OPEN_SECONDS, against the same span with none open."""
    pid = sandbar.pid
    cpu0, rss0 = _server_cpu_and_rss(pid)
    time.sleep(OPEN_SECONDS)
    cpu1, rss1 = _server_cpu_and_rss(pid)
    idle_cpu = (cpu1 - cpu0) / OPEN_SECONDS
    contexts = []
    try:
        for _ in range(OPEN_DASHBOARDS):
            context = browser.new_context(base_url=sandbar.url)
            context.add_cookies([cookie])
            page = context.new_page()
            page.goto("/dashboard/sandboxes")
            contexts.append((context, page))
        for _, page in contexts:
            while page.evaluate("document.querySelectorAll('tr[data-sandbox]').length") < min(count, PAGE):
                time.sleep(0.05)
        cpu2, rss2 = _server_cpu_and_rss(pid)
        time.sleep(OPEN_SECONDS)
        cpu3, rss3 = _server_cpu_and_rss(pid)
    finally:
        for context, _ in contexts:
            context.close()
    return {
        "sandboxes_listed": count,
        "server_cpu_idle_cores": round(idle_cpu, 3),
        "server_cpu_open_cores": round((cpu3 - cpu2) / OPEN_SECONDS, 3),
        "server_cpu_per_dashboard_ms_per_s": round((cpu3 - cpu2 - (cpu1 - cpu0)) / OPEN_SECONDS / OPEN_DASHBOARDS * 1000, 1),
        "server_rss_before_mib": round(rss1, 1),
        "server_rss_open_mib": round(rss3, 1),
    }
