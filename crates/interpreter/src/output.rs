//! What `POST /execute` streams back: one JSON object a line, in the shape E2B's code
//! interpreter SDKs parse, made from the Jupyter messages a kernel publishes for one request.

use chrono::{DateTime, Utc};
use jupyter_protocol::{ExecutionState, JupyterMessage, JupyterMessageContent, Stdio};
use serde_json::{Map, Value, json};

/// MIME types the SDKs' `Result` has a field for; everything else goes to `extra`.
const RESULT_FIELDS: [(&str, &str); 12] = [
    ("text/plain", "text"),
    ("text/html", "html"),
    ("text/markdown", "markdown"),
    ("image/svg+xml", "svg"),
    ("image/png", "png"),
    ("image/jpeg", "jpeg"),
    ("application/pdf", "pdf"),
    ("text/latex", "latex"),
    ("application/json", "json"),
    ("application/javascript", "javascript"),
    // Written by the IPython formatters the template installs: a DataFrame as columns, a
    // matplotlib figure as the chart e2b-charts extracts.
    ("e2b/data", "data"),
    ("e2b/chart", "chart"),
];

/// One line of an execution's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Output {
    NumberOfExecutions(u64),
    Stdout {
        text: String,
        timestamp: i64,
    },
    Stderr {
        text: String,
        timestamp: i64,
    },
    Result {
        main: bool,
        bundle: Map<String, Value>,
    },
    Error {
        name: String,
        value: String,
        traceback: String,
    },
    EndOfExecution,
    /// Sent while a long execution prints nothing, so a client that left is noticed.
    Keepalive,
}

impl Output {
    pub fn to_line(&self) -> String {
        let value = match self {
            Output::NumberOfExecutions(count) => {
                json!({"type": "number_of_executions", "execution_count": count})
            }
            Output::Stdout { text, timestamp } => {
                json!({"type": "stdout", "text": text, "timestamp": timestamp})
            }
            Output::Stderr { text, timestamp } => {
                json!({"type": "stderr", "text": text, "timestamp": timestamp})
            }
            Output::Result { main, bundle } => result_value(*main, bundle),
            Output::Error {
                name,
                value,
                traceback,
            } => json!({"type": "error", "name": name, "value": value, "traceback": traceback}),
            Output::EndOfExecution => json!({"type": "end_of_execution"}),
            Output::Keepalive => json!({"type": "keepalive"}),
        };
        let mut line = value.to_string();
        line.push('\n');
        line
    }
}

fn result_value(main: bool, bundle: &Map<String, Value>) -> Value {
    let mut out = Map::new();
    out.insert("type".into(), "result".into());
    let mut extra = Map::new();
    for (mime, value) in bundle {
        match RESULT_FIELDS.iter().find(|(m, _)| m == mime) {
            Some((_, "text")) => {
                // A string's repr is quoted; E2B's server shows the string itself.
                let text = value.as_str().map(|t| {
                    t.strip_prefix('\'')
                        .and_then(|t| t.strip_suffix('\''))
                        .unwrap_or(t)
                });
                out.insert("text".into(), text.map_or(value.clone(), Value::from));
            }
            Some((_, field)) => {
                out.insert((*field).into(), value.clone());
            }
            None => {
                extra.insert(mime.clone(), value.clone());
            }
        }
    }
    if !extra.is_empty() {
        out.insert("extra".into(), Value::Object(extra));
    }
    out.insert("is_main_result".into(), main.into());
    Value::Object(out)
}

fn nanos(date: &DateTime<Utc>) -> i64 {
    date.timestamp_nanos_opt().unwrap_or_default()
}

/// The lines a message published for an execution adds, and whether the execution is over
/// (the kernel went idle after it).
pub fn map_message(message: &JupyterMessage) -> (Option<Output>, bool) {
    let timestamp = nanos(&message.header.date);
    match &message.content {
        JupyterMessageContent::ExecuteInput(input) => (
            Some(Output::NumberOfExecutions(
                u64::try_from(input.execution_count.value()).unwrap_or_default(),
            )),
            false,
        ),
        JupyterMessageContent::StreamContent(stream) => {
            let text = stream.text.clone();
            let output = match stream.name {
                Stdio::Stdout => Output::Stdout { text, timestamp },
                Stdio::Stderr => Output::Stderr { text, timestamp },
            };
            (Some(output), false)
        }
        JupyterMessageContent::ExecuteResult(result) => {
            (Some(bundle_output(true, &result.data)), false)
        }
        JupyterMessageContent::DisplayData(display) => {
            (Some(bundle_output(false, &display.data)), false)
        }
        JupyterMessageContent::ErrorOutput(error) => (
            Some(Output::Error {
                name: error.ename.clone(),
                value: error.evalue.clone(),
                traceback: error.traceback.join("\n"),
            }),
            false,
        ),
        JupyterMessageContent::Status(status) => {
            (None, status.execution_state == ExecutionState::Idle)
        }
        _ => (None, false),
    }
}

fn bundle_output(main: bool, media: &jupyter_protocol::Media) -> Output {
    let bundle = match serde_json::to_value(media) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    };
    Output::Result { main, bundle }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use jupyter_protocol::{
        DisplayData, ErrorOutput, ExecuteInput, ExecuteResult, ExecutionCount, Media, MediaType,
        Status, StreamContent,
    };

    fn message(content: impl Into<JupyterMessageContent>) -> JupyterMessage {
        JupyterMessage::new(content.into(), None)
    }

    fn line(output: &Output) -> Value {
        let text = output.to_line();
        assert!(text.ends_with('\n') && !text[..text.len() - 1].contains('\n'));
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn execute_input_counts_executions() {
        let (out, done) = map_message(&message(ExecuteInput {
            code: "1+1".into(),
            execution_count: ExecutionCount::new(7),
        }));
        assert!(!done);
        assert_eq!(
            line(&out.unwrap()),
            json!({"type": "number_of_executions", "execution_count": 7})
        );
    }

    #[test]
    fn streams_become_stdout_and_stderr_with_a_timestamp() {
        let msg = message(StreamContent {
            name: Stdio::Stderr,
            text: "oops\n".into(),
        });
        let expected = msg.header.date.timestamp_nanos_opt().unwrap();
        let (out, _) = map_message(&msg);
        let value = line(&out.unwrap());
        assert_eq!(value["type"], "stderr");
        assert_eq!(value["text"], "oops\n");
        assert_eq!(value["timestamp"], expected);
        let (out, _) = map_message(&message(StreamContent {
            name: Stdio::Stdout,
            text: "hi\n".into(),
        }));
        assert_eq!(line(&out.unwrap())["type"], "stdout");
    }

    #[test]
    fn mime_bundles_map_to_result_fields_and_extra() {
        let media = Media::new(vec![
            MediaType::Plain("'text'".into()),
            MediaType::Html("<b>x</b>".into()),
            MediaType::Png("iVBOR".into()),
            MediaType::Latex("$x^2$".into()),
            MediaType::Json(serde_json::from_value(json!({"a": 1})).unwrap()),
            MediaType::Other(("e2b/data".into(), json!({"col": [1, 2]}))),
            MediaType::Other(("e2b/chart".into(), json!({"type": "line"}))),
            MediaType::Other(("application/x-custom".into(), json!("v"))),
        ]);
        let (out, _) = map_message(&message(ExecuteResult {
            execution_count: ExecutionCount::new(1),
            data: media.clone(),
            metadata: Map::new(),
            transient: None,
        }));
        let value = line(&out.unwrap());
        assert_eq!(value["type"], "result");
        assert_eq!(value["is_main_result"], true);
        assert_eq!(value["text"], "text");
        assert_eq!(value["html"], "<b>x</b>");
        assert_eq!(value["png"], "iVBOR");
        assert_eq!(value["latex"], "$x^2$");
        assert_eq!(value["json"], json!({"a": 1}));
        assert_eq!(value["data"], json!({"col": [1, 2]}));
        assert_eq!(value["chart"], json!({"type": "line"}));
        assert_eq!(value["extra"], json!({"application/x-custom": "v"}));

        let (out, _) = map_message(&message(DisplayData::new(Media::new(vec![
            MediaType::Plain("<Figure>".into()),
        ]))));
        let value = line(&out.unwrap());
        assert_eq!(value["is_main_result"], false);
        assert_eq!(value["text"], "<Figure>");
        assert!(value.get("extra").is_none());
    }

    #[test]
    fn errors_carry_a_joined_traceback() {
        let (out, done) = map_message(&message(ErrorOutput {
            ename: "ZeroDivisionError".into(),
            evalue: "division by zero".into(),
            traceback: vec!["line 1".into(), "line 2".into()],
        }));
        assert!(!done);
        assert_eq!(
            line(&out.unwrap()),
            json!({"type": "error", "name": "ZeroDivisionError", "value": "division by zero", "traceback": "line 1\nline 2"})
        );
    }

    #[test]
    fn idle_ends_the_execution_and_busy_does_not() {
        let (out, done) = map_message(&message(Status::busy()));
        assert!(out.is_none() && !done);
        let (out, done) = map_message(&message(Status::idle()));
        assert!(out.is_none() && done);
        assert_eq!(
            line(&Output::EndOfExecution),
            json!({"type": "end_of_execution"})
        );
    }
}
