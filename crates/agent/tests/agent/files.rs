#![allow(clippy::unwrap_used)]

use crate::common;

use std::io::{Read as _, Write as _};
use std::path::Path;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, StreamBody};
use serde_json::{Value, json};

/// Posts `parts` to `uri` as a multipart form, one file field per part.
async fn post_multipart(
    agent: &Agent,
    uri: &str,
    parts: &[(&str, &[u8])],
) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let (ct, body) = multipart(parts);
    let req = agent
        .request("POST", uri)
        .header("content-type", ct)
        .body(full(body))
        .unwrap();
    agent.send(req).await
}

/// Downloads the file at `path` with the access token and no other header.
async fn download(agent: &Agent, path: &Path) -> (http::StatusCode, http::HeaderMap, Bytes) {
    let req = agent
        .request("GET", &format!("/files?path={}", enc(path)))
        .body(full(Bytes::new()))
        .unwrap();
    agent.send(req).await
}

fn multipart(parts: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "sandbar-test-boundary";
    let mut body = Vec::new();
    for (filename, data) in parts {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(data);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

fn enc(path: &std::path::Path) -> String {
    percent_encode(path.to_str().unwrap())
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[tokio::test]
async fn multipart_upload_then_download() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("nested/deeper/a.txt");
    let (status, _, resp) = post_multipart(
        &agent,
        &format!("/files?path={}", enc(&dest)),
        &[(dest.to_str().unwrap(), b"hello world")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    let written: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(
        written,
        json!([{"name": "a.txt", "type": "file", "path": dest.to_str().unwrap()}])
    );
    assert_eq!(std::fs::read(&dest).unwrap(), b"hello world");

    let (status, headers, data) = download(&agent, &dest).await;
    assert_eq!(status, 200);
    assert_eq!(&data[..], b"hello world");
    assert_eq!(headers["content-type"], "application/octet-stream");
    assert!(
        headers["content-disposition"]
            .to_str()
            .unwrap()
            .contains("a.txt")
    );
}

#[tokio::test]
async fn multipart_several_files_and_duplicates() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    let (status, _, resp) = post_multipart(
        &agent,
        "/files",
        &[(a.to_str().unwrap(), b"A"), (b.to_str().unwrap(), b"B")],
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(std::fs::read(&a).unwrap(), b"A");
    assert_eq!(std::fs::read(&b).unwrap(), b"B");

    let (status, _, resp) = post_multipart(
        &agent,
        "/files",
        &[(a.to_str().unwrap(), b"1"), (a.to_str().unwrap(), b"2")],
    )
    .await;
    assert_eq!(status, 400);
    let err: Value = serde_json::from_slice(&resp).unwrap();
    assert_eq!(err["code"], 400);
}

#[tokio::test]
async fn octet_stream_and_gzip_uploads() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("raw.bin");
    let req = agent
        .request("POST", &format!("/files?path={}", enc(&raw)))
        .header("content-type", "application/octet-stream")
        .body(full(&b"raw bytes"[..]))
        .unwrap();
    let (status, _, resp) = agent.send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(std::fs::read(&raw).unwrap(), b"raw bytes");

    let gz = dir.path().join("gz.txt");
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(b"compressed content").unwrap();
    let req = agent
        .request("POST", &format!("/files?path={}", enc(&gz)))
        .header("content-type", "application/octet-stream")
        .header("content-encoding", "gzip")
        .body(full(encoder.finish().unwrap()))
        .unwrap();
    let (status, _, resp) = agent.send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(std::fs::read(&gz).unwrap(), b"compressed content");

    // Gzip download.
    let req = agent
        .request("GET", &format!("/files?path={}", enc(&gz)))
        .header("accept-encoding", "gzip")
        .body(full(Bytes::new()))
        .unwrap();
    let (status, headers, data) = agent.send(req).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-encoding"], "gzip");
    let mut plain = String::new();
    flate2::read::GzDecoder::new(&data[..])
        .read_to_string(&mut plain)
        .unwrap();
    assert_eq!(plain, "compressed content");
}

#[tokio::test]
async fn download_errors() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing");
    let (status, _, body) = download(&agent, &missing).await;
    assert_eq!(status, 404);
    let err: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(err["code"], 404);
    assert!(err["message"].as_str().unwrap().contains("missing"));

    let (status, _, _) = download(&agent, dir.path()).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn large_streamed_upload_and_download() {
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 100;
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("big.bin");
    let chunks = futures_util::stream::iter((0..CHUNKS).map(|i| {
        Ok::<_, std::io::Error>(hyper::body::Frame::data(Bytes::from(vec![
            (i % 251) as u8;
            CHUNK
        ])))
    }));
    let req = agent
        .request("POST", &format!("/files?path={}", enc(&dest)))
        .header("content-type", "application/octet-stream")
        .body(StreamBody::new(chunks).boxed())
        .unwrap();
    let (status, _, resp) = agent.send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(
        std::fs::metadata(&dest).unwrap().len(),
        (CHUNK * CHUNKS) as u64
    );

    let req = agent
        .request("GET", &format!("/files?path={}", enc(&dest)))
        .body(full(Bytes::new()))
        .unwrap();
    let resp = agent.client.request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut total = 0usize;
    let mut last = None;
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            total += data.len();
            last = data.last().copied().or(last);
        }
    }
    assert_eq!(total, CHUNK * CHUNKS);
    assert_eq!(last, Some(((CHUNKS - 1) % 251) as u8));
}

#[tokio::test]
async fn signed_urls() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("signed.txt");
    std::fs::write(&file, "secret").unwrap();
    let path = file.to_str().unwrap();
    let sign =
        |operation, exp| sandbar_agent::auth::file_signature(path, operation, "", TOKEN, Some(exp));
    let signed_query = |sig: &str, exp: i64| {
        format!(
            "path={}&signature={}&signature_expiration={exp}",
            enc(&file),
            percent_encode(sig)
        )
    };
    let get = |query: String| {
        http::Request::builder()
            .method("GET")
            .uri(format!("{}/files?{query}", agent.base))
            .body(full(Bytes::new()))
            .unwrap()
    };
    let exp = chrono_like_now() + 60;
    let sig = sign(sandbar_agent::auth::FileOperation::Read, exp);
    let (status, _, body) = agent.send(get(signed_query(&sig, exp))).await;
    assert_eq!(status, 200);
    assert_eq!(&body[..], b"secret");

    // Wrong operation, wrong expiration, missing signature: all refused.
    let write_sig = sign(sandbar_agent::auth::FileOperation::Write, exp);
    for query in [
        signed_query(&write_sig, exp),
        signed_query(&sig, exp + 1),
        format!("path={}", enc(&file)),
    ] {
        let (status, _, body) = agent.send(get(query.clone())).await;
        assert_eq!(status, 401, "{query}: {}", String::from_utf8_lossy(&body));
    }

    // Expired.
    let old = chrono_like_now() - 10;
    let expired = sign(sandbar_agent::auth::FileOperation::Read, old);
    let (status, _, _) = agent.send(get(signed_query(&expired, old))).await;
    assert_eq!(status, 401);

    // Signed upload.
    let up = dir.path().join("up.txt");
    let up_sig = sandbar_agent::auth::file_signature(
        up.to_str().unwrap(),
        sandbar_agent::auth::FileOperation::Write,
        "root",
        TOKEN,
        None,
    );
    let req = http::Request::builder()
        .method("POST")
        .uri(format!(
            "{}/files?path={}&username=root&signature={}",
            agent.base,
            enc(&up),
            percent_encode(&up_sig)
        ))
        .header("content-type", "application/octet-stream")
        .body(full(&b"via signature"[..]))
        .unwrap();
    let (status, _, body) = agent.send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(std::fs::read(&up).unwrap(), b"via signature");
}

#[tokio::test]
async fn a_signed_url_acts_as_its_signer_whatever_the_authorization_header_says() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    // Anyone may write here, so only the agent's choice of user decides the owner.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    // What `upload_url()` gives out without a user: signed for '', the default user (root
    // here), and no username in the URL.
    let upload = |name: &str, basic: Option<&str>| {
        let path = dir.path().join(name);
        let sig = sandbar_agent::auth::file_signature(
            path.to_str().unwrap(),
            sandbar_agent::auth::FileOperation::Write,
            "",
            TOKEN,
            None,
        );
        let mut req = http::Request::builder().method("POST").uri(format!(
            "{}/files?path={}&signature={}",
            agent.base,
            enc(&path),
            percent_encode(&sig)
        ));
        if let Some(user) = basic {
            req = req.header(
                "authorization",
                format!("Basic {}", b64(format!("{user}:").as_bytes())),
            );
        }
        let req = req
            .header("content-type", "application/octet-stream")
            .body(full(&b"signed"[..]))
            .unwrap();
        (path, req)
    };
    let (path, req) = upload("other.txt", Some("nobody"));
    let (status, _, body) = agent.send(req).await;
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 401, "{text}");
    assert!(
        text.contains("signed for user 'root'") && text.contains("'nobody'"),
        "{text}"
    );
    assert!(!path.exists());
    // Naming the user the URL was signed for changes nothing.
    for (name, basic) in [("plain.txt", None), ("same.txt", Some("root"))] {
        let (path, req) = upload(name, basic);
        let (status, _, body) = agent.send(req).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(std::fs::metadata(&path).unwrap().uid(), 0, "{name}");
    }
    // With the access token, the header still picks the user.
    let by_token = dir.path().join("token.txt");
    let req = agent
        .request("POST", &format!("/files?path={}", enc(&by_token)))
        .header("authorization", format!("Basic {}", b64(b"nobody:")))
        .header("content-type", "application/octet-stream")
        .body(full(&b"token"[..]))
        .unwrap();
    let (status, _, body) = agent.send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(std::fs::metadata(&by_token).unwrap().uid(), 65534);
}

fn chrono_like_now() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    )
    .unwrap()
}
