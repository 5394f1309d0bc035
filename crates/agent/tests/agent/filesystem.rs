#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::{Value, json};

#[tokio::test]
async fn make_stat_list_move_remove() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_str().unwrap().to_owned();

    let body = agent
        .unary_ok(
            "filesystem.Filesystem/MakeDir",
            json!({"path": format!("{root}/a/b")}),
        )
        .await;
    assert_eq!(body["entry"]["type"], "FILE_TYPE_DIRECTORY");
    assert_eq!(body["entry"]["name"], "b");
    assert_eq!(
        body["entry"]["permissions"]
            .as_str()
            .unwrap()
            .chars()
            .next(),
        Some('d')
    );

    let (status, body) = agent
        .unary(
            "filesystem.Filesystem/MakeDir",
            json!({"path": format!("{root}/a/b")}),
        )
        .await;
    assert_eq!(status, 409);
    assert_eq!(body["code"], "already_exists");

    std::fs::write(dir.path().join("a/b/f.txt"), "12345").unwrap();
    std::fs::write(dir.path().join("top.txt"), "x").unwrap();

    let body = agent
        .unary_ok(
            "filesystem.Filesystem/Stat",
            json!({"path": format!("{root}/a/b/f.txt")}),
        )
        .await;
    let entry = &body["entry"];
    assert_eq!(entry["type"], "FILE_TYPE_FILE");
    assert_eq!(entry["size"], "5");
    assert_eq!(entry["owner"], "root");
    assert_eq!(entry["path"], format!("{root}/a/b/f.txt"));
    assert!(entry["modifiedTime"].as_str().unwrap().ends_with('Z'));
    assert_eq!(entry["permissions"].as_str().unwrap().len(), 10);

    let names = |body: &serde_json::Value| {
        let mut v: Vec<String> = body["entries"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                e["path"]
                    .as_str()
                    .unwrap()
                    .trim_start_matches(&root)
                    .to_owned()
            })
            .collect();
        v.sort();
        v
    };
    let body = agent
        .unary_ok("filesystem.Filesystem/ListDir", json!({"path": root}))
        .await;
    assert_eq!(names(&body), vec!["/a", "/top.txt"]);
    let (_, body) = agent
        .unary(
            "filesystem.Filesystem/ListDir",
            json!({"path": root, "depth": 2}),
        )
        .await;
    assert_eq!(names(&body), vec!["/a", "/a/b", "/top.txt"]);
    let (_, body) = agent
        .unary(
            "filesystem.Filesystem/ListDir",
            json!({"path": root, "depth": 3}),
        )
        .await;
    assert_eq!(names(&body), vec!["/a", "/a/b", "/a/b/f.txt", "/top.txt"]);

    let body = agent
        .unary_ok(
            "filesystem.Filesystem/Move",
            json!({"source": format!("{root}/top.txt"), "destination": format!("{root}/moved/top2.txt")}),
        )
        .await;
    assert_eq!(body["entry"]["name"], "top2.txt");
    assert!(dir.path().join("moved/top2.txt").exists());
    assert!(!dir.path().join("top.txt").exists());

    agent
        .unary_ok(
            "filesystem.Filesystem/Remove",
            json!({"path": format!("{root}/a")}),
        )
        .await;
    assert!(!dir.path().join("a").exists());
    agent
        .unary_not_found(
            "filesystem.Filesystem/Stat",
            json!({"path": format!("{root}/a")}),
        )
        .await;
    // What is not there is removed already, like `rm -rf`; so is what is under it.
    for gone in [format!("{root}/a"), format!("{root}/a/b/c")] {
        let (status, body) = agent
            .unary("filesystem.Filesystem/Remove", json!({"path": gone}))
            .await;
        assert_eq!(status, 200, "{gone}: {body}");
    }
}

#[tokio::test]
async fn relative_paths_resolve_against_home() {
    let agent = Agent::start().await;
    let body = agent
        .unary_ok("filesystem.Filesystem/Stat", json!({"path": "."}))
        .await;
    assert_eq!(body["entry"]["path"], "/root");
}

#[tokio::test]
async fn polling_watcher_sees_created_file() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let body = agent
        .unary_ok(
            "filesystem.Filesystem/CreateWatcher",
            json!({"path": dir.path().to_str().unwrap(), "recursive": true}),
        )
        .await;
    let id = body["watcherId"].as_str().unwrap().to_owned();
    std::fs::write(dir.path().join("sub/new.txt"), "x").unwrap();

    let mut seen = Vec::new();
    for _ in 0..50 {
        let body = agent
            .unary_ok(
                "filesystem.Filesystem/GetWatcherEvents",
                json!({"watcherId": id}),
            )
            .await;
        if let Some(events) = body["events"].as_array() {
            seen.extend(events.iter().cloned());
        }
        if seen
            .iter()
            .any(|e| e["name"] == "sub/new.txt" && e["type"] == "EVENT_TYPE_CREATE")
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        seen.iter()
            .any(|e| e["name"] == "sub/new.txt" && e["type"] == "EVENT_TYPE_CREATE"),
        "{seen:?}"
    );
    agent
        .unary_ok(
            "filesystem.Filesystem/RemoveWatcher",
            json!({"watcherId": id}),
        )
        .await;
    agent
        .unary_not_found(
            "filesystem.Filesystem/GetWatcherEvents",
            json!({"watcherId": id}),
        )
        .await;
}

#[tokio::test]
async fn watch_dir_stream() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut frames = agent
        .stream(
            "filesystem.Filesystem/WatchDir",
            json!({"path": dir.path().to_str().unwrap(), "includeEntry": true}),
            &[],
        )
        .await;
    let first = frames.event_raw().await;
    assert!(first.get("start").is_some(), "{first}");
    std::fs::write(dir.path().join("w.txt"), "x").unwrap();
    let ev = frames.event_raw().await;
    assert_eq!(ev["filesystem"]["name"], "w.txt");
    assert_eq!(ev["filesystem"]["type"], "EVENT_TYPE_CREATE");
    assert_eq!(ev["filesystem"]["entry"]["name"], "w.txt");
}

#[tokio::test]
async fn auth_is_enforced() {
    let agent = Agent::start().await;
    let no_token = |path: &str, token: Option<&str>| {
        let mut req = http::Request::builder()
            .method(if path == "/health" || path == "/envs" {
                "GET"
            } else {
                "POST"
            })
            .uri(format!("{}{path}", agent.base))
            .header("content-type", "application/json");
        if let Some(t) = token {
            req = req.header("x-access-token", t);
        }
        req.body(full(&b"{}"[..])).unwrap()
    };
    let (status, _, body) = agent.send(no_token("/process.Process/List", None)).await;
    assert_eq!(status, 401);
    let err: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["code"], 401);
    let (status, _, _) = agent
        .send(no_token("/process.Process/List", Some("wrong")))
        .await;
    assert_eq!(status, 401);
    let (status, _, _) = agent.send(no_token("/envs", None)).await;
    assert_eq!(status, 401);
    let (status, _, body) = agent.send(no_token("/envs", Some(TOKEN))).await;
    assert_eq!(status, 200);
    let envs: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(envs, json!({"CFG_VAR": "from-config"}));
    let (status, _, _) = agent.send(no_token("/health", None)).await;
    assert_eq!(status, 204);
    let (status, _, _) = agent
        .send(no_token("/process.Process/Nope", Some(TOKEN)))
        .await;
    assert_eq!(status, 404);

    // An unknown Linux user is refused.
    let req = agent
        .request("POST", "/filesystem.Filesystem/Stat")
        .header("content-type", "application/json")
        .header("authorization", "Basic bm8tc3VjaC11c2VyOg==")
        .body(full(&b"{\"path\":\"/\"}"[..]))
        .unwrap();
    let (status, _, body) = agent.send(req).await;
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("no-such-user"));
}

#[tokio::test]
async fn init_hands_the_agent_a_new_token_and_environment() {
    let agent = Agent::start().await;
    let call = |method: &str, path: &str, token: &str, body: &Value| {
        http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", agent.base))
            .header("content-type", "application/json")
            .header("x-access-token", token)
            .body(full(serde_json::to_vec(body).unwrap()))
            .unwrap()
    };
    let init = json!({"accessToken": "next-token", "envVars": {"NEW_VAR": "yes"}});
    // Only the holder of the token in force may hand over.
    let (status, _, _) = agent.send(call("POST", "/init", "wrong", &init)).await;
    assert_eq!(status, 401);
    let (status, _, _) = agent.send(call("POST", "/init", TOKEN, &init)).await;
    assert_eq!(status, 204);
    let (status, _, _) = agent.send(call("GET", "/envs", TOKEN, &json!({}))).await;
    assert_eq!(status, 401, "the old token is refused once handed over");
    let (status, _, body) = agent
        .send(call("GET", "/envs", "next-token", &json!({})))
        .await;
    assert_eq!(status, 200);
    let envs: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(envs, json!({"NEW_VAR": "yes"}));
}
