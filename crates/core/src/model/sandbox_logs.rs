//! A sandbox's log lines as recorded, and what a read of them asks for.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use super::builds::LogLevel;

/// One line of a sandbox's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxLogEntry {
    pub at: DateTime<Utc>,
    pub level: LogLevel,
    pub message: String,
    /// Always holds `logger`: `lifecycle` for the server's events, `agent` for agent lines.
    pub fields: BTreeMap<String, String>,
}

impl SandboxLogEntry {
    pub(crate) fn event(
        at: DateTime<Utc>,
        level: LogLevel,
        message: &str,
        fields: &[(&str, String)],
    ) -> Self {
        let mut all: BTreeMap<String, String> = fields
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect();
        all.insert("logger".into(), "lifecycle".into());
        Self {
            at,
            level,
            message: message.to_owned(),
            fields: all,
        }
    }

    /// The entry as one JSON object (`level`, `msg` and the fields), the `line` of E2B's v1
    /// log response that the `e2b sandbox logs` command parses.
    pub fn line(&self) -> String {
        let mut object = serde_json::Map::new();
        for (k, v) in &self.fields {
            object.insert(k.clone(), serde_json::Value::String(v.clone()));
        }
        object.insert("level".into(), self.level.as_str().into());
        object.insert("msg".into(), self.message.clone().into());
        serde_json::Value::Object(object).to_string()
    }
}

/// Which lines of a sandbox's log to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxLogQuery {
    /// Forward: lines at or after this millisecond; backward: at or before it.
    pub cursor_ms: Option<i64>,
    /// Oldest first; otherwise newest first.
    pub forward: bool,
    pub limit: u32,
    pub min_level: Option<LogLevel>,
    /// Lines whose message contains this, case-sensitively.
    pub search: Option<String>,
}

impl Default for SandboxLogQuery {
    fn default() -> Self {
        Self {
            cursor_ms: None,
            forward: true,
            limit: 1000,
            min_level: None,
            search: None,
        }
    }
}
