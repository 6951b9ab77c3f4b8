//! A tiny HTTP/1.x endpoint that answers `GET /metrics` with one node's metrics.
//!
//! One request per connection: read the request head (at most [`MAX_REQUEST_BYTES`],
//! within [`READ_TIMEOUT`]), answer, close. `GET /metrics` (a query string is ignored)
//! gets 200 with the OpenMetrics text; any other well-formed request 404; a request line
//! that is not HTTP 400; a head larger than the limit 431; a client that sends nothing
//! in time 408. At most [`MAX_CONNECTIONS`] are served at once, later ones are closed
//! at once. Nothing a client sends can make the node panic or grow without bound.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::Scrape;
use crate::error::{Result, RuntimeError};

/// The largest request head read (request line and headers).
pub const MAX_REQUEST_BYTES: usize = 8 * 1024;
/// How long a client may take to send its request head.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long writing the answer may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections served at the same time.
pub const MAX_CONNECTIONS: usize = 16;

/// The content type of the answer: what `prometheus-client`'s text encoder writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A listening metrics endpoint; stops serving when dropped.
#[derive(Debug)]
pub struct MetricsEndpoint {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl MetricsEndpoint {
    /// Binds `listen` (port 0 picks a free port) and serves `metrics` there until dropped.
    /// Logs the bound address.
    pub async fn bind(listen: &str, metrics: Arc<dyn Scrape>) -> Result<MetricsEndpoint> {
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| RuntimeError::io(format!("binding the metrics listen address {listen}"), e))?;
        let addr = listener.local_addr().map_err(|e| RuntimeError::io("reading the metrics address", e))?;
        tracing::info!(addr = %addr, "metrics listening");
        let task = tokio::spawn(accept_loop(listener, metrics));
        Ok(MetricsEndpoint { addr, task })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept_loop(listener: TcpListener, metrics: Arc<dyn Scrape>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let Ok(permit) = slots.clone().try_acquire_owned() else {
                    tracing::debug!(peer = %peer, "metrics connection refused: too many at once");
                    continue; // dropping the stream closes it
                };
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    serve(stream, metrics.as_ref()).await;
                    drop(permit);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "metrics accept failed");
                crate::accept::after_failed_accept().await;
            }
        }
    }
}

/// Serves one connection: one request, one answer.
async fn serve(mut stream: TcpStream, metrics: &dyn Scrape) {
    let head = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "metrics request unreadable");
            return;
        }
        Err(_) => Head::TimedOut,
    };
    let Some(answer) = answer(&head, metrics) else { return };
    let bytes = answer.to_bytes();
    if let Ok(Ok(())) = tokio::time::timeout(WRITE_TIMEOUT, stream.write_all(&bytes)).await {
        let _ = tokio::time::timeout(WRITE_TIMEOUT, stream.shutdown()).await;
        // Closing with unread input would reset the connection, and the client could
        // lose the answer: discard what it still sends, boundedly, until it closes.
        let _ = tokio::time::timeout(LINGER, drain(&mut stream)).await;
    }
}

/// How long a connection is drained after the answer (see [`serve`]).
const LINGER: Duration = Duration::from_secs(1);

/// Reads and discards at most 64 KiB, until the end of stream.
async fn drain(stream: &mut TcpStream) {
    let mut chunk = [0u8; 4096];
    let mut left = 64 * 1024usize;
    while left > 0 {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => left = left.saturating_sub(n),
        }
    }
}

/// What was read of a request.
#[derive(Debug, PartialEq)]
enum Head {
    /// The head up to and including the blank line that ends it (or what came before
    /// the client closed its side).
    Complete(Vec<u8>),
    /// More than [`MAX_REQUEST_BYTES`] without the end of the head.
    TooLarge,
    /// The client closed without sending anything.
    Empty,
    /// Nothing complete arrived within [`READ_TIMEOUT`].
    TimedOut,
}

/// Reads until the blank line that ends the head, the size limit, or the end of stream.
async fn read_head(stream: &mut TcpStream) -> std::io::Result<Head> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(if buf.is_empty() { Head::Empty } else { Head::Complete(buf) });
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = head_end(&buf) {
            buf.truncate(end);
            return Ok(Head::Complete(buf));
        }
        if buf.len() > MAX_REQUEST_BYTES {
            return Ok(Head::TooLarge);
        }
    }
}

/// Where the head ends (after `\r\n\r\n`, or `\n\n` from a lenient client), if it does
/// within the limit.
fn head_end(buf: &[u8]) -> Option<usize> {
    let limit = buf.len().min(MAX_REQUEST_BYTES);
    let window = &buf[..limit];
    let crlf = window.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = window.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// An HTTP answer.
#[derive(Debug, PartialEq)]
struct Answer {
    status: u16,
    reason: &'static str,
    content_type: &'static str,
    body: Vec<u8>,
}

impl Answer {
    fn text(status: u16, reason: &'static str, body: &str) -> Answer {
        Answer { status, reason, content_type: "text/plain; charset=utf-8", body: format!("{body}\n").into_bytes() }
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.status,
            self.reason,
            self.content_type,
            self.body.len()
        )
        .into_bytes();
        out.extend_from_slice(&self.body);
        out
    }
}

/// The answer to what was read; `None`: close without answering (nothing was sent).
fn answer(head: &Head, metrics: &dyn Scrape) -> Option<Answer> {
    let bytes = match head {
        Head::Empty => return None,
        Head::TimedOut => return Some(Answer::text(408, "Request Timeout", "no request within 5 s")),
        Head::TooLarge => {
            return Some(Answer::text(
                431,
                "Request Header Fields Too Large",
                &format!("request head larger than {MAX_REQUEST_BYTES} bytes"),
            ));
        }
        Head::Complete(bytes) => bytes,
    };
    let Some((method, path)) = request_line(bytes) else {
        return Some(Answer::text(400, "Bad Request", "expected an HTTP/1.x request line"));
    };
    if method != "GET" || path != "/metrics" {
        return Some(Answer::text(404, "Not Found", "only GET /metrics is served here"));
    }
    let mut body = String::with_capacity(4096);
    match metrics.encode(&mut body) {
        Ok(()) => Some(Answer { status: 200, reason: "OK", content_type: CONTENT_TYPE, body: body.into_bytes() }),
        Err(_) => Some(Answer::text(500, "Internal Server Error", "the metrics could not be encoded")),
    }
}

/// `(method, path without the query)` of a well-formed `METHOD TARGET HTTP/1.x` line.
fn request_line(head: &[u8]) -> Option<(&str, &str)> {
    let line_end = head.iter().position(|b| *b == b'\n')?;
    let line = std::str::from_utf8(&head[..line_end]).ok()?;
    let line = line.strip_suffix('\r').unwrap_or(line);
    let mut parts = line.split(' ');
    let (method, target, version) = (parts.next()?, parts.next()?, parts.next()?);
    let token = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphabetic());
    if parts.next().is_some() || !token(method) || !target.starts_with('/') || !version.starts_with("HTTP/1.") {
        return None;
    }
    let path = target.split('?').next().unwrap_or(target);
    Some((method, path))
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[derive(Debug)]
    struct Fixed;

    impl Scrape for Fixed {
        fn encode(&self, out: &mut String) -> std::fmt::Result {
            out.write_str("# TYPE x counter\nx_total 7\n# EOF\n")
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime")
    }

    /// Sends `request` to a fresh endpoint, returns everything it answered before closing.
    fn exchange(request: &[u8]) -> String {
        rt().block_on(async {
            let endpoint = MetricsEndpoint::bind("127.0.0.1:0", Arc::new(Fixed)).await.expect("bind");
            let mut s = TcpStream::connect(endpoint.addr()).await.expect("connect");
            // The endpoint may answer before it read all of a large request.
            let _ = s.write_all(request).await;
            let _ = s.shutdown().await;
            let mut out = Vec::new();
            let mut chunk = [0u8; 4096];
            let read = tokio::time::timeout(Duration::from_secs(10), async {
                while let Ok(n @ 1..) = s.read(&mut chunk).await {
                    out.extend_from_slice(&chunk[..n]);
                }
            });
            assert!(read.await.is_ok(), "the endpoint did not answer and close within 10 s");
            String::from_utf8_lossy(&out).into_owned()
        })
    }

    #[test]
    fn get_metrics_is_answered_with_the_encoded_registry() {
        let out = exchange(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(out.contains(&format!("Content-Type: {CONTENT_TYPE}\r\n")), "{out}");
        assert!(out.contains("Content-Length: 33\r\n"), "{out}");
        assert!(out.ends_with("\r\n\r\n# TYPE x counter\nx_total 7\n# EOF\n"), "{out}");
        // A query string is ignored; a bare-LF client is served too.
        assert!(exchange(b"GET /metrics?x=1 HTTP/1.0\n\n").starts_with("HTTP/1.1 200 OK"));
    }

    #[test]
    fn other_paths_and_methods_are_not_found() {
        for req in
            [&b"GET / HTTP/1.1\r\n\r\n"[..], b"GET /metricsx HTTP/1.1\r\n\r\n", b"POST /metrics HTTP/1.1\r\n\r\n"]
        {
            let out = exchange(req);
            assert!(out.starts_with("HTTP/1.1 404 Not Found\r\n"), "{out}");
            assert!(!out.contains("x_total"), "{out}");
        }
    }

    #[test]
    fn garbage_is_a_bad_request() {
        for req in [
            &b"\x00\xff\x13garbage\r\n\r\n"[..],
            b"GET\r\n\r\n",
            b"GET /metrics\r\n\r\n",
            b"GET /metrics SPDY/3\r\n\r\n",
            b"GET  /metrics HTTP/1.1\r\n\r\n",
            b"G=T /metrics HTTP/1.1\r\n\r\n",
            b"GET metrics HTTP/1.1 extra\r\n\r\n",
            b"no line end at all",
        ] {
            let out = exchange(req);
            assert!(out.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{req:?}: {out}");
        }
        // A client that closes without a byte gets nothing, and the endpoint lives on.
        assert_eq!(exchange(b""), "");
    }

    #[test]
    fn an_oversized_request_is_refused() {
        let mut req = b"GET /metrics HTTP/1.1\r\n".to_vec();
        while req.len() <= MAX_REQUEST_BYTES + 10 {
            req.extend_from_slice(b"X-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        let out = exchange(&req);
        assert!(out.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"), "{out}");
        // A head that ends just inside the limit is still served.
        let mut ok = b"GET /metrics HTTP/1.1\r\n".to_vec();
        let pad = MAX_REQUEST_BYTES - ok.len() - "X: \r\n\r\n".len();
        ok.extend_from_slice(format!("X: {}\r\n\r\n", "a".repeat(pad)).as_bytes());
        assert_eq!(ok.len(), MAX_REQUEST_BYTES);
        assert!(exchange(&ok).starts_with("HTTP/1.1 200 OK"));
    }

    #[test]
    fn a_silent_client_is_timed_out_and_the_endpoint_keeps_serving() {
        rt().block_on(async {
            let endpoint = MetricsEndpoint::bind("127.0.0.1:0", Arc::new(Fixed)).await.expect("bind");
            let mut silent = TcpStream::connect(endpoint.addr()).await.expect("connect");
            silent.write_all(b"GET /metr").await.expect("write");
            // Meanwhile another client is served.
            let mut s = TcpStream::connect(endpoint.addr()).await.expect("connect");
            s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.expect("write");
            let mut out = String::new();
            tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut out))
                .await
                .expect("the second client is answered within 10 s")
                .expect("read");
            assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
            let mut out = String::new();
            tokio::time::timeout(READ_TIMEOUT + Duration::from_secs(5), silent.read_to_string(&mut out))
                .await
                .expect("the silent client is closed after the read timeout")
                .expect("read");
            assert!(out.starts_with("HTTP/1.1 408 Request Timeout"), "{out}");
        });
    }

    #[test]
    fn the_head_ends_at_the_first_blank_line_within_the_limit() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(18));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n"), None);
        assert_eq!(request_line(b"GET /metrics?a HTTP/1.1\r\n"), Some(("GET", "/metrics")));
        assert_eq!(request_line(b"GET /metrics HTTP/1.1"), None, "no line end");
    }
}
