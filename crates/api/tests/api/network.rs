//! Network settings over REST, in-process: validation of `network` on create and of
//! `PUT /sandboxes/{id}/network`, what reaches the runtime, and the edge's traffic token and
//! host mask on user ports (served by a plain HTTP server on 127.0.0.1).

use crate::common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use common::{KEY, Reply, Server, Setup};

struct Harness {
    server: Server,
}

async fn harness() -> Harness {
    let server = common::serve(Setup {
        key: Some(KEY),
        ..Setup::default()
    })
    .await;
    Harness { server }
}

impl Harness {
    async fn api(&self, method: &str, path: &str, body: Option<&str>) -> Reply {
        self.server
            .send(common::json_request(method, path, Some(KEY), body))
            .await
    }

    async fn create(&self, network: Value) -> Value {
        let body = json!({"templateID": "base", "network": network}).to_string();
        let reply = self.api("POST", "/v2/sandboxes", Some(&body)).await;
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        reply.body
    }

    fn launched(&self) -> usize {
        self.server.runtime.launches()
    }
}

fn assert_refused(reply: &Reply, status: StatusCode, mentions: &str) {
    let message = common::error_message(reply.status, &reply.body, status).unwrap_or_default();
    assert!(
        message.contains(mentions),
        "message '{message}' should mention '{mentions}'"
    );
}

#[tokio::test]
async fn egress_rules_reach_the_runtime_and_read_back() {
    let h = harness().await;
    let created = h
        .create(json!({
            "allowOut": ["8.8.8.8", "10.1.0.0/16", "*.example.com"],
            "denyOut": ["0.0.0.0/0"]
        }))
        .await;
    assert!(created["trafficAccessToken"].is_null());
    let id = created["sandboxID"].as_str().expect("id").to_owned();
    {
        let launched = h.server.runtime.launched.lock().expect("lock");
        let spec = launched.last().expect("launched");
        assert!(spec.allow_internet_access);
        assert_eq!(spec.egress.allow_nets.len(), 2);
        assert_eq!(spec.egress.allow_domains.len(), 1);
        assert!(spec.egress.closes_all());
    }
    let detail = h.api("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(detail.status, StatusCode::OK);
    assert_eq!(
        detail.body["network"]["allowOut"],
        json!(["8.8.8.8", "10.1.0.0/16", "*.example.com"])
    );
    assert_eq!(detail.body["network"]["denyOut"], json!(["0.0.0.0/0"]));
    assert_eq!(detail.body["network"]["allowPublicTraffic"], json!(true));

    // A sandbox without network settings has no rules and shows none.
    let plain = h.create(json!({})).await;
    let launched = h.server.runtime.launches();
    assert_eq!(launched, 2);
    let detail = h
        .api(
            "GET",
            &format!("/sandboxes/{}", plain["sandboxID"].as_str().expect("id")),
            None,
        )
        .await;
    assert!(detail.body.get("network").is_none());
}

#[tokio::test]
async fn no_internet_access_without_allowed_destinations_isolates() {
    let h = harness().await;
    let body = json!({"templateID": "base", "allow_internet_access": false}).to_string();
    let reply = h.api("POST", "/v2/sandboxes", Some(&body)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let body = json!({
        "templateID": "base",
        "allow_internet_access": false,
        "network": {"allowOut": ["1.1.1.1"]}
    })
    .to_string();
    let reply = h.api("POST", "/v2/sandboxes", Some(&body)).await;
    assert_eq!(reply.status, StatusCode::CREATED);
    let launched = h.server.runtime.launched.lock().expect("lock");
    assert!(!launched[0].allow_internet_access);
    assert!(launched[0].egress.is_isolated());
    // allow_internet_access: false is denyOut 0.0.0.0/0, which allowOut still overrides.
    assert!(launched[1].allow_internet_access);
    assert!(launched[1].egress.closes_all());
}

#[tokio::test]
async fn bad_network_settings_are_refused_by_name() {
    let h = harness().await;
    let cases = [
        (
            json!({"denyOut": ["example.com"]}),
            "network.denyOut[0] 'example.com'",
        ),
        (
            json!({"allowOut": ["8.8.8.8", "10.0.0.0/33"]}),
            "network.allowOut[1] '10.0.0.0/33'",
        ),
        (json!({"allowOut": ["::1"]}), "IPv6"),
        (json!({"allowOut": ["bad host!"]}), "'bad host!'"),
        (
            json!({"dnsServers": ["dns.example"]}),
            "network.dnsServers[0]",
        ),
        (json!({"maskRequestHost": "a b"}), "network.maskRequestHost"),
        (
            json!({"egressProxy": {"address": "p:1080"}}),
            "network.egressProxy",
        ),
        (
            json!({"rules": {"api.example.com": [{"transform": {"headers": {"a": "b"}}}]}}),
            "network.rules",
        ),
        (json!({"httpsPorts": [3000]}), "network.httpsPorts"),
        (json!({"allowOut": "8.8.8.8"}), ""),
    ];
    for (network, mentions) in cases {
        let body = json!({"templateID": "base", "network": network}).to_string();
        let reply = h.api("POST", "/v2/sandboxes", Some(&body)).await;
        assert_refused(&reply, StatusCode::BAD_REQUEST, mentions);
    }
    let many: Vec<String> = (0..101).map(|i| format!("10.0.0.{i}")).collect();
    let body = json!({"templateID": "base", "network": {"allowOut": many}}).to_string();
    assert_refused(
        &h.api("POST", "/v2/sandboxes", Some(&body)).await,
        StatusCode::BAD_REQUEST,
        "at most 100",
    );
    assert_eq!(h.launched(), 0);
}

#[tokio::test]
async fn network_update_replaces_rules() {
    let h = harness().await;
    let id = h.create(json!({"denyOut": ["1.2.3.4"]})).await["sandboxID"]
        .as_str()
        .expect("id")
        .to_owned();
    let path = format!("/sandboxes/{id}/network");

    let reply = h
        .api(
            "PUT",
            &path,
            Some(r#"{"allowOut":["example.com"],"denyOut":["0.0.0.0/0"]}"#),
        )
        .await;
    assert_eq!(reply.status, StatusCode::NO_CONTENT, "{:?}", reply.body);
    {
        let updates = h.server.runtime.network_updates.lock().expect("lock");
        let (updated, rules) = updates.last().expect("update");
        assert_eq!(updated, &id);
        assert!(rules.allows_domain("example.com"));
        assert!(rules.closes_all());
    }
    let detail = h.api("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(detail.body["network"]["allowOut"], json!(["example.com"]));
    assert_eq!(detail.body["network"]["denyOut"], json!(["0.0.0.0/0"]));

    // Omitted fields clear; allow_internet_access: false closes everything.
    let reply = h
        .api("PUT", &path, Some(r#"{"allow_internet_access":false}"#))
        .await;
    assert_eq!(reply.status, StatusCode::NO_CONTENT);
    {
        let updates = h.server.runtime.network_updates.lock().expect("lock");
        assert!(updates.last().expect("update").1.is_isolated());
    }
    let detail = h.api("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(detail.body["allowInternetAccess"], json!(false));
    assert!(detail.body.get("network").is_none());

    assert_refused(
        &h.api("PUT", &path, Some(r#"{"denyOut":["example.com"]}"#))
            .await,
        StatusCode::BAD_REQUEST,
        "network.denyOut[0]",
    );
    assert_refused(
        &h.api("PUT", &path, Some(r#"{"allowOut":"x"}"#)).await,
        StatusCode::BAD_REQUEST,
        "",
    );
    assert_refused(
        &h.api(
            "PUT",
            "/sandboxes/iaaaaaaaaaaaaaaaaaaaa/network",
            Some(r#"{"allowOut":[]}"#),
        )
        .await,
        StatusCode::NOT_FOUND,
        "iaaaaaaaaaaaaaaaaaaaa",
    );
    assert_eq!(
        h.server.runtime.network_updates.lock().expect("lock").len(),
        2
    );
}

/// A one-shot HTTP server on 127.0.0.1 that answers each request with the Host header and
/// whether a traffic token reached it.
async fn host_echo_server() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let mut len = 0;
                while !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf[len..]).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => len += n,
                    }
                }
                let head = String::from_utf8_lossy(&buf[..len]).to_ascii_lowercase();
                let host = head
                    .lines()
                    .find_map(|l| l.strip_prefix("host: "))
                    .unwrap_or("")
                    .trim()
                    .to_owned();
                let token = head.contains("e2b-traffic-access-token");
                let body = json!({"host": host, "token": token}).to_string();
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    port
}

fn user_port_request(id: &str, port: u16, token: Option<&str>) -> Request<Body> {
    let mut request = Request::builder()
        .method("GET")
        .uri("/")
        .header("host", format!("{port}-{id}.sandbar.localhost"));
    if let Some(token) = token {
        request = request.header("e2b-traffic-access-token", token);
    }
    request.body(Body::empty()).expect("request")
}

#[tokio::test]
async fn private_user_ports_need_the_traffic_token() {
    let h = harness().await;
    let port = host_echo_server().await;
    let created = h
        .create(json!({
            "allowPublicTraffic": false,
            "maskRequestHost": "${PORT}-masked.example.com"
        }))
        .await;
    let id = created["sandboxID"].as_str().expect("id");
    let token = created["trafficAccessToken"].as_str().expect("token");
    assert!(!token.is_empty());

    assert_refused(
        &h.server.send(user_port_request(id, port, None)).await,
        StatusCode::FORBIDDEN,
        "e2b-traffic-access-token",
    );
    assert_refused(
        &h.server
            .send(user_port_request(id, port, Some("wrong")))
            .await,
        StatusCode::FORBIDDEN,
        id,
    );
    let served = h
        .server
        .send(user_port_request(id, port, Some(token)))
        .await;
    assert_eq!(served.status, StatusCode::OK, "{:?}", served.body);
    assert_eq!(
        served.body["host"],
        json!(format!("{port}-masked.example.com"))
    );
    assert_eq!(served.body["token"], json!(false));

    // Connect returns the token again; the detail shows the setting.
    let connect = h
        .api(
            "POST",
            &format!("/sandboxes/{id}/connect"),
            Some(r#"{"timeout":60}"#),
        )
        .await;
    assert_eq!(connect.body["trafficAccessToken"], json!(token));
    let detail = h.api("GET", &format!("/sandboxes/{id}"), None).await;
    assert_eq!(detail.body["network"]["allowPublicTraffic"], json!(false));
    assert_eq!(
        detail.body["network"]["maskRequestHost"],
        json!("${PORT}-masked.example.com")
    );

    // Public sandboxes are untouched: no token needed, the client's Host is kept.
    let public = h.create(json!({})).await;
    let public_id = public["sandboxID"].as_str().expect("id");
    assert!(public["trafficAccessToken"].is_null());
    let served = h
        .server
        .send(user_port_request(public_id, port, None))
        .await;
    assert_eq!(served.status, StatusCode::OK);
    assert_eq!(
        served.body["host"],
        json!(format!("{port}-{public_id}.sandbar.localhost"))
    );
}
