//! A sandbox's log: its lifecycle events, written by the server, and the lines of its agent's
//! log, read from the host as the agent writes them.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::builds::LogLevel;
use crate::store::StoreError;

pub use crate::model::sandbox_logs::{SandboxLogEntry, SandboxLogQuery};

#[derive(Debug, thiserror::Error)]
pub enum SandboxLogsError {
    #[error("sandbox '{0}' not found")]
    NotFound(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Removes terminal colour sequences (`ESC [ … letter`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

fn parse_level(s: &str) -> Option<LogLevel> {
    Some(match s.to_ascii_lowercase().as_str() {
        "trace" | "debug" => LogLevel::Debug,
        "info" | "notice" => LogLevel::Info,
        "warn" | "warning" => LogLevel::Warn,
        "error" | "err" | "fatal" | "panic" | "critical" => LogLevel::Error,
        _ => return None,
    })
}

fn json_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A JSON log line: `tracing`'s JSON format (`fields.message`, `target`) or the common flat
/// shapes (`msg`/`message`, `level`/`severity`, `time`/`ts`/`timestamp`).
fn parse_json_line(object: serde_json::Map<String, serde_json::Value>) -> SandboxLogEntry {
    let mut level = None;
    let mut message = None;
    let mut at = None;
    let mut fields = BTreeMap::new();
    let mut flat = object;
    if let Some(serde_json::Value::Object(nested)) = flat.remove("fields") {
        flat.extend(nested);
    }
    for (key, value) in flat {
        match key.as_str() {
            "level" | "severity" | "lvl" if level.is_none() => {
                level = parse_level(&json_text(&value));
            }
            "msg" | "message" if message.is_none() => message = Some(json_text(&value)),
            "time" | "ts" | "timestamp" if at.is_none() => {
                at = match &value {
                    serde_json::Value::String(s) => DateTime::parse_from_rfc3339(s)
                        .ok()
                        .map(|t| t.with_timezone(&Utc)),
                    serde_json::Value::Number(n) => n
                        .as_f64()
                        .and_then(|secs| DateTime::from_timestamp_micros((secs * 1e6) as i64)),
                    _ => None,
                };
            }
            _ => {
                fields.insert(key, json_text(&value));
            }
        }
    }
    SandboxLogEntry {
        at: at.unwrap_or_default(),
        level: level.unwrap_or(LogLevel::Info),
        message: message.unwrap_or_default(),
        fields,
    }
}

/// Splits `text` at whitespace outside double quotes, keeping each token's byte offset.
fn tokens(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        if start.is_none() {
            if c.is_whitespace() {
                continue;
            }
            start = Some(i);
        }
        if escaped {
            escaped = false;
        } else if c == '\\' && quoted {
            escaped = true;
        } else if c == '"' {
            quoted = !quoted;
        } else if c.is_whitespace()
            && !quoted
            && let Some(s) = start.take()
        {
            out.push((s, &text[s..i]));
        }
    }
    if let Some(s) = start {
        out.push((s, &text[s..]));
    }
    out
}

fn as_field(token: &str) -> Option<(&str, String)> {
    let (key, value) = token.split_once('=')?;
    let valid_key = !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if !valid_key {
        return None;
    }
    let value = match value.strip_prefix('"').and_then(|v| v.strip_suffix('"')) {
        Some(inner) => inner.replace("\\\"", "\""),
        None => value.to_owned(),
    };
    Some((key, value))
}

/// A line in `tracing`'s default text format: `<time> <LEVEL> <target>: <message> k=v …`.
/// The trailing `k=v` tokens are fields; everything between the target and them is the
/// message.
fn parse_text_line(line: &str) -> Option<SandboxLogEntry> {
    let (time, rest) = line.split_once(char::is_whitespace)?;
    let at = DateTime::parse_from_rfc3339(time).ok()?.with_timezone(&Utc);
    let (level, rest) = rest.trim_start().split_once(char::is_whitespace)?;
    let level = parse_level(level)?;
    let rest = rest.trim_start();
    let mut fields = BTreeMap::new();
    let body = match rest.split_once(": ") {
        Some((target, body)) if !target.contains(char::is_whitespace) => {
            fields.insert("target".to_owned(), target.to_owned());
            body
        }
        _ => rest,
    };
    // Fields follow the message; a field printed with `%` may hold spaces, so words after a
    // field that are not fields themselves continue its value.
    let tokens = tokens(body);
    let mut message_end = body.len();
    let mut last_key: Option<String> = None;
    for (i, (offset, token)) in tokens.iter().enumerate() {
        match as_field(token) {
            Some((key, value)) if i > 0 => {
                if last_key.is_none() {
                    message_end = *offset;
                }
                fields.insert(key.to_owned(), value);
                last_key = Some(key.to_owned());
            }
            _ => {
                if let Some(key) = &last_key
                    && let Some(value) = fields.get_mut(key)
                {
                    value.push(' ');
                    value.push_str(token);
                }
            }
        }
    }
    Some(SandboxLogEntry {
        at,
        level,
        message: body[..message_end].trim_end().to_owned(),
        fields,
    })
}

/// Reads one line of an agent's log as well as it can: JSON, `tracing` text, or else the
/// plain line at `now`. `None` for blank lines.
pub fn parse_agent_line(raw: &str, now: DateTime<Utc>) -> Option<SandboxLogEntry> {
    let line = strip_ansi(raw);
    let line = line.trim();
    if line.is_empty() {
        return None;
    }
    let mut entry = match serde_json::from_str::<serde_json::Value>(line) {
        Ok(serde_json::Value::Object(object)) => {
            let mut entry = parse_json_line(object);
            if entry.at == DateTime::<Utc>::default() {
                entry.at = now;
            }
            entry
        }
        _ => parse_text_line(line).unwrap_or_else(|| SandboxLogEntry {
            at: now,
            // A process that dies of an error says so on its last line.
            level: if line.starts_with("Error:") || line.contains("panicked at") {
                LogLevel::Error
            } else {
                LogLevel::Info
            },
            message: line.to_owned(),
            fields: BTreeMap::new(),
        }),
    };
    if entry.message.is_empty() {
        entry.message = line.to_owned();
    }
    entry.fields.insert("logger".into(), "agent".into());
    Some(entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).expect("time")
    }

    #[test]
    fn tracing_text_lines_give_time_level_message_and_fields() {
        let line = "2026-11-23T11:09:51.123456Z  INFO sandbar_agent::process: process started pid=12 cmd=\"bash -c 'x=1'\"";
        let entry = parse_agent_line(line, now()).expect("entry");
        assert_eq!(entry.level, LogLevel::Info);
        assert_eq!(entry.message, "process started");
        assert_eq!(entry.fields["pid"], "12");
        assert_eq!(entry.fields["cmd"], "bash -c 'x=1'");
        assert_eq!(entry.fields["target"], "sandbar_agent::process");
        assert_eq!(entry.fields["logger"], "agent");
        assert_eq!(entry.at.timestamp_micros(), 1_795_432_191_123_456);
    }

    #[test]
    fn coloured_lines_and_messages_with_equals_signs() {
        let line = "\u{1b}[2m2026-11-23T11:09:51Z\u{1b}[0m \u{1b}[33m WARN\u{1b}[0m agent: a=b is not a field here done=yes";
        let entry = parse_agent_line(line, now()).expect("entry");
        assert_eq!(entry.level, LogLevel::Warn);
        assert_eq!(entry.message, "a=b is not a field here");
        assert_eq!(entry.fields["done"], "yes");
        let line = "2026-11-23T11:09:51Z  INFO sandbar_agent::process: process ended pid=5 status=exit status 0";
        let entry = parse_agent_line(line, now()).expect("entry");
        assert_eq!(entry.message, "process ended");
        assert_eq!(entry.fields["status"], "exit status 0");
    }

    #[test]
    fn json_lines_are_read_in_both_common_shapes() {
        let tracing_json = r#"{"timestamp":"2026-11-23T11:09:51Z","level":"ERROR","fields":{"message":"boom","code":3},"target":"x"}"#;
        let entry = parse_agent_line(tracing_json, now()).expect("entry");
        assert_eq!(entry.level, LogLevel::Error);
        assert_eq!(entry.message, "boom");
        assert_eq!(entry.fields["code"], "3");
        assert_eq!(entry.fields["target"], "x");
        let flat = r#"{"msg":"hi","lvl":"debug","user":"u"}"#;
        let entry = parse_agent_line(flat, now()).expect("entry");
        assert_eq!(entry.level, LogLevel::Debug);
        assert_eq!(entry.message, "hi");
        assert_eq!(entry.at, now());
    }

    #[test]
    fn plain_lines_keep_their_text() {
        let entry = parse_agent_line("Error: cannot bind", now()).expect("entry");
        assert_eq!(entry.level, LogLevel::Error);
        assert_eq!(entry.message, "Error: cannot bind");
        assert_eq!(entry.at, now());
        assert!(parse_agent_line("   ", now()).is_none());
        let entry = parse_agent_line("just words", now()).expect("entry");
        assert_eq!(entry.level, LogLevel::Info);
    }

    #[test]
    fn the_v1_line_is_json_with_level_and_logger() {
        let entry = SandboxLogEntry::event(now(), LogLevel::Info, "sandbox created", &[]);
        let line: serde_json::Value = serde_json::from_str(&entry.line()).expect("json");
        assert_eq!(line["level"], "info");
        assert_eq!(line["logger"], "lifecycle");
        assert_eq!(line["msg"], "sandbox created");
    }
}
