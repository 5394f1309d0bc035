#![allow(clippy::unwrap_used)]

use crate::common;

use std::time::Duration;

use common::*;
use serde_json::json;

#[tokio::test]
async fn start_streams_start_data_end() {
    let agent = Agent::start().await;
    let mut frames = agent
        .start_process(json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi"]}, "stdin": false}))
        .await;
    let pid = started(&mut frames).await;
    assert!(pid > 1);
    let out = frames.finish().await;
    assert_eq!(out.stdout, b"hi\n");
    let end = out.end.unwrap();
    assert!(
        end.get("exitCode").is_none(),
        "exit code 0 is a default and omitted: {end}"
    );
    assert_eq!(end["exited"], true);
    assert_eq!(end["status"], "exit status 0");
    assert_eq!(out.end_stream.unwrap(), json!({}));
}

#[tokio::test]
async fn exit_code_stderr_env_and_cwd() {
    let agent = Agent::start().await;
    let dir = tempfile::tempdir().unwrap();
    let msg = json!({
        "process": {
            "cmd": "/bin/bash",
            "args": ["-c", "echo $CFG_VAR $REQ_VAR $HOME $USER; pwd; echo oops >&2; exit 7"],
            "envs": {"REQ_VAR": "from-request"},
            "cwd": dir.path().to_str().unwrap(),
        },
        "stdin": false,
    });
    let mut frames = agent.stream("process.Process/Start", msg, &[]).await;
    started(&mut frames).await;
    let out = frames.finish().await;
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    assert_eq!(
        stdout,
        format!(
            "from-config from-request /root root\n{}\n",
            dir.path().display()
        )
    );
    assert_eq!(out.stderr, b"oops\n");
    assert_eq!(out.exit_code(), 7);
    let end = out.end.unwrap();
    assert_eq!(end["exited"], true);
    assert_eq!(end["error"], "exit status 7");
}

#[tokio::test]
async fn stdin_send_input_and_close() {
    let agent = Agent::start().await;
    let msg = json!({"process": {"cmd": "/bin/cat"}, "stdin": true});
    let mut frames = agent.stream("process.Process/Start", msg, &[]).await;
    let pid = started(&mut frames).await;
    agent.send_stdin(pid, b"hello\n").await;
    agent.close_stdin(pid).await;
    let out = frames.finish().await;
    assert_eq!(out.stdout, b"hello\n");
    assert_eq!(out.exit_code(), 0);
}

#[tokio::test]
async fn stdin_false_reads_eof() {
    let agent = Agent::start().await;
    let mut frames = agent
        .start_process(json!({"process": {"cmd": "/bin/cat"}, "stdin": false}))
        .await;
    started(&mut frames).await;
    let out = frames.finish().await;
    assert_eq!(out.exit_code(), 0);
    assert!(out.stdout.is_empty());
}

#[tokio::test]
async fn list_and_kill() {
    let agent = Agent::start().await;
    let mut frames = agent
        .start_process(json!({"process": {"cmd": "/bin/sleep", "args": ["100"]}, "tag": "sleeper", "stdin": false}))
        .await;
    let pid = started(&mut frames).await;
    let list = agent.unary_ok("process.Process/List", json!({})).await;
    let entry = list["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"].as_u64() == Some(pid))
        .unwrap_or_else(|| panic!("pid {pid} not listed: {list}"))
        .clone();
    assert_eq!(entry["tag"], "sleeper");
    assert_eq!(entry["config"]["cmd"], "/bin/sleep");

    agent
        .unary_ok(
            "process.Process/SendSignal",
            json!({"process": {"tag": "sleeper"}, "signal": "SIGNAL_SIGKILL"}),
        )
        .await;
    let out = frames.finish().await;
    let end = out.end.unwrap();
    assert_eq!(end["exitCode"], -1);
    assert_eq!(end["status"], "signal: killed");
    assert!(end.get("exited").is_none());

    agent
        .unary_not_found(
            "process.Process/SendSignal",
            json!({"process": {"pid": pid}, "signal": "SIGNAL_SIGTERM"}),
        )
        .await;
}

#[tokio::test]
async fn connect_reattaches_after_disconnect() {
    let agent = Agent::start().await;
    let mut frames = agent
        .start_process(json!({"process": {"cmd": "/bin/bash", "args": ["-c", "read x; echo got $x"]}, "stdin": true}))
        .await;
    let pid = started(&mut frames).await;
    drop(frames);
    let mut attached = agent
        .stream(
            "process.Process/Connect",
            json!({"process": {"pid": pid}}),
            &[],
        )
        .await;
    assert_eq!(started(&mut attached).await, pid);
    agent.send_stdin(pid, b"again\n").await;
    let out = attached.finish().await;
    assert_eq!(out.stdout, b"got again\n");
    assert_eq!(out.exit_code(), 0);

    let mut gone = agent
        .stream(
            "process.Process/Connect",
            json!({"process": {"pid": 999_999}}),
            &[],
        )
        .await;
    match gone.next().await {
        Some(Frame::EndStream(v)) => assert_eq!(v["error"]["code"], "not_found"),
        other => panic!("expected not_found end frame, got {other:?}"),
    }
}

#[tokio::test]
async fn pty_input_output_and_resize() {
    let agent = Agent::start().await;
    let msg = json!({
        "process": {"cmd": "/bin/sh", "envs": {"TERM": "xterm"}},
        "pty": {"size": {"cols": 100, "rows": 30}},
        "stdin": false,
    });
    let mut frames = agent.stream("process.Process/Start", msg, &[]).await;
    let pid = started(&mut frames).await;
    agent
        .unary_ok(
            "process.Process/Update",
            json!({"process": {"pid": pid}, "pty": {"size": {"cols": 120, "rows": 40}}}),
        )
        .await;
    agent
        .unary_ok(
            "process.Process/SendInput",
            json!({"process": {"pid": pid}, "input": {"pty": b64(b"stty size; test -t 0 && echo is-a-tty; exit 0\n")}}),
        )
        .await;
    let out = frames.finish().await;
    let text = String::from_utf8_lossy(&out.pty);
    assert!(
        text.contains("40 120"),
        "terminal size not applied: {text:?}"
    );
    assert!(text.contains("is-a-tty"), "{text:?}");
    assert!(out.stdout.is_empty());
    assert_eq!(out.exit_code(), 0);
}

#[tokio::test]
async fn deadline_kills_the_process() {
    let agent = Agent::start().await;
    let mut frames = agent
        .stream(
            "process.Process/Start",
            json!({"process": {"cmd": "/bin/sleep", "args": ["100"]}, "stdin": false}),
            &[("connect-timeout-ms", "500")],
        )
        .await;
    let pid = started(&mut frames).await;
    let out = frames.finish().await;
    assert_eq!(
        out.end_stream.as_ref().unwrap()["error"]["code"],
        "deadline_exceeded",
        "{out:?}"
    );
    // The process must be gone, not merely detached.
    let mut gone = false;
    for _ in 0..50 {
        let (_, list) = agent.unary("process.Process/List", json!({})).await;
        let listed = list["processes"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(|p| p["pid"].as_u64() == Some(pid)));
        if !listed {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "process {pid} survived its deadline");
}

#[tokio::test]
async fn keepalive_events_are_sent() {
    let agent = Agent::start().await;
    let mut frames = agent
        .stream(
            "process.Process/Start",
            bash("sleep 2.5"),
            &[("keepalive-ping-interval", "1")],
        )
        .await;
    started(&mut frames).await;
    let out = frames.finish().await;
    assert!(out.keepalives >= 2, "{out:?}");
    assert_eq!(out.exit_code(), 0);
}

#[tokio::test]
async fn background_descendant_does_not_hold_the_stream() {
    let agent = Agent::start().await;
    let started_at = std::time::Instant::now();
    let mut frames = agent
        .stream("process.Process/Start", bash("sleep 30 & echo $!"), &[])
        .await;
    started(&mut frames).await;
    let out = frames.finish().await;
    let child: i32 = String::from_utf8(out.stdout.clone())
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(out.exit_code(), 0);
    assert!(started_at.elapsed() < Duration::from_secs(10));
    // SAFETY: kill has no memory-safety preconditions; the pid is the sleep this test started.
    unsafe { libc::kill(child, libc::SIGKILL) };
}

#[tokio::test]
async fn stream_input_feeds_stdin() {
    let agent = Agent::start().await;
    let mut frames = agent
        .start_process(json!({"process": {"cmd": "/bin/cat"}, "stdin": true}))
        .await;
    let pid = started(&mut frames).await;
    let mut body = Vec::new();
    body.extend_from_slice(&envelope(0, &json!({"start": {"process": {"pid": pid}}})));
    body.extend_from_slice(&envelope(
        0,
        &json!({"data": {"input": {"stdin": b64(b"one ")}}}),
    ));
    body.extend_from_slice(&envelope(0, &json!({"keepalive": {}})));
    body.extend_from_slice(&envelope(
        0,
        &json!({"data": {"input": {"stdin": b64(b"two\n")}}}),
    ));
    body.extend_from_slice(&envelope(2, &json!({})));
    let req = agent
        .request("POST", "/process.Process/StreamInput")
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(full(body))
        .unwrap();
    let (status, _, resp) = agent.send(req).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&resp));
    agent.close_stdin(pid).await;
    let out = frames.finish().await;
    assert_eq!(out.stdout, b"one two\n");
}
