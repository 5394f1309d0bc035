//! The API contract: `/openapi.json` describes every endpoint of E2B's API that Sandbar serves,
//! every operation it describes is routed, and real answers match their documented schemas.
//! In-process with a real SQLite store, host volume storage on a temporary directory and a
//! runtime double that only records launches.

use crate::common;

use std::collections::BTreeSet;

use axum::http::StatusCode;
use sandbar_core::volumes::DEFAULT_CONTENT_REQUESTS_PER_MINUTE;
use serde_json::{Map, Value, json};

use common::{Cred, Reply, Server, Setup};

/// The endpoints of E2B's API reference (method, path) that the document must describe.
const SEED_ENDPOINTS: &[(&str, &str)] = &[
    ("GET", "/api-keys"),
    ("POST", "/api-keys"),
    ("PATCH", "/api-keys/{apiKeyID}"),
    ("DELETE", "/api-keys/{apiKeyID}"),
    ("POST", "/access-tokens"),
    ("DELETE", "/access-tokens/{accessTokenID}"),
    ("GET", "/teams"),
    ("GET", "/teams/{teamID}/metrics"),
    ("GET", "/teams/{teamID}/metrics/max"),
    ("POST", "/v3/templates"),
    ("POST", "/v2/templates"),
    ("GET", "/templates/{templateID}/files/{hash}"),
    ("GET", "/templates"),
    ("POST", "/templates"),
    ("GET", "/templates/{templateID}"),
    ("POST", "/templates/{templateID}"),
    ("PATCH", "/templates/{templateID}"),
    ("DELETE", "/templates/{templateID}"),
    ("POST", "/templates/{templateID}/builds/{buildID}"),
    ("POST", "/v2/templates/{templateID}/builds/{buildID}"),
    ("PATCH", "/v2/templates/{templateID}"),
    ("GET", "/templates/{templateID}/builds/{buildID}/status"),
    ("GET", "/templates/{templateID}/builds/{buildID}/logs"),
    ("GET", "/templates/aliases/{alias}"),
    ("POST", "/templates/tags"),
    ("DELETE", "/templates/tags"),
    ("GET", "/sandboxes"),
    ("POST", "/sandboxes"),
    ("GET", "/v2/sandboxes"),
    ("GET", "/sandboxes/metrics"),
    ("GET", "/sandboxes/{sandboxID}/logs"),
    ("GET", "/v2/sandboxes/{sandboxID}/logs"),
    ("GET", "/sandboxes/{sandboxID}"),
    ("DELETE", "/sandboxes/{sandboxID}"),
    ("GET", "/sandboxes/{sandboxID}/metrics"),
    ("POST", "/sandboxes/{sandboxID}/pause"),
    ("POST", "/sandboxes/{sandboxID}/resume"),
    ("POST", "/sandboxes/{sandboxID}/connect"),
    ("POST", "/sandboxes/{sandboxID}/timeout"),
    ("POST", "/sandboxes/{sandboxID}/refreshes"),
    ("GET", "/volumes"),
    ("POST", "/volumes"),
    ("GET", "/volumes/{volumeID}"),
    ("DELETE", "/volumes/{volumeID}"),
];

const METHODS: &[&str] = &["get", "put", "post", "delete", "patch", "head", "options"];

fn document() -> Value {
    serde_json::to_value(sandbar_api::openapi()).expect("document as JSON")
}

/// Every (METHOD, path) the document describes.
fn operations(doc: &Value) -> Vec<(String, String)> {
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in METHODS {
            if item.get(*method).is_some() {
                ops.push((method.to_ascii_uppercase(), path.clone()));
            }
        }
    }
    ops
}

#[test]
fn every_endpoint_of_the_reference_is_documented() {
    let doc = document();
    assert!(
        doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")),
        "{}",
        doc["openapi"]
    );
    let documented: BTreeSet<(String, String)> = operations(&doc).into_iter().collect();
    let missing: Vec<_> = SEED_ENDPOINTS
        .iter()
        .filter(|(m, p)| !documented.contains(&(m.to_string(), p.to_string())))
        .collect();
    assert!(missing.is_empty(), "not in /openapi.json: {missing:?}");
}

#[test]
fn every_operation_declares_its_security_and_error_body() {
    let doc = document();
    if std::env::var_os("DUMP_OPENAPI").is_some() {
        println!("{}", serde_json::to_string_pretty(&doc).expect("json"));
    }
    let schemes = doc["components"]["securitySchemes"]
        .as_object()
        .expect("security schemes");
    for name in [
        "ApiKeyAuth",
        "AccessTokenAuth",
        "AuthProviderBearerAuth",
        "AuthProviderTeamAuth",
    ] {
        assert!(schemes.contains_key(name), "no security scheme {name}");
    }
    for (method, path) in operations(&doc) {
        let op = &doc["paths"][&path][method.to_ascii_lowercase()];
        let security = op["security"]
            .as_array()
            .unwrap_or_else(|| panic!("{method} {path}: no security"));
        for requirement in security {
            for scheme in requirement.as_object().expect("requirement").keys() {
                assert!(schemes.contains_key(scheme), "{method} {path}: {scheme}");
            }
        }
        let public = security
            .iter()
            .any(|r| r.as_object().is_some_and(Map::is_empty));
        let responses = op["responses"].as_object().expect("responses");
        if !public {
            for status in ["401", "429", "500"] {
                assert!(
                    responses.contains_key(status),
                    "{method} {path}: {status} not documented"
                );
            }
        }
        for (status, response) in responses {
            if status.starts_with('4') || status.starts_with('5') {
                assert_eq!(
                    response["content"]["application/json"]["schema"]["$ref"],
                    "#/components/schemas/Error",
                    "{method} {path} {status}"
                );
            }
        }
    }
}

struct Harness {
    server: Server,
    doc: Value,
}

async fn harness() -> Harness {
    let server = common::serve(Setup {
        volumes: Some(DEFAULT_CONTENT_REQUESTS_PER_MINUTE),
        ..Setup::default()
    })
    .await;
    Harness {
        server,
        doc: document(),
    }
}

impl Harness {
    async fn call(&self, method: &str, uri: &str, cred: Cred<'_>, body: Option<Value>) -> Reply {
        let request = common::request(method, uri, cred, body.map(|b| b.to_string()));
        self.server.send(request).await
    }

    /// Calls `uri` (an instance of the documented `template`) and checks the answer against
    /// the document: its status is documented, and its body matches that status's schema.
    async fn checked(
        &self,
        method: &str,
        template: &str,
        uri: &str,
        cred: Cred<'_>,
        body: Option<Value>,
    ) -> Reply {
        let reply = self.call(method, uri, cred, body).await;
        conforms(&self.doc, method, template, &reply);
        reply
    }

    /// [`Self::checked`], and the answer's status must be `status`.
    async fn expect(
        &self,
        status: u16,
        method: &str,
        template: &str,
        uri: &str,
        cred: Cred<'_>,
        body: Option<Value>,
    ) -> Reply {
        let reply = self.checked(method, template, uri, cred, body).await;
        assert_eq!(
            reply.status.as_u16(),
            status,
            "{method} {uri}: {:?}",
            reply.body
        );
        reply
    }

    fn key(&self) -> Cred<'_> {
        Cred::Key(&self.server.credentials.api_key)
    }

    fn bearer(&self) -> Cred<'_> {
        Cred::Bearer(&self.server.credentials.access_token)
    }
}

/// Resolves a local `$ref` against the document.
fn resolve<'a>(doc: &'a Value, schema: &'a Value) -> &'a Value {
    match schema.get("$ref").and_then(Value::as_str) {
        Some(reference) => {
            let pointer = reference.strip_prefix('#').expect("local $ref");
            resolve(
                doc,
                doc.pointer(pointer)
                    .unwrap_or_else(|| panic!("dangling {reference}")),
            )
        }
        None => schema,
    }
}

/// Fails when `value` carries a field its schema does not declare (schemas leave
/// `additionalProperties` open, so a misspelt serde rename would otherwise pass).
fn no_undeclared_fields(doc: &Value, schema: &Value, value: &Value, at: &str) {
    let schema = resolve(doc, schema);
    if value.is_null() {
        return;
    }
    for key in ["oneOf", "anyOf"] {
        if let Some(variants) = schema.get(key).and_then(Value::as_array) {
            // Nullable references are `oneOf: [{type: null}, {$ref}]`.
            let fitting: Vec<&Value> = variants
                .iter()
                .filter(|v| resolve(doc, v).get("type") != Some(&json!("null")))
                .collect();
            if fitting.len() == 1 {
                no_undeclared_fields(doc, fitting[0], value, at);
            }
            return;
        }
    }
    let mut properties = Map::new();
    let mut parts = vec![schema];
    if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
        parts.extend(all.iter().map(|p| resolve(doc, p)));
    }
    for part in &parts {
        if let Some(p) = part.get("properties").and_then(Value::as_object) {
            properties.extend(p.clone());
        }
    }
    let free_form = properties.is_empty()
        && !parts
            .iter()
            .any(|p| p.get("additionalProperties").is_some());
    match value {
        Value::Object(_) if free_form => {}
        Value::Object(fields) => {
            let additional = parts
                .iter()
                .find_map(|p| p.get("additionalProperties").filter(|a| a.is_object()));
            for (name, field) in fields {
                let at = format!("{at}.{name}");
                match (properties.get(name), additional) {
                    (Some(s), _) | (None, Some(s)) => no_undeclared_fields(doc, s, field, &at),
                    (None, None) => panic!("{at} is not in the schema {schema}"),
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    no_undeclared_fields(doc, item_schema, item, &format!("{at}[{i}]"));
                }
            }
        }
        _ => {}
    }
}

fn conforms(doc: &Value, method: &str, template: &str, reply: &Reply) {
    let what = format!("{method} {template} -> {}", reply.status.as_u16());
    let op = &doc["paths"][template][method.to_ascii_lowercase()];
    assert!(op.is_object(), "{method} {template} is not documented");
    let response = op["responses"]
        .get(reply.status.as_str())
        .unwrap_or_else(|| panic!("{what}: status not documented; body {:?}", reply.body));
    let Some(schema) = response.pointer("/content/application~1json/schema") else {
        assert!(
            reply.raw.is_empty(),
            "{what}: documented without a body, got {:?}",
            String::from_utf8_lossy(&reply.raw)
        );
        return;
    };
    assert!(!reply.raw.is_empty(), "{what}: documented body missing");
    let mut root = schema.as_object().cloned().unwrap_or_default();
    root.insert("components".into(), doc["components"].clone());
    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .build(&Value::Object(root))
        .unwrap_or_else(|e| panic!("{what}: schema does not compile: {e}"));
    let errors: Vec<String> = validator
        .iter_errors(&reply.body)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{what}: {errors:#?}\nbody: {}",
        reply.body
    );
    no_undeclared_fields(doc, schema, &reply.body, "body");
}

/// A path of the document with its parameters filled in.
fn instance(path: &str) -> String {
    let mut out = String::new();
    let mut rest = path;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let close = rest[open..].find('}').expect("closing brace") + open;
        out.push_str("contract-probe");
        rest = &rest[close + 1..];
    }
    out.push_str(rest);
    out
}

#[tokio::test]
async fn the_served_document_is_the_generated_one() {
    let h = harness().await;
    let reply = h.call("GET", "/openapi.json", Cred::None, None).await;
    assert_eq!(reply.status, StatusCode::OK);
    assert_eq!(reply.body, h.doc);
}

#[tokio::test]
async fn every_documented_operation_is_routed() {
    let h = harness().await;
    for (method, path) in operations(&h.doc) {
        let uri = instance(&path);
        let reply = h.call(&method, &uri, Cred::None, None).await;
        assert_ne!(
            reply.status,
            StatusCode::METHOD_NOT_ALLOWED,
            "{method} {path}: not routed ({:?})",
            reply.body
        );
        // The router's fallback names the endpoint; a handler's 404 names the resource.
        let fallback = reply.status == StatusCode::NOT_FOUND
            && reply.body["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("no such endpoint"));
        assert!(!fallback, "{method} {path}: not routed ({:?})", reply.body);
        conforms(&h.doc, &method, &path, &reply);
    }
    // The fallback itself is recognised by the check above.
    let reply = h.call("GET", "/no/such/route", Cred::None, None).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    assert!(
        reply.body["message"]
            .as_str()
            .expect("message")
            .starts_with("no such endpoint")
    );
}

#[tokio::test]
async fn sandbox_answers_match_their_schemas() {
    let h = harness().await;
    let k = h.key();
    h.checked("GET", "/health", "/health", Cred::None, None)
        .await;
    let created = h
        .expect(
            201,
            "POST",
            "/sandboxes",
            "/sandboxes",
            k,
            Some(json!({"templateID": "base", "timeout": 60, "metadata": {"a": "b"}})),
        )
        .await;
    let id = created.body["sandboxID"].as_str().expect("id").to_owned();
    let v2 = h
        .expect(
            201,
            "POST",
            "/v2/sandboxes",
            "/v2/sandboxes",
            k,
            Some(
                json!({"templateID": "base", "autoPause": true, "autoResume": {"enabled": true},
                "network": {"denyOut": ["0.0.0.0/0"], "allowOut": ["1.1.1.1"]}}),
            ),
        )
        .await;
    let v2_id = v2.body["sandboxID"].as_str().expect("id").to_owned();

    let one = "/sandboxes/{sandboxID}";
    for (template, uri, status) in [
        ("/sandboxes", "/sandboxes?metadata=a%3Db".to_owned(), 200),
        (
            "/v2/sandboxes",
            "/v2/sandboxes?state=running,paused&limit=1".to_owned(),
            200,
        ),
        ("/v2/sandboxes", "/v2/sandboxes?limit=0".to_owned(), 400),
        (one, format!("/sandboxes/{id}"), 200),
        (one, format!("/sandboxes/{v2_id}"), 200),
        (one, "/sandboxes/nonexistent".to_owned(), 404),
        (
            "/sandboxes/{sandboxID}/metrics",
            format!("/sandboxes/{id}/metrics?start=0"),
            200,
        ),
        (
            "/sandboxes/{sandboxID}/metrics",
            format!("/sandboxes/{id}/metrics?start=9&end=1"),
            400,
        ),
        (
            "/sandboxes/metrics",
            format!("/sandboxes/metrics?sandbox_ids={id},{v2_id}"),
            200,
        ),
        ("/sandboxes/metrics", "/sandboxes/metrics".to_owned(), 400),
        (
            "/sandboxes/{sandboxID}/logs",
            format!("/sandboxes/{id}/logs?limit=10"),
            200,
        ),
        (
            "/v2/sandboxes/{sandboxID}/logs",
            format!("/v2/sandboxes/{id}/logs?direction=backward"),
            200,
        ),
        (
            "/v2/sandboxes/{sandboxID}/logs",
            format!("/v2/sandboxes/{id}/logs?direction=up"),
            400,
        ),
    ] {
        h.expect(status, "GET", template, &uri, k, None).await;
    }
    h.expect(
        401,
        "GET",
        "/v2/sandboxes",
        "/v2/sandboxes",
        Cred::None,
        None,
    )
    .await;

    for (method, template, body, status) in [
        (
            "POST",
            "/sandboxes/{sandboxID}/timeout",
            Some(json!({"timeout": 120})),
            204,
        ),
        (
            "POST",
            "/sandboxes/{sandboxID}/timeout",
            Some(json!({"timeout": -1})),
            400,
        ),
        (
            "POST",
            "/sandboxes/{sandboxID}/refreshes",
            Some(json!({"duration": 30})),
            204,
        ),
        (
            "POST",
            "/sandboxes/{sandboxID}/connect",
            Some(json!({"timeout": 60})),
            200,
        ),
        // The runtime double enforces no egress rules, so only the refusals are probed.
        (
            "PUT",
            "/sandboxes/{sandboxID}/network",
            Some(json!({"egressProxy": {}})),
            400,
        ),
        ("POST", "/sandboxes/{sandboxID}/resume", None, 409),
        ("POST", "/sandboxes/{sandboxID}/pause", None, 204),
        ("POST", "/sandboxes/{sandboxID}/pause", None, 409),
        (
            "POST",
            "/v2/sandboxes/{sandboxID}/connect",
            Some(json!({"timeout": 60})),
            201,
        ),
        ("POST", "/sandboxes/{sandboxID}/pause", None, 204),
        (
            "POST",
            "/sandboxes/{sandboxID}/resume",
            Some(json!({"timeout": 60})),
            201,
        ),
        ("DELETE", "/sandboxes/{sandboxID}", None, 204),
        ("DELETE", "/sandboxes/{sandboxID}", None, 404),
    ] {
        let uri = template.replace("{sandboxID}", &id);
        h.expect(status, method, template, &uri, k, body).await;
    }
    h.expect(204, "DELETE", one, &format!("/sandboxes/{v2_id}"), k, None)
        .await;
}

#[tokio::test]
async fn template_answers_match_their_schemas() {
    let h = harness().await;
    let k = h.key();
    let t = "/templates/{templateID}";
    let alias = "/templates/aliases/{alias}";
    for (template, uri, status) in [
        ("/templates", "/templates", 200),
        (t, "/templates/base?limit=1", 200),
        (t, "/templates/nonexistent", 404),
        (alias, "/templates/aliases/base", 200),
        (alias, "/templates/aliases/nope", 404),
    ] {
        h.expect(status, "GET", template, uri, k, None).await;
    }

    let v3 = "/v3/templates";
    h.expect(
        400,
        "POST",
        v3,
        v3,
        k,
        Some(json!({"name": "x", "bogus": 1})),
    )
    .await;
    let requested = h
        .checked(
            "POST",
            v3,
            v3,
            k,
            Some(json!({"name": "contract", "tags": ["v1"]})),
        )
        .await;
    let (template_id, build_id) = common::requested_build(requested.status, &requested.body);
    h.expect(
        202,
        "POST",
        "/v2/templates",
        "/v2/templates",
        k,
        Some(json!({"alias": "contract-two"})),
    )
    .await;

    let hash = "0".repeat(64);
    h.expect(
        201,
        "GET",
        "/templates/{templateID}/files/{hash}",
        &format!("/templates/{template_id}/files/{hash}"),
        k,
        None,
    )
    .await;
    h.expect(
        403,
        "PUT",
        "/upload/templates/{templateID}/files/{hash}",
        &format!("/upload/templates/{template_id}/files/{hash}?token=forged"),
        Cred::None,
        None,
    )
    .await;

    let start = "/v2/templates/{templateID}/builds/{buildID}";
    let uri = format!("/v2/templates/{template_id}/builds/{build_id}");
    h.expect(400, "POST", start, &uri, k, Some(json!({}))).await;
    h.expect(
        202,
        "POST",
        start,
        &uri,
        k,
        Some(json!({"fromImage": "busybox:1", "steps": [{"type": "RUN", "args": ["true"]}]})),
    )
    .await;
    // The test builder refuses the build: wait for the failure, whose status has a reason.
    let status_t = "/templates/{templateID}/builds/{buildID}/status";
    let status_uri = format!("/templates/{template_id}/builds/{build_id}/status?level=info");
    let mut last = Value::Null;
    for _ in 0..100 {
        last = h
            .expect(200, "GET", status_t, &status_uri, k, None)
            .await
            .body;
        if last["status"] == "error" {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(last["status"], "error", "{last}");
    assert!(last["reason"]["message"].is_string(), "{last}");
    let logs_t = "/templates/{templateID}/builds/{buildID}/logs";
    h.expect(
        200,
        "GET",
        logs_t,
        &format!("/templates/{template_id}/builds/{build_id}/logs?direction=backward&limit=5"),
        h.bearer(),
        None,
    )
    .await;
    h.expect(
        404,
        "GET",
        logs_t,
        &format!("/templates/{template_id}/builds/nope/logs"),
        k,
        None,
    )
    .await;

    let with_builds = h
        .expect(200, "GET", t, &format!("/templates/{template_id}"), k, None)
        .await;
    assert_eq!(with_builds.body["builds"].as_array().map(Vec::len), Some(1));
    h.expect(
        200,
        "GET",
        "/templates/{templateID}/tags",
        &format!("/templates/{template_id}/tags"),
        k,
        None,
    )
    .await;
    let tags = "/templates/tags";
    for (method, body, success) in [
        (
            "POST",
            json!({"target": "contract", "tags": ["v2"]}),
            StatusCode::CREATED,
        ),
        (
            "DELETE",
            json!({"name": "contract", "tags": ["nope"]}),
            StatusCode::NO_CONTENT,
        ),
    ] {
        let reply = h.checked(method, tags, tags, k, Some(body)).await;
        assert!(
            reply.status.is_client_error() || reply.status == success,
            "{method} {tags}: {:?}",
            reply.body
        );
    }
    for v in [t, "/v2/templates/{templateID}"] {
        let uri = v.replace("{templateID}", &template_id);
        h.expect(200, "PATCH", v, &uri, k, Some(json!({"public": false})))
            .await;
    }
    h.expect(403, "DELETE", t, "/templates/base", k, None).await;

    let dockerfile = h
        .expect(
            202,
            "POST",
            "/templates",
            "/templates",
            h.bearer(),
            Some(json!({"dockerfile": "FROM busybox:1\nRUN true", "alias": "from-dockerfile"})),
        )
        .await;
    let docker_id = dockerfile.body["templateID"]
        .as_str()
        .expect("id")
        .to_owned();
    let docker_build = dockerfile.body["buildID"]
        .as_str()
        .expect("build")
        .to_owned();
    h.expect(
        202,
        "POST",
        t,
        &format!("/templates/{docker_id}"),
        h.bearer(),
        Some(json!({"dockerfile": "FROM busybox:1"})),
    )
    .await;
    let go = h
        .checked(
            "POST",
            "/templates/{templateID}/builds/{buildID}",
            &format!("/templates/{docker_id}/builds/{docker_build}"),
            h.bearer(),
            None,
        )
        .await;
    assert!(go.status == StatusCode::ACCEPTED || go.status.is_client_error());

    for id in [template_id, docker_id] {
        h.expect(204, "DELETE", t, &format!("/templates/{id}"), k, None)
            .await;
    }
}

#[tokio::test]
async fn key_token_team_and_volume_answers_match_their_schemas() {
    let h = harness().await;
    let b = h.bearer();
    let keys = "/api-keys";
    h.expect(200, "GET", keys, keys, b, None).await;
    let made = h
        .expect(
            201,
            "POST",
            keys,
            keys,
            b,
            Some(json!({"name": "contract"})),
        )
        .await;
    let key_id = made.body["id"].as_str().expect("id").to_owned();
    let one = "/api-keys/{apiKeyID}";
    let key_uri = format!("/api-keys/{key_id}");
    h.expect(
        200,
        "PATCH",
        one,
        &key_uri,
        b,
        Some(json!({"name": "renamed"})),
    )
    .await;
    let listed = h.checked("GET", keys, keys, b, None).await;
    assert!(listed.body.as_array().expect("keys").len() >= 2);
    h.expect(204, "DELETE", one, &key_uri, b, None).await;
    h.expect(404, "DELETE", one, &key_uri, b, None).await;
    h.expect(401, "GET", keys, keys, h.key(), None).await;

    let token = h
        .expect(
            201,
            "POST",
            "/access-tokens",
            "/access-tokens",
            b,
            Some(json!({"name": "contract"})),
        )
        .await;
    let token_id = token.body["id"].as_str().expect("id");
    h.expect(
        204,
        "DELETE",
        "/access-tokens/{accessTokenID}",
        &format!("/access-tokens/{token_id}"),
        b,
        None,
    )
    .await;
    h.expect(200, "GET", "/teams", "/teams", b, None).await;

    let k = h.key();
    let team = &h.server.credentials.team_id;
    for (template, uri, status) in [
        (
            "/teams/{teamID}/metrics",
            format!("/teams/{team}/metrics?start=0"),
            200,
        ),
        (
            "/teams/{teamID}/metrics",
            "/teams/someone-else/metrics".to_owned(),
            403,
        ),
        (
            "/teams/{teamID}/metrics/max",
            format!("/teams/{team}/metrics/max?metric=concurrent_sandboxes"),
            200,
        ),
        (
            "/teams/{teamID}/metrics/max",
            format!("/teams/{team}/metrics/max?metric=nope"),
            400,
        ),
        ("/volumes", "/volumes".to_owned(), 200),
        (
            "/volumes/{volumeID}",
            "/volumes/nonexistent".to_owned(),
            404,
        ),
    ] {
        h.expect(status, "GET", template, &uri, k, None).await;
    }
    let volumes = "/volumes";
    let new_volume = |name: &str| Some(json!({ "name": name }));
    h.expect(400, "POST", volumes, volumes, k, new_volume("no spaces"))
        .await;
    let volume = h
        .expect(201, "POST", volumes, volumes, k, new_volume("contract"))
        .await;
    h.expect(409, "POST", volumes, volumes, k, new_volume("contract"))
        .await;
    let id = volume.body["volumeID"].as_str().expect("id");
    let v = "/volumes/{volumeID}";
    h.expect(200, "GET", volumes, volumes, k, None).await;
    h.expect(200, "GET", v, &format!("/volumes/{id}"), k, None)
        .await;
    h.expect(204, "DELETE", v, &format!("/volumes/{id}"), k, None)
        .await;
}
