"""The control-plane REST API on the wire: status codes, error bodies, field names, pagination."""

import time
import urllib.parse
from datetime import datetime

import pytest

from e2e_util import unique

UNKNOWN_ID = "inotexisting0000000000"

LISTED_FIELDS = (
    "templateID",
    "sandboxID",
    "clientID",
    "startedAt",
    "endAt",
    "cpuCount",
    "memoryMB",
    "diskSizeMB",
    "state",
    "envdVersion",
)


def _ts(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def assert_error(r, status):
    assert r.status_code == status, f"expected {status}, got {r.status_code}: {r.text[:300]}"
    assert r.headers.get("content-type", "").startswith("application/json"), r.headers.get("content-type")
    body = r.json()
    assert isinstance(body, dict), body
    assert isinstance(body.get("code"), int) and not isinstance(body.get("code"), bool), body
    assert body["code"] == status, body
    assert isinstance(body.get("message"), str) and body["message"], body


@pytest.fixture
def api(sandbar):
    with sandbar.client() as c:
        yield c


@pytest.fixture
def unchanged(sandbar):
    """Asserts at the end of the test that no sandbox appeared or disappeared."""
    before = sandbar.sandbox_ids()
    yield
    after = sandbar.sandbox_ids()
    assert after == before, f"sandboxes changed: new {sorted(after - before)}, gone {sorted(before - after)}"


@pytest.fixture
def api_sandbox(api, track_sandbox_id):
    """A sandbox created through POST /v2/sandboxes; returns its create response."""
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "metadata": {}, "envVars": {}})
    assert r.status_code == 201, r.text
    body = r.json()
    track_sandbox_id(body["sandboxID"])
    return body


# ---- authentication --------------------------------------------------------------


def test_health_needs_no_key(sandbar):
    with sandbar.client(api_key=None) as c:
        r = c.get("/health")
    assert r.status_code in (200, 204)


@pytest.mark.parametrize("key", [None, "", "e2b_" + "0" * 40, "not-a-key", "Bearer x"])
def test_bad_api_key_is_401(sandbar, unchanged, key):
    headers = {} if key is None else {"X-API-Key": key}
    with sandbar.client(api_key=None, headers=headers) as c:
        for method, path, body in (
            ("GET", "/v2/sandboxes", None),
            ("GET", "/sandboxes", None),
            ("GET", "/templates", None),
            ("POST", "/v2/sandboxes", {"templateID": "base"}),
            ("POST", "/sandboxes", {"templateID": "base"}),
            ("GET", f"/sandboxes/{UNKNOWN_ID}", None),
            ("DELETE", f"/sandboxes/{UNKNOWN_ID}", None),
        ):
            r = c.request(method, path, json=body)
            assert_error(r, 401)


def test_key_of_wrong_case_is_401(sandbar, unchanged):
    wrong = "e2b_" + sandbar.api_key[4:].upper()
    if wrong == sandbar.api_key:
        pytest.skip("the key has no letters")
    with sandbar.client(api_key=wrong) as c:
        assert_error(c.get("/v2/sandboxes"), 401)


# ---- bad requests ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/sandboxes", "/v2/sandboxes"])
def test_malformed_json_is_400(api, unchanged, path):
    for raw in (b"{", b"not json", b'{"templateID": "base",}', b"[]", b'"base"'):
        r = api.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert_error(r, 400)


@pytest.mark.parametrize("path", ["/sandboxes", "/v2/sandboxes"])
def test_wrong_types_are_400(api, unchanged, path):
    for body in (
        {"templateID": 5},
        {"templateID": "base", "timeout": "x"},
        {"templateID": "base", "timeout": -5},
        {"templateID": "base", "metadata": {"k": 1}},
        {"templateID": "base", "metadata": ["k"]},
        {"templateID": "base", "envVars": "A=1"},
        {"templateID": "base", "allow_internet_access": "yes"},
        {"templateID": "base", "timeout": 1.5},
    ):
        r = api.post(path, json=body)
        assert_error(r, 400)


@pytest.mark.parametrize("path", ["/sandboxes", "/v2/sandboxes"])
def test_timeout_above_team_maximum_is_400(api, unchanged, path):
    # the default team allows at most 24 hours
    assert_error(api.post(path, json={"templateID": "base", "timeout": 86_401}), 400)


@pytest.mark.parametrize("path", ["/sandboxes", "/v2/sandboxes"])
def test_unknown_template_is_404(api, unchanged, path):
    r = api.post(path, json={"templateID": "no-such-template-" + unique(), "timeout": 30})
    assert_error(r, 404)


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=-1", "limit=abc", "state=bogus", "order=sideways"])
def test_bad_list_params_are_400(api, query):
    assert_error(api.get("/v2/sandboxes?" + query), 400)


def test_list_limit_bounds_are_accepted(api):
    for q in ("limit=1", "limit=100"):
        r = api.get("/v2/sandboxes?" + q)
        assert r.status_code == 200, r.text
        assert isinstance(r.json(), list)


def test_bad_next_token_is_400(api):
    assert_error(api.get("/v2/sandboxes?nextToken=%%%not-a-token"), 400)


def test_timeout_validation(api, api_sandbox, unchanged):
    sid = api_sandbox["sandboxID"]
    assert_error(api.post(f"/sandboxes/{sid}/timeout", json={"timeout": -1}), 400)
    assert_error(api.post(f"/sandboxes/{sid}/timeout", json={"timeout": "x"}), 400)
    assert_error(api.post(f"/sandboxes/{sid}/timeout", json={}), 400)
    assert_error(
        api.post(f"/sandboxes/{sid}/timeout", content=b"{", headers={"Content-Type": "application/json"}), 400
    )
    before = _ts(api.get(f"/sandboxes/{sid}").json()["endAt"])
    r = api.post(f"/sandboxes/{sid}/timeout", json={"timeout": 600})
    assert r.status_code == 204, r.text
    after = _ts(api.get(f"/sandboxes/{sid}").json()["endAt"])
    assert after > before


def test_refreshes(api, api_sandbox, unchanged):
    sid = api_sandbox["sandboxID"]
    assert_error(api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 3601}), 400)
    assert_error(api.post(f"/sandboxes/{sid}/refreshes", json={"duration": -1}), 400)
    r = api.post(f"/sandboxes/{sid}/refreshes", json={"duration": 60})
    assert r.status_code == 204, r.text
    assert_error(api.post(f"/sandboxes/{UNKNOWN_ID}/refreshes", json={"duration": 60}), 404)


def test_unknown_sandbox_is_404(api, unchanged):
    assert_error(api.get(f"/sandboxes/{UNKNOWN_ID}"), 404)
    assert_error(api.delete(f"/sandboxes/{UNKNOWN_ID}"), 404)
    assert_error(api.post(f"/sandboxes/{UNKNOWN_ID}/timeout", json={"timeout": 30}), 404)
    assert_error(api.post(f"/v2/sandboxes/{UNKNOWN_ID}/connect", json={}), 404)
    assert_error(api.post(f"/sandboxes/{UNKNOWN_ID}/connect", json={"timeout": 30}), 404)


# ---- create, get, list ---------------------------------------------------------------


def test_v1_create_returns_connection_record(api, track_sandbox_id):
    r = api.post(
        "/sandboxes",
        json={
            "templateID": "base",
            "timeout": 300,
            "secure": True,
            "allow_internet_access": True,
            "metadata": {},
            "envVars": {},
        },
    )
    assert r.status_code == 201, r.text
    body = r.json()
    track_sandbox_id(body.get("sandboxID", ""))
    for f in ("templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"):
        assert isinstance(body.get(f), str) and body[f], f"{f} missing in {body}"
    assert body["sandboxID"].isalnum() and body["sandboxID"] == body["sandboxID"].lower()
    major, minor, patch = (int(x) for x in body["envdVersion"].split("-")[0].split("."))
    assert (major, minor, patch) >= (0, 4, 0), body["envdVersion"]

    sid = body["sandboxID"]
    d = api.get(f"/sandboxes/{sid}")
    assert d.status_code == 200, d.text
    detail = d.json()
    for f in LISTED_FIELDS:
        assert f in detail, f"{f} missing in {detail}"
    assert detail["sandboxID"] == sid
    assert detail["state"] == "running"
    assert detail["envdAccessToken"] == body["envdAccessToken"]
    span = (_ts(detail["endAt"]) - _ts(detail["startedAt"])).total_seconds()
    assert 290 <= span <= 310, span

    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    assert_error(api.delete(f"/sandboxes/{sid}"), 404)
    assert_error(api.get(f"/sandboxes/{sid}"), 404)


def test_v2_create_default_timeout_is_300(api, track_sandbox_id):
    r = api.post("/v2/sandboxes", json={"templateID": "base", "metadata": {}, "envVars": {}})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    track_sandbox_id(sid)
    detail = api.get(f"/sandboxes/{sid}").json()
    span = (_ts(detail["endAt"]) - _ts(detail["startedAt"])).total_seconds()
    assert 290 <= span <= 310, f"default timeout gave {span}s"


def test_each_sandbox_gets_its_own_access_token(api, track_sandbox_id):
    tokens = set()
    for _ in range(2):
        r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
        assert r.status_code == 201, r.text
        track_sandbox_id(r.json()["sandboxID"])
        tokens.add(r.json()["envdAccessToken"])
    assert len(tokens) == 2


def _check_listed_item(item, sid, tag):
    for f in LISTED_FIELDS:
        assert f in item, f"{f} missing in listed item {item}"
    assert item["sandboxID"] == sid
    assert item["state"] == "running"
    assert item["cpuCount"] == 2
    assert item["memoryMB"] == 512
    assert isinstance(item["diskSizeMB"], int)
    assert isinstance(item["clientID"], str)
    assert _ts(item["endAt"]) > _ts(item["startedAt"])
    assert item.get("metadata", {}).get("tag") == tag


def test_list_items_have_all_fields_and_metadata_filter(api, track_sandbox_id):
    tag = unique("meta")
    r = api.post(
        "/sandboxes",
        json={"templateID": "base", "timeout": 120, "metadata": {"k": "v w", "tag": tag}, "envVars": {}},
    )
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    track_sandbox_id(sid)

    # exactly what the SDK sends for {"k": "v w"}: metadata=k%3Dv%252520w
    for path in ("/v2/sandboxes", "/sandboxes"):
        raw = api.get(f"{path}?metadata=k%3Dv%252520w%26tag%3D{urllib.parse.quote(tag)}")
        assert raw.status_code == 200, raw.text
        items = raw.json()
        assert [i["sandboxID"] for i in items] == [sid], f"{path}: {items}"
        _check_listed_item(items[0], sid, tag)
        assert items[0]["metadata"] == {"k": "v w", "tag": tag}

        only_k = api.get(f"{path}?metadata=k%3Dv%252520w").json()
        assert sid in [i["sandboxID"] for i in only_k]

        miss = api.get(f"{path}?metadata=k%3Dv%252520x%26tag%3D{urllib.parse.quote(tag)}")
        assert miss.status_code == 200
        assert miss.json() == []

    # the same filter built the SDK's way through a params dict
    metadata = urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v) for k, v in {"tag": tag}.items()})
    r = api.get("/v2/sandboxes", params={"metadata": metadata, "state": "running"})
    assert [i["sandboxID"] for i in r.json()] == [sid]
    r = api.get("/v2/sandboxes", params={"metadata": metadata, "state": "paused"})
    assert r.json() == []
    r = api.get("/v2/sandboxes", params={"metadata": metadata, "state": "running,paused"})
    assert [i["sandboxID"] for i in r.json()] == [sid]

    # the unfiltered lists contain it with every field
    for path in ("/v2/sandboxes", "/sandboxes"):
        items = {i["sandboxID"]: i for i in api.get(path).json()}
        assert sid in items
        _check_listed_item(items[sid], sid, tag)


def test_pagination_with_next_token_header(api, track_sandbox_id):
    tag = unique("page")
    created = set()
    for _ in range(3):
        r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "metadata": {"tag": tag}})
        assert r.status_code == 201, r.text
        created.add(r.json()["sandboxID"])
        track_sandbox_id(r.json()["sandboxID"])
        time.sleep(0.05)

    meta = urllib.parse.urlencode({"tag": tag})
    seen = []
    token = None
    pages = 0
    while True:
        params = {"metadata": meta, "limit": 1}
        if token:
            params["nextToken"] = token
        r = api.get("/v2/sandboxes", params=params)
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page) <= 1
        seen.extend(i["sandboxID"] for i in page)
        pages += 1
        token = r.headers.get("X-Next-Token")
        if not token:
            break
        assert pages < 10, "pagination does not end"
    assert len(seen) == len(set(seen)), seen
    assert set(seen) == created
    assert pages in (3, 4), f"{pages} pages for 3 items at limit=1"


def test_list_order(api, track_sandbox_id):
    tag = unique("order")
    for _ in range(3):
        r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "metadata": {"tag": tag}})
        assert r.status_code == 201, r.text
        track_sandbox_id(r.json()["sandboxID"])
        time.sleep(0.05)
    meta = urllib.parse.urlencode({"tag": tag})
    # default order is newest first
    full = api.get("/v2/sandboxes", params={"metadata": meta}).json()
    assert len(full) == 3
    starts = [_ts(i["startedAt"]) for i in full]
    assert starts == sorted(starts, reverse=True)
    asc = api.get("/v2/sandboxes", params={"metadata": meta, "order": "asc"}).json()
    assert [i["sandboxID"] for i in asc] == [i["sandboxID"] for i in reversed(full)]


def test_templates_list(api):
    r = api.get("/templates")
    assert r.status_code == 200
    base = [t for t in r.json() if "base" in (t.get("aliases") or [])]
    assert len(base) == 1
    t = base[0]
    assert t["buildStatus"] == "ready"
    assert t["cpuCount"] == 2 and t["memoryMB"] == 512
    for f in ("templateID", "buildID", "public", "aliases", "createdAt", "updatedAt", "envdVersion", "spawnCount"):
        assert f in t, f"{f} missing in {t}"
    r = api.get("/templates/aliases/base")
    assert r.status_code == 200
    assert r.json()["templateID"] == t["templateID"]
    assert_error(api.get("/templates/aliases/" + unique("nope")), 404)


def test_create_by_template_id(api, base_template, track_sandbox_id):
    r = api.post("/v2/sandboxes", json={"templateID": base_template["templateID"], "timeout": 60})
    assert r.status_code == 201, r.text
    track_sandbox_id(r.json()["sandboxID"])
    assert r.json()["templateID"] == base_template["templateID"]
