//! Volume endpoints in-process: a real SQLite store, the node's host volume storage on a
//! temporary directory, and a runtime double that records what it was asked to mount.

use crate::common;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{Value, json};

use common::{Cred, KEY, OTHER_KEY, Reply, Server, Setup};

struct Harness {
    server: Server,
}

async fn harness() -> Harness {
    harness_with_rate(sandbar_core::volumes::DEFAULT_CONTENT_REQUESTS_PER_MINUTE).await
}

/// A harness whose content API holds each team to `per_minute` requests.
async fn harness_with_rate(per_minute: u32) -> Harness {
    let server = common::serve(Setup {
        key: Some(KEY),
        volumes: Some(per_minute),
        other_team: true,
        ..Setup::default()
    })
    .await;
    Harness { server }
}

impl Harness {
    async fn call(&self, method: &str, path: &str, key: &str, body: Option<Value>) -> Reply {
        let body = body.map(|b| b.to_string());
        self.server
            .send(common::json_request(
                method,
                path,
                Some(key),
                body.as_deref(),
            ))
            .await
    }

    async fn api(&self, method: &str, path: &str, body: Option<Value>) -> Reply {
        self.call(method, path, KEY, body).await
    }

    async fn content(&self, method: &str, path: &str, token: Option<&str>, body: Vec<u8>) -> Reply {
        let mut request = Request::builder().method(method).uri(path);
        if let Some(token) = token {
            request = request.header("Authorization", format!("Bearer {token}"));
        }
        self.server
            .send(request.body(Body::from(body)).expect("request"))
            .await
    }

    /// Creates a volume: (id, token).
    async fn volume(&self, name: &str) -> (String, String) {
        let reply = self
            .api("POST", "/volumes", Some(json!({"name": name})))
            .await;
        assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
        (
            reply.body["volumeID"].as_str().expect("id").to_owned(),
            reply.body["token"].as_str().expect("token").to_owned(),
        )
    }

    fn volume_count(&self) -> usize {
        std::fs::read_dir(self.server.dir.path().join("volumes"))
            .expect("volumes dir")
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .map(|team| std::fs::read_dir(team.path()).map_or(0, |d| d.count()))
            .sum()
    }
}

fn assert_error(reply: &Reply, status: StatusCode, needle: &str) {
    let message = common::error_message(reply.status, &reply.body, status).unwrap_or_default();
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
}

#[tokio::test]
async fn create_list_get_delete() {
    let h = harness().await;
    let (id, token) = h.volume("data_1-x").await;
    assert!(token.starts_with("vol_"));
    let list = h.api("GET", "/volumes", None).await;
    assert_eq!(list.status, StatusCode::OK);
    assert_eq!(list.body, json!([{"volumeID": id, "name": "data_1-x"}]));
    let got = h.api("GET", &format!("/volumes/{id}"), None).await;
    assert_eq!(
        got.body,
        json!({"volumeID": id, "name": "data_1-x", "token": token})
    );
    assert_eq!(h.volume_count(), 1);
    let deleted = h.api("DELETE", &format!("/volumes/{id}"), None).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT);
    assert_eq!(h.volume_count(), 0);
    assert_error(
        &h.api("GET", &format!("/volumes/{id}"), None).await,
        StatusCode::NOT_FOUND,
        &id,
    );
    assert_error(
        &h.api("DELETE", &format!("/volumes/{id}"), None).await,
        StatusCode::NOT_FOUND,
        &id,
    );
    assert_eq!(h.api("GET", "/volumes", None).await.body, json!([]));
}

#[tokio::test]
async fn bad_names_and_duplicates_change_nothing() {
    let h = harness().await;
    h.volume("taken").await;
    assert_error(
        &h.api("POST", "/volumes", Some(json!({"name": "taken"})))
            .await,
        StatusCode::CONFLICT,
        "taken",
    );
    let long = "x".repeat(129);
    for bad in ["", "a b", "a/b", "..", "ü", long.as_str()] {
        assert_error(
            &h.api("POST", "/volumes", Some(json!({"name": bad}))).await,
            StatusCode::BAD_REQUEST,
            "invalid volume name",
        );
    }
    assert_error(
        &h.api("POST", "/volumes", Some(json!({}))).await,
        StatusCode::BAD_REQUEST,
        "name",
    );
    assert_error(
        &h.api("POST", "/volumes", Some(json!({"name": 5}))).await,
        StatusCode::BAD_REQUEST,
        "invalid request body",
    );
    assert_error(
        &h.call("GET", "/volumes", "e2b_nope", None).await,
        StatusCode::UNAUTHORIZED,
        "api key",
    );
    assert_eq!(
        h.api("GET", "/volumes", None)
            .await
            .body
            .as_array()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(h.volume_count(), 1);
    // Names are per team: another team may use the same one.
    let other = h
        .call(
            "POST",
            "/volumes",
            OTHER_KEY,
            Some(json!({"name": "taken"})),
        )
        .await;
    assert_eq!(other.status, StatusCode::CREATED);
}

#[tokio::test]
async fn another_teams_volume_is_invisible() {
    let h = harness().await;
    let (id, token) = h.volume("mine").await;
    let path = format!("/volumes/{id}");
    assert_error(
        &h.call("GET", &path, OTHER_KEY, None).await,
        StatusCode::NOT_FOUND,
        &id,
    );
    assert_error(
        &h.call("DELETE", &path, OTHER_KEY, None).await,
        StatusCode::NOT_FOUND,
        &id,
    );
    assert_eq!(
        h.call("GET", "/volumes", OTHER_KEY, None).await.body,
        json!([])
    );
    let create = h
        .call(
            "POST",
            "/v2/sandboxes",
            OTHER_KEY,
            Some(
                json!({"templateID": "base", "volumeMounts": [{"name": "mine", "path": "/data"}]}),
            ),
        )
        .await;
    assert_error(&create, StatusCode::BAD_REQUEST, "volume 'mine' not found");
    // The volume and its token are untouched.
    assert_eq!(h.api("GET", &path, None).await.body["token"], json!(token));
}

#[tokio::test]
async fn mounts_are_resolved_recorded_and_block_deletion() {
    let h = harness().await;
    let (id, _) = h.volume("work").await;
    let reply = h
        .api(
            "POST",
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "volumeMounts": [{"name": "work", "path": "/mnt/work/"}]})),
        )
        .await;
    assert_eq!(reply.status, StatusCode::CREATED, "{:?}", reply.body);
    let sandbox = reply.body["sandboxID"].as_str().expect("id").to_owned();
    let launched: Vec<_> = h
        .server
        .runtime
        .launched
        .lock()
        .expect("lock")
        .iter()
        .map(|spec| spec.volumes.clone())
        .collect();
    assert_eq!(launched.len(), 1);
    assert_eq!(launched[0].len(), 1);
    assert_eq!(launched[0][0].volume_id, id);
    assert_eq!(launched[0][0].path, "/mnt/work");

    let detail = h.api("GET", &format!("/sandboxes/{sandbox}"), None).await;
    assert_eq!(
        detail.body["volumeMounts"],
        json!([{"name": "work", "path": "/mnt/work"}])
    );
    assert_error(
        &h.api("DELETE", &format!("/volumes/{id}"), None).await,
        StatusCode::CONFLICT,
        &sandbox,
    );
    assert_eq!(h.volume_count(), 1);
    assert_eq!(
        h.api("DELETE", &format!("/sandboxes/{sandbox}"), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(
        h.api("DELETE", &format!("/volumes/{id}"), None)
            .await
            .status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(h.volume_count(), 0);
}

#[tokio::test]
async fn bad_mounts_are_refused_with_the_entry_named() {
    let h = harness().await;
    h.volume("v").await;
    h.volume("w").await;
    let m = |name: &str, path: &str| json!({"name": name, "path": path});
    let cases = [
        (
            json!([m("v", "data")]),
            "volumeMounts[0]: invalid path 'data': must be absolute",
        ),
        (json!([m("v", "/")]), "cannot be '/'"),
        (json!([m("v", "/proc")]), "under /proc"),
        (json!([m("v", "/sys/x")]), "under /sys"),
        (json!([m("v", "/dev/shm")]), "under /dev"),
        (json!([m("v", "/a/../etc")]), "'..'"),
        (json!([m("v", "/a/./b")]), "'.'"),
        (json!([m("v", "/a//b")]), "empty component"),
        (
            json!([m("v", "/a"), m("w", "/a/")]),
            "volumeMounts[1]: path '/a'",
        ),
        (
            json!([m("v", "/a"), m("v", "/b")]),
            "volumeMounts[1]: volume 'v'",
        ),
        (
            json!([m("nope", "/a")]),
            "volumeMounts[0]: volume 'nope' not found",
        ),
        (json!([m("bad name", "/a")]), "volume 'bad name' not found"),
        (
            json!([{"name": "v"}]),
            "volumeMounts[0]: path must be a string",
        ),
        (
            json!([{"path": "/a", "name": null}]),
            "volumeMounts[0]: name must be a string",
        ),
    ];
    for (mounts, needle) in cases {
        let reply = h
            .api(
                "POST",
                "/v2/sandboxes",
                Some(json!({"templateID": "base", "volumeMounts": mounts})),
            )
            .await;
        assert_error(&reply, StatusCode::BAD_REQUEST, needle);
    }
    let too_many: Vec<Value> = (0..17).map(|i| m("v", &format!("/m{i}"))).collect();
    let reply = h
        .api(
            "POST",
            "/v2/sandboxes",
            Some(json!({"templateID": "base", "volumeMounts": too_many})),
        )
        .await;
    assert_error(&reply, StatusCode::BAD_REQUEST, "at most 16");
    assert!(h.server.runtime.launched.lock().expect("lock").is_empty());
    assert_eq!(h.api("GET", "/v2/sandboxes", None).await.body, json!([]));
}

#[tokio::test]
async fn content_api_reads_writes_lists_and_removes() {
    let h = harness().await;
    let (id, token) = h.volume("c").await;
    let t = Some(token.as_str());
    let base = format!("/volumecontent/{id}");

    let put = h
        .content(
            "PUT",
            &format!("{base}/file?path=/dir/f.txt&force=true&uid=1000&gid=1000&mode=384"),
            t,
            b"hello".to_vec(),
        )
        .await;
    assert_eq!(put.status, StatusCode::CREATED, "{:?}", put.body);
    assert_eq!(put.body["type"], "file");
    assert_eq!(put.body["path"], "/dir/f.txt");
    assert_eq!(put.body["size"], 5);
    assert_eq!(
        (put.body["uid"].clone(), put.body["mode"].clone()),
        (json!(1000), json!(0o600))
    );
    let got = h
        .content("GET", &format!("{base}/file?path=dir/f.txt"), t, vec![])
        .await;
    assert_eq!((got.status, got.raw), (StatusCode::OK, b"hello".to_vec()));

    let mk = h
        .content(
            "POST",
            &format!("{base}/dir?path=/a/b&force=true"),
            t,
            vec![],
        )
        .await;
    assert_eq!(mk.status, StatusCode::CREATED, "{:?}", mk.body);
    assert_error(
        &h.content("POST", &format!("{base}/dir?path=/a/b"), t, vec![])
            .await,
        StatusCode::CONFLICT,
        "already exists",
    );
    assert_error(
        &h.content("POST", &format!("{base}/dir?path=/x/y"), t, vec![])
            .await,
        StatusCode::NOT_FOUND,
        "not found",
    );
    let list = h
        .content("GET", &format!("{base}/dir?path=/&depth=2"), t, vec![])
        .await;
    let paths: Vec<&str> = list
        .body
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|e| e["path"].as_str())
        .collect();
    assert_eq!(paths, ["/a", "/a/b", "/dir", "/dir/f.txt"]);
    let stat = h
        .content("GET", &format!("{base}/path?path=/a"), t, vec![])
        .await;
    assert_eq!(stat.body["type"], "directory");

    let patch = common::request(
        "PATCH",
        &format!("{base}/path?path=/dir/f.txt"),
        Cred::Bearer(&token),
        Some(r#"{"mode": 420, "uid": 0}"#.to_owned()),
    );
    let patched = h.server.send(patch).await;
    assert_eq!(patched.status, StatusCode::OK, "{:?}", patched.body);
    assert_eq!(
        (patched.body["mode"].clone(), patched.body["uid"].clone()),
        (json!(0o644), json!(0))
    );

    let removed = h
        .content("DELETE", &format!("{base}/path?path=/a"), t, vec![])
        .await;
    assert_eq!(removed.status, StatusCode::NO_CONTENT);
    assert_error(
        &h.content("GET", &format!("{base}/path?path=/a/b"), t, vec![])
            .await,
        StatusCode::NOT_FOUND,
        "'/a' not found",
    );
    assert_error(
        &h.content("DELETE", &format!("{base}/path?path=/a"), t, vec![])
            .await,
        StatusCode::NOT_FOUND,
        "/a",
    );
}

#[tokio::test]
async fn content_api_refuses_bad_tokens_and_bad_input() {
    let h = harness().await;
    let (id, token) = h.volume("c").await;
    let (other_id, _) = h.volume("d").await;
    let t = Some(token.as_str());
    let base = format!("/volumecontent/{id}");
    let listing = format!("{base}/dir?path=/");
    // One volume's token opens no other volume; unknown volumes answer the same.
    for (path, token, needle) in [
        (listing.clone(), None, id.as_str()),
        (listing.clone(), Some("vol_0000"), &id),
        (listing, Some(""), &id),
        (
            format!("/volumecontent/{other_id}/dir?path=/"),
            t,
            &other_id,
        ),
        ("/volumecontent/unknown/dir?path=/".to_owned(), t, "unknown"),
    ] {
        assert_error(
            &h.content("GET", &path, token, vec![]).await,
            StatusCode::UNAUTHORIZED,
            needle,
        );
    }
    let cases = [
        ("GET", format!("{base}/file"), "path is required"),
        ("GET", format!("{base}/file?path=../x"), "'..'"),
        ("GET", format!("{base}/file?path=/a/../../x"), "'..'"),
        ("GET", format!("{base}/file?path=/"), "is a directory"),
        ("PUT", format!("{base}/file?path=/f&uid=70000"), "uid 70000"),
        ("PUT", format!("{base}/file?path=/f&gid=-1"), "gid"),
        ("PUT", format!("{base}/file?path=/f&mode=2541"), "mode 4755"),
        ("PUT", format!("{base}/file?path=/f&force=maybe"), "force"),
        ("PUT", format!("{base}/file?path=/"), "is a directory"),
        ("DELETE", format!("{base}/path?path=/"), "root"),
        ("GET", format!("{base}/dir?path=/&depth=0"), "depth"),
    ];
    for (method, path, needle) in cases {
        assert_error(
            &h.content(method, &path, t, b"x".to_vec()).await,
            StatusCode::BAD_REQUEST,
            needle,
        );
    }
    assert_error(
        &h.content(
            "PUT",
            &format!("{base}/file?path=/no/such/f"),
            t,
            b"x".to_vec(),
        )
        .await,
        StatusCode::NOT_FOUND,
        "/no",
    );
    let list = h
        .content("GET", &format!("{base}/dir?path=/"), t, vec![])
        .await;
    assert_eq!(list.body, json!([]), "a refused request changed the volume");
}

#[tokio::test]
async fn planted_symlinks_never_lead_out_of_the_volume() {
    let h = harness().await;
    let (id, token) = h.volume("s").await;
    let (neighbour, _) = h.volume("n").await;
    let t = Some(token.as_str());
    let base = format!("/volumecontent/{id}");
    let root = std::fs::read_dir(h.server.dir.path().join("volumes"))
        .expect("volumes")
        .flatten()
        .find(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .expect("team dir")
        .path();
    let vol = root.join(&id);
    std::fs::write(root.join(&neighbour).join("secret"), "neighbour").expect("secret");
    let outside = h.server.dir.path().join("outside.txt");
    std::fs::write(&outside, "host file").expect("outside");
    // What a sandbox could plant.
    std::os::unix::fs::symlink("/etc/shadow", vol.join("shadow")).expect("link");
    std::os::unix::fs::symlink("..", vol.join("up")).expect("link");
    std::os::unix::fs::symlink(&outside, vol.join("outside")).expect("link");
    std::os::unix::fs::symlink("../../../..", vol.join("far")).expect("link");
    std::fs::create_dir(vol.join("d")).expect("dir");
    std::os::unix::fs::symlink("../up", vol.join("d/up")).expect("link");
    std::os::unix::fs::symlink("../d", vol.join("d/self")).expect("link");

    for path in [
        "/shadow",
        "/outside",
        &format!("/up/{neighbour}/secret"),
        "/far/etc/passwd",
        &format!("/d/up/{neighbour}/secret"),
    ] {
        let reply = h
            .content("GET", &format!("{base}/file?path={path}"), t, vec![])
            .await;
        assert_error(&reply, StatusCode::BAD_REQUEST, "outside the volume");
    }
    for path in ["/up", "/far", "/d/up"] {
        let reply = h
            .content("GET", &format!("{base}/dir?path={path}"), t, vec![])
            .await;
        assert_error(&reply, StatusCode::BAD_REQUEST, "outside the volume");
    }
    for (method, path) in [
        ("PUT", "/up/x"),
        ("PUT", "/far/tmp/x?force=true"),
        ("POST", "/up/newdir"),
        ("POST", "/far/newdir"),
    ] {
        let kind = if method == "PUT" { "file" } else { "dir" };
        let (p, q) = path.split_once('?').unwrap_or((path, ""));
        let uri = format!("{base}/{kind}?path={p}&{q}");
        let reply = h.content(method, &uri, t, b"x".to_vec()).await;
        assert_error(&reply, StatusCode::BAD_REQUEST, "outside the volume");
    }
    assert!(!root.join("x").exists() && !root.join("newdir").exists());
    // Links are described, not followed; metadata changes on them are refused.
    let stat = h
        .content("GET", &format!("{base}/path?path=/outside"), t, vec![])
        .await;
    assert_eq!(stat.body["type"], "symlink");
    assert_eq!(stat.body["target"], json!(outside.display().to_string()));
    let patch = Request::builder()
        .method("PATCH")
        .uri(format!("{base}/path?path=/outside"))
        .header("Authorization", format!("Bearer {token}"))
        .body(Body::from(r#"{"mode": 511}"#))
        .expect("request");
    assert_error(
        &h.server.send(patch).await,
        StatusCode::BAD_REQUEST,
        "symlink",
    );
    // Links inside the volume that stay inside are fine.
    let inside = h
        .content("GET", &format!("{base}/dir?path=/d/self"), t, vec![])
        .await;
    assert_eq!(inside.status, StatusCode::OK, "{:?}", inside.body);
    // Writing over a link replaces the link; removing one removes the link only.
    let put = h
        .content(
            "PUT",
            &format!("{base}/file?path=/outside"),
            t,
            b"new".to_vec(),
        )
        .await;
    assert_eq!(put.status, StatusCode::CREATED, "{:?}", put.body);
    assert_eq!(
        std::fs::read_to_string(&outside).expect("outside"),
        "host file"
    );
    assert!(
        vol.join("outside")
            .symlink_metadata()
            .expect("file")
            .is_file()
    );
    let removed = h
        .content("DELETE", &format!("{base}/path?path=/up"), t, vec![])
        .await;
    assert_eq!(removed.status, StatusCode::NO_CONTENT);
    assert!(root.join(&neighbour).join("secret").exists());
    let removed = h
        .content("DELETE", &format!("{base}/path?path=/d"), t, vec![])
        .await;
    assert_eq!(removed.status, StatusCode::NO_CONTENT);
    assert!(root.join(&neighbour).join("secret").exists());
}

#[tokio::test]
async fn special_files_are_refused_as_what_they_are() {
    let h = harness().await;
    let (id, token) = h.volume("f").await;
    let t = Some(token.as_str());
    let base = format!("/volumecontent/{id}");
    let root = std::fs::read_dir(h.server.dir.path().join("volumes"))
        .expect("volumes")
        .flatten()
        .find(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .expect("team dir")
        .path();
    let vol = root.join(&id);
    // What a sandbox could plant; opening it must not hang the server either.
    let made = std::process::Command::new("mkfifo")
        .arg(vol.join("pipe"))
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let _socket = std::os::unix::net::UnixListener::bind(vol.join("sock")).expect("socket");
    for (path, kind) in [
        ("/pipe", "'/pipe' is a fifo"),
        ("/sock", "'/sock' is a socket"),
    ] {
        let reply = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            h.content("GET", &format!("{base}/file?path={path}"), t, vec![]),
        )
        .await
        .expect("a read of a special file answers at once");
        assert_error(&reply, StatusCode::BAD_REQUEST, kind);
    }
}

/// A body arriving in `chunks`, then `ending` (an error, as a dropped connection gives).
fn streamed(chunks: Vec<Vec<u8>>, ending: Option<&'static str>) -> Body {
    let mut frames: Vec<Result<bytes::Bytes, std::io::Error>> =
        chunks.into_iter().map(|c| Ok(c.into())).collect();
    if let Some(message) = ending {
        frames.push(Err(std::io::Error::other(message)));
    }
    Body::from_stream(futures_util::stream::iter(frames))
}

#[tokio::test]
async fn files_stream_in_and_out_and_a_cut_upload_leaves_nothing() {
    let h = harness().await;
    let (id, token) = h.volume("stream").await;
    let base = format!("/volumecontent/{id}");
    let chunks: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 300 << 10]).collect();
    let whole: Vec<u8> = chunks.concat();
    let put = |body: Body| {
        Request::builder()
            .method("PUT")
            .uri(format!("{base}/file?path=/d/big.bin&force=true"))
            .header("Authorization", format!("Bearer {token}"))
            .body(body)
            .expect("request")
    };
    let written = h.server.send(put(streamed(chunks.clone(), None))).await;
    assert_eq!(written.status, StatusCode::CREATED, "{:?}", written.body);
    assert_eq!(written.body["size"], json!(whole.len()));
    let read = h
        .content(
            "GET",
            &format!("{base}/file?path=/d/big.bin"),
            Some(&token),
            vec![],
        )
        .await;
    assert_eq!(read.status, StatusCode::OK);
    assert_eq!(
        read.headers["content-length"].to_str().expect("length"),
        whole.len().to_string()
    );
    assert!(read.raw == whole, "the file read back differs");

    // A body that breaks off is refused, and neither the target nor a staged file changes.
    let cut = h
        .server
        .send(put(streamed(vec![vec![9; 1000]], Some("connection reset"))))
        .await;
    assert_error(&cut, StatusCode::BAD_REQUEST, "cannot read the upload");
    let listed = h
        .content("GET", &format!("{base}/dir?path=/d"), Some(&token), vec![])
        .await;
    let names: Vec<&str> = listed
        .body
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(names, vec!["big.bin"]);
    let again = h
        .content(
            "GET",
            &format!("{base}/file?path=/d/big.bin"),
            Some(&token),
            vec![],
        )
        .await;
    assert!(again.raw == whole, "a cut upload changed the file");

    // A declared size past the limit is refused before anything is read.
    let mut too_big = put(Body::from("x"));
    too_big
        .headers_mut()
        .insert("content-length", (300u64 << 20).into());
    assert_error(
        &h.server.send(too_big).await,
        StatusCode::PAYLOAD_TOO_LARGE,
        "268435456 bytes",
    );
}

#[tokio::test]
async fn the_content_api_holds_a_team_to_its_rate() {
    let h = harness_with_rate(5).await;
    let (id, token) = h.volume("rate").await;
    let path = format!("/volumecontent/{id}/path?path=/");
    // Wrong tokens spend nothing of the team's requests.
    for _ in 0..3 {
        let refused = h.content("GET", &path, Some("vol_wrong"), vec![]).await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    }
    for i in 0..5 {
        let ok = h.content("GET", &path, Some(&token), vec![]).await;
        assert_eq!(ok.status, StatusCode::OK, "request {i}: {:?}", ok.body);
    }
    let limited = h.content("GET", &path, Some(&token), vec![]).await;
    assert_error(
        &limited,
        StatusCode::TOO_MANY_REQUESTS,
        "5 volume content requests per minute",
    );
    let retry = common::retry_after(&limited.headers);
    assert!((1..=12).contains(&retry), "Retry-After {retry}");
    // The team's control plane is another bucket.
    assert_eq!(h.api("GET", "/volumes", None).await.status, StatusCode::OK);
}
