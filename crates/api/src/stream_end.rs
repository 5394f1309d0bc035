//! Connect server streams whose agent connection ends before the stream does.
//!
//! When a sandbox is killed, times out or pauses while a client streams a command's output,
//! the agent's side of the connection goes away mid-response. Passing that on as a cut
//! chunked body (or an HTTP/2 reset) leaves the SDKs with a transport error they cannot read
//! ("unexpected EOF during chunk size line"). Instead the edge ends the response as envd's own
//! proxy does: with a Connect end-of-stream message carrying `unavailable` and a message that
//! says whether the sandbox is gone ("The sandbox was not found: …", which the SDKs turn into
//! their error for a sandbox that is no longer running).
//!
//! Only whole messages are passed on, so the end-of-stream message never lands in the middle
//! of a half-sent one; the agent writes each message at once, so holding back the partial tail
//! delays nothing.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};

/// Connect's envelope: one flags byte and a big-endian length.
const ENVELOPE_HEADER: usize = 5;
/// Flag of the end-of-stream message.
const END_STREAM: u8 = 0x02;
/// Messages larger than this are passed on as they arrive instead of held until whole (the
/// SDKs refuse messages over 4 MiB anyway); such a stream can only be cut if its agent goes.
const HOLD_LIMIT: usize = 4 << 20;

/// Whether a response of this content type is a Connect stream (as opposed to a unary call or
/// a file transfer, which a client sees cut and probes the sandbox about).
pub(crate) fn is_connect_stream(content_type: Option<&str>) -> bool {
    content_type.is_some_and(|t| {
        t.trim_start()
            .to_ascii_lowercase()
            .starts_with("application/connect+")
    })
}

/// The end-of-stream message of a stream that failed with code `unavailable`.
pub(crate) fn end_stream_error(message: &str) -> Bytes {
    let body = serde_json::json!({
        "error": { "code": "unavailable", "message": message }
    })
    .to_string();
    let mut frame = BytesMut::with_capacity(ENVELOPE_HEADER + body.len());
    frame.put_u8(END_STREAM);
    // The message is a short sentence: its length always fits.
    frame.put_u32(u32::try_from(body.len()).unwrap_or(u32::MAX));
    frame.put_slice(body.as_bytes());
    frame.freeze()
}

/// Splits a stream of bytes into whole Connect messages.
#[derive(Debug, Default)]
struct Envelopes {
    partial: BytesMut,
    /// Bytes still to pass on unheld of a message over [`HOLD_LIMIT`].
    passing: usize,
    /// Whether the upstream sent its own end-of-stream message.
    ended: bool,
}

impl Envelopes {
    /// Takes `data` and returns what may be passed on: every message it completes (and what
    /// has come of an oversized one).
    fn push(&mut self, data: Bytes) -> Bytes {
        self.partial.extend_from_slice(&data);
        let mut whole = 0;
        loop {
            if self.passing > 0 {
                let n = self.passing.min(self.partial.len() - whole);
                whole += n;
                self.passing -= n;
                if self.passing > 0 {
                    break;
                }
            }
            let rest = &self.partial[whole..];
            if rest.len() < ENVELOPE_HEADER {
                break;
            }
            if rest[0] & END_STREAM != 0 {
                self.ended = true;
            }
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let size = ENVELOPE_HEADER + len;
            if len > HOLD_LIMIT {
                self.passing = size;
                continue;
            }
            if rest.len() < size {
                break;
            }
            whole += size;
        }
        self.partial.split_to(whole).freeze()
    }

    /// Whether the stream may end here as it is: its end-of-stream message went through whole.
    fn complete(&self) -> bool {
        self.ended && self.partial.is_empty() && self.passing == 0
    }

    /// Whether an end-of-stream message of ours would start at a message boundary.
    fn at_boundary(&self) -> bool {
        self.passing == 0
    }
}

/// A Connect stream from an agent that, should the agent's side end first, ends with the
/// message `on_break` gives at that moment.
pub(crate) struct ConnectStream<B> {
    upstream: B,
    envelopes: Envelopes,
    on_break: Option<Box<dyn FnOnce() -> String + Send>>,
    done: bool,
}

impl<B> ConnectStream<B> {
    pub(crate) fn new(upstream: B, on_break: impl FnOnce() -> String + Send + 'static) -> Self {
        Self {
            upstream,
            envelopes: Envelopes::default(),
            on_break: Some(Box::new(on_break)),
            done: false,
        }
    }

    /// The last frame of a stream whose upstream stopped (`error`, when it failed) before
    /// the stream was complete; `None` when it was.
    fn finish(&mut self, error: Option<&dyn std::fmt::Display>) -> Option<Bytes> {
        self.done = true;
        if self.envelopes.complete() {
            return None;
        }
        let message = self.on_break.take().map(|f| f()).unwrap_or_default();
        tracing::debug!(
            error = error.map(tracing::field::display),
            %message,
            "a stream from an agent ended early; ending it for the client"
        );
        if !self.envelopes.at_boundary() {
            // Part of an oversized message went out already: nothing can follow it that the
            // client would read as a message.
            return None;
        }
        Some(end_stream_error(&message))
    }
}

impl<B> Body for ConnectStream<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            let last = match Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        let whole = this.envelopes.push(data);
                        if whole.has_remaining() {
                            return Poll::Ready(Some(Ok(Frame::data(whole))));
                        }
                        continue;
                    }
                    // Connect streams carry no trailers; whatever comes is passed on.
                    Err(frame) => return Poll::Ready(Some(Ok(frame))),
                },
                Poll::Ready(Some(Err(e))) => this.finish(Some(&e)),
                Poll::Ready(None) => this.finish(None),
            };
            return Poll::Ready(last.map(|end| Ok(Frame::data(end))));
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, StreamBody};

    fn message(flags: u8, body: &str) -> Vec<u8> {
        let mut m = vec![flags];
        m.extend_from_slice(&u32::try_from(body.len()).expect("short").to_be_bytes());
        m.extend_from_slice(body.as_bytes());
        m
    }

    type Chunk = Result<Frame<Bytes>, std::io::Error>;

    async fn collect(chunks: Vec<Chunk>) -> Result<Vec<u8>, std::io::Error> {
        let upstream = StreamBody::new(futures_util::stream::iter(chunks));
        let body = ConnectStream::new(upstream, || "The sandbox was not found: gone".to_owned());
        Ok(body.collect().await?.to_bytes().to_vec())
    }

    fn data(bytes: &[u8]) -> Chunk {
        Ok(Frame::data(Bytes::copy_from_slice(bytes)))
    }

    fn cut() -> Chunk {
        Err(std::io::Error::other(
            "unexpected EOF during chunk size line",
        ))
    }

    fn parse(mut bytes: &[u8]) -> Vec<(u8, serde_json::Value)> {
        let mut out = Vec::new();
        while !bytes.is_empty() {
            let len = u32::from_be_bytes(bytes[1..5].try_into().expect("4 bytes")) as usize;
            let json = serde_json::from_slice(&bytes[5..5 + len]).expect("json");
            out.push((bytes[0], json));
            bytes = &bytes[5 + len..];
        }
        out
    }

    #[tokio::test]
    async fn a_complete_stream_passes_unchanged() {
        let mut all = message(0, r#"{"event":{"start":{"pid":7}}}"#);
        all.extend(message(END_STREAM, "{}"));
        // Split at awkward places: inside the header, inside the body, across messages.
        let chunks = vec![
            data(&all[..3]),
            data(&all[3..10]),
            data(&all[10..40]),
            data(&all[40..]),
        ];
        assert_eq!(collect(chunks).await.expect("body"), all);
    }

    #[tokio::test]
    async fn a_cut_stream_ends_with_an_unavailable_end_of_stream_message() {
        let first = message(0, r#"{"event":{"data":{"stdout":"MQo="}}}"#);
        let second = message(0, r#"{"event":{"data":{"stdout":"Mgo="}}}"#);
        let chunks = vec![data(&first), data(&second[..9]), cut()];
        let got = parse(&collect(chunks).await.expect("body"));
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0].0, 0);
        assert_eq!(got[1].0, END_STREAM);
        assert_eq!(got[1].1["error"]["code"], "unavailable");
        assert_eq!(
            got[1].1["error"]["message"],
            "The sandbox was not found: gone"
        );
    }

    #[tokio::test]
    async fn a_stream_closed_without_its_end_is_ended_too() {
        let first = message(0, "{}");
        let got = parse(&collect(vec![data(&first)]).await.expect("body"));
        assert_eq!(got.len(), 2);
        assert_eq!(got[1].1["error"]["code"], "unavailable");
    }

    #[tokio::test]
    async fn a_cut_after_the_end_adds_nothing() {
        let mut all = message(0, "{}");
        all.extend(message(END_STREAM, "{}"));
        assert_eq!(collect(vec![data(&all), cut()]).await.expect("body"), all);
    }

    #[test]
    fn oversized_messages_are_passed_on_as_they_come() {
        let mut envelopes = Envelopes::default();
        let len = HOLD_LIMIT + 10;
        let mut head = vec![0u8];
        head.extend_from_slice(&u32::try_from(len).expect("fits").to_be_bytes());
        head.extend_from_slice(&[b'x'; 100]);
        assert_eq!(envelopes.push(Bytes::from(head)).len(), 105);
        assert!(!envelopes.at_boundary());
        let rest = vec![b'x'; len - 100];
        assert_eq!(envelopes.push(Bytes::from(rest)).len(), len - 100);
        assert!(envelopes.at_boundary());
        let tail = message(END_STREAM, "{}");
        assert_eq!(envelopes.push(Bytes::from(tail.clone())).len(), tail.len());
        assert!(envelopes.complete());
    }

    #[tokio::test]
    async fn a_cut_inside_a_message_passed_on_unheld_adds_nothing_after_it() {
        let mut head = vec![0u8];
        head.extend_from_slice(&u32::try_from(HOLD_LIMIT + 1).expect("fits").to_be_bytes());
        head.extend_from_slice(b"{\"event\"");
        let got = collect(vec![data(&head), cut()]).await.expect("body");
        assert_eq!(got, head);
    }

    #[test]
    fn only_connect_streams_are_framed() {
        assert!(is_connect_stream(Some("application/connect+json")));
        assert!(is_connect_stream(Some("application/connect+proto")));
        assert!(!is_connect_stream(Some("application/json")));
        assert!(!is_connect_stream(Some("application/octet-stream")));
        assert!(!is_connect_stream(None));
    }
}
