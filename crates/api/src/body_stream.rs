//! Request and response bodies as streams, so uploads go to disk as they arrive and
//! downloads leave the disk as the client takes them: the server holds a chunk at a time,
//! whatever the size.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use axum::body::{Body, HttpBody};
use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

/// Bytes read from a file per chunk of a response.
const READ_CHUNK: usize = 1 << 20;

/// A request body read as bytes. A body that breaks off (the client went away) is an error,
/// never a short end, so a cut upload is never kept as if whole.
pub(crate) struct BodyReader {
    body: Body,
    pending: Bytes,
}

impl BodyReader {
    pub(crate) fn new(body: Body) -> Self {
        Self {
            body,
            pending: Bytes::new(),
        }
    }
}

impl AsyncRead for BodyReader {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            if !self.pending.is_empty() {
                let n = self.pending.len().min(buf.remaining());
                let chunk = self.pending.split_to(n);
                buf.put_slice(&chunk);
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) => return Poll::Ready(Err(io::Error::other(e))),
                // Trailers carry no bytes of the upload.
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.pending = data;
                    }
                }
            }
        }
    }
}

/// A response body of exactly `size` bytes of `reader`, read a chunk at a time as the
/// client takes them. A reader that ends early (the file shrank meanwhile) fails the body,
/// so the client sees a cut transfer rather than a short file.
pub(crate) fn sized_body<R>(reader: R, size: u64) -> Body
where
    R: AsyncRead + Send + Unpin + 'static,
{
    let chunks =
        futures_util::stream::unfold((reader.take(size), size), |(mut reader, left)| async move {
            if left == 0 {
                return None;
            }
            let want = usize::try_from(left).unwrap_or(READ_CHUNK).min(READ_CHUNK);
            let mut chunk = BytesMut::with_capacity(want);
            match reader.read_buf(&mut chunk).await {
                Ok(0) => Some((
                    Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!("the file ended {left} bytes before its size"),
                    )),
                    (reader, 0),
                )),
                Ok(n) => Some((Ok(chunk.freeze()), (reader, left - n as u64))),
                Err(e) => Some((Err(e), (reader, 0))),
            }
        });
    Body::from_stream(chunks)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_body_reads_back_as_its_bytes_across_frames() {
        let frames: Vec<Result<Bytes, io::Error>> = vec![
            Ok(Bytes::from_static(b"hello ")),
            Ok(Bytes::new()),
            Ok(Bytes::from_static(b"world")),
        ];
        let mut reader = BodyReader::new(Body::from_stream(futures_util::stream::iter(frames)));
        let mut small = [0u8; 4];
        assert_eq!(reader.read(&mut small).await.unwrap(), 4);
        assert_eq!(&small, b"hell");
        let mut rest = Vec::new();
        reader.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"o world");
    }

    #[tokio::test]
    async fn a_body_that_breaks_off_is_an_error_not_an_end() {
        let frames: Vec<Result<Bytes, io::Error>> = vec![
            Ok(Bytes::from_static(b"part")),
            Err(io::Error::other("connection reset")),
        ];
        let mut reader = BodyReader::new(Body::from_stream(futures_util::stream::iter(frames)));
        let mut all = Vec::new();
        let err = reader.read_to_end(&mut all).await.unwrap_err();
        assert!(err.to_string().contains("connection reset"), "{err}");
    }

    #[tokio::test]
    async fn a_sized_body_sends_its_size_in_bounded_chunks() {
        let data: Vec<u8> = (0..(READ_CHUNK * 2 + 10)).map(|i| i as u8).collect();
        let mut body = sized_body(io::Cursor::new(data.clone()), data.len() as u64);
        let mut got = Vec::new();
        while let Some(frame) = body.frame().await {
            let chunk = frame.unwrap().into_data().unwrap();
            assert!(
                chunk.len() <= READ_CHUNK,
                "a chunk of {} bytes",
                chunk.len()
            );
            got.extend_from_slice(&chunk);
        }
        assert_eq!(got, data);
        // Bytes past the size (written after the file was opened) are not sent.
        let body = sized_body(io::Cursor::new(b"0123456789".to_vec()), 4);
        assert_eq!(body.collect().await.unwrap().to_bytes(), &b"0123"[..]);
    }

    #[tokio::test]
    async fn a_sized_body_whose_file_shrank_fails() {
        let body = sized_body(io::Cursor::new(b"abc".to_vec()), 10);
        let err = body.collect().await.unwrap_err();
        assert!(err.to_string().contains("7 bytes before"), "{err}");
    }
}
