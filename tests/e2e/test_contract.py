"""The API contract against a running server: schemathesis generates requests for every
operation of the server's own /openapi.json and checks that none gets a 5xx, that every status
is documented, and that every body matches its documented schema.

Bounded: EXAMPLES_PER_OPERATION examples per operation and generation mode, about 900
requests in about 15 s on two cores. Everything the generated requests create is deleted at
the end. Generated requests name random templates, so they start no sandboxes; the real
sandboxes the run needs (one per sandbox operation) come from the base template.

Operations that make sandboxes or templates out of a real sandbox (snapshots, forks) get one
checked request with a fixed body there: generated bodies could start 100 forks each.

Excluded operations, and why:
  DELETE /api-keys/{apiKeyID}, DELETE /access-tokens/{accessTokenID}: the run authenticates
    with the suite's own key and token, which must survive it; both are covered in-process by
    crates/api/tests/api/openapi.rs and on the wire by test_keys.py.
"""

from __future__ import annotations

import json
import os

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]

# Per operation and generation mode; SANDBAR_CONTRACT_EXAMPLES raises it for a deeper run.
EXAMPLES_PER_OPERATION = int(os.environ.get("SANDBAR_CONTRACT_EXAMPLES", "8"))

# Where a create's answer names what it made, and how to delete it again.
CLEANUP = {
    "/sandboxes": ("sandboxID", "/sandboxes/{}"),
    "/v2/sandboxes": ("sandboxID", "/sandboxes/{}"),
    "/volumes": ("volumeID", "/volumes/{}"),
    "/api-keys": ("id", "/api-keys/{}"),
    "/access-tokens": ("id", "/access-tokens/{}"),
    "/v3/templates": ("templateID", "/templates/{}"),
    "/v2/templates": ("templateID", "/templates/{}"),
    "/templates": ("templateID", "/templates/{}"),
}

# Fixed bodies for those operations when they are aimed at a real sandbox.
FIXED_BODIES = {
    ("POST", "/sandboxes/{sandboxID}/fork"): {"count": 1, "timeout": 60},
    ("POST", "/sandboxes/{sandboxID}/snapshots"): {},
}

_created: list[str] = []
_statuses: dict[int, int] = {}


def _headers(sandbar) -> dict[str, str]:
    token = json.loads((sandbar.data_dir / "credentials.json").read_text())["accessToken"]
    return {"X-API-Key": sandbar.api_key, "Authorization": f"Bearer {token}"}


EXCLUDED = {
    ("DELETE", "/api-keys/{apiKeyID}"),
    ("DELETE", "/access-tokens/{accessTokenID}"),
}


def _cleanup(sandbar, headers) -> list[str]:
    failed = []
    for path in _created:
        r = httpx.delete(f"{sandbar.url}{path}", headers=headers, timeout=60)
        if r.status_code not in (204, 404):
            failed.append(f"DELETE {path}: {r.status_code} {r.text[:200]}")
    _created.clear()
    return failed


def _record_created(case, response) -> None:
    if case.method.upper() != "POST" or response.status_code not in (201, 202):
        return
    if case.path == "/sandboxes/{sandboxID}/snapshots":
        _created.append("/templates/{}".format(response.json()["snapshotID"].split(":")[0]))
        return
    if case.path == "/sandboxes/{sandboxID}/fork":
        for result in response.json():
            if result.get("sandbox"):
                _created.append("/sandboxes/{}".format(result["sandbox"]["sandboxID"]))
        return
    target = CLEANUP.get(case.path)
    if target is None:
        return
    field, path = target
    try:
        made = response.json().get(field)
    except ValueError:
        return
    if made:
        _created.append(path.format(made))


def _call(sandbar, headers, case, timeout: float):
    """Sends `case`; counts the answer's status and notes what it created, for the cleanup."""
    response = case.call(base_url=sandbar.url, headers=headers, timeout=timeout)
    _statuses[response.status_code] = _statuses.get(response.status_code, 0) + 1
    _record_created(case, response)
    return response


def _conforms(case, response, failures: list, label: str) -> bool:
    """Whether the answer keeps the contract; where it does not, a failure under `label`, with
    the request, goes to `failures`."""
    try:
        case.validate_response(response, checks=CHECKS)
        return True
    except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - all are reported
        failures.append(
            f"{label}: {e}\n  request: {response.request.method} {response.request.url} "
            f"body={(response.request.body or b'')[:300]!r}"
        )
        return False


def _fuzz(sandbar, headers, operation, mode, failures, **fixed) -> None:
    """Up to EXAMPLES_PER_OPERATION generated requests; the first failure is recorded."""
    label = f"{operation.method.upper()} {operation.path} ({mode}{', ' + str(fixed) if fixed else ''})"
    found: list[str] = []

    @given(case=operation.as_strategy(generation_mode=mode, **fixed))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def probe(case):
        if found:
            return
        _conforms(case, _call(sandbar, headers, case, timeout=60), found, label)

    try:
        probe()
    except Unsatisfiable:
        # An operation without parameters or body has no invalid requests to make.
        if mode is GenerationMode.POSITIVE:
            failures.append(f"{label}: no valid request")
    except Exception as e:  # noqa: BLE001 - e.g. a schema schemathesis cannot use
        failures.append(f"{label}: {e!r}")
    failures.extend(found)


def _new_sandbox(sandbar, headers, schema, failures) -> str | None:
    """A real sandbox, made through a checked request."""
    case = schema["/v2/sandboxes"]["POST"].Case(body={"templateID": "base", "timeout": 120})
    response = _call(sandbar, headers, case, timeout=120)
    if not _conforms(case, response, failures, "POST /v2/sandboxes (base)"):
        return None
    assert response.status_code == 201, response.text
    return response.json()["sandboxID"]


def _call_checked(sandbar, headers, operation, path_parameters, body, failures) -> None:
    case = operation.Case(path_parameters=path_parameters, body=body)
    response = _call(sandbar, headers, case, timeout=120)
    _conforms(case, response, failures, f"{operation.method.upper()} {operation.path} ({body})")


def test_every_operation_keeps_the_contract(sandbar):
    """Every operation with generated valid and invalid requests; then the operations on one
    sandbox, template or build with generated requests aimed at real ones. All failures are
    reported at once."""
    reply = httpx.get(f"{sandbar.url}/openapi.json", timeout=30)
    assert reply.status_code == 200, reply.text
    schema = schemathesis.openapi.from_dict(reply.json())
    headers = _headers(sandbar)
    failures: list[str] = []
    operations = []
    try:
        for result in schema.get_all_operations():
            operation = result.ok()
            if (operation.method.upper(), operation.path) in EXCLUDED:
                continue
            operations.append(operation)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _fuzz(sandbar, headers, operation, mode, failures)

        base = httpx.get(f"{sandbar.url}/templates/base", headers=headers, timeout=30).json()
        base_build = base["builds"][0]["buildID"]
        for operation in operations:
            path, method = operation.path, operation.method.upper()
            if "{sandboxID}" in path:
                # A sandbox of its own per operation, since kill, pause and timeouts end it.
                sandbox_id = _new_sandbox(sandbar, headers, schema, failures)
                if sandbox_id is None:
                    continue
                fixed = {"sandboxID": sandbox_id}
            elif path.startswith("/templates/{templateID}") and method == "GET":
                fixed = {"templateID": "base"}
                if "{buildID}" in path:
                    fixed["buildID"] = base_build
            else:
                continue
            body = FIXED_BODIES.get((method, path))
            if body is not None:
                _call_checked(sandbar, headers, operation, fixed, body, failures)
                continue
            _fuzz(sandbar, headers, operation, GenerationMode.POSITIVE, failures, path_parameters=fixed)
    finally:
        cleanup_failures = _cleanup(sandbar, headers)
    print(f"[contract] {len(operations)} operations, responses by status: {dict(sorted(_statuses.items()))}")
    assert len(operations) >= 40, f"only {len(operations)} operations in the document"
    assert not failures, f"{len(failures)} contract failures:\n" + "\n\n".join(failures)
    assert not cleanup_failures, cleanup_failures
