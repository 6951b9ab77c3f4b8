//! The raw TCP side of `bench transport`: the same bytes as a push or a pull, over a plain
//! socket pair, with no framing, no parameter-server logic and no copy but the kernel's.
//!
//! `elasticps bench tcp-sink` listens (on a 2-thread runtime, like a server process) and
//! serves each connection in the mode its 16-byte hello names (`[mode, 0 x 7, arg u64 LE]`):
//!
//! | mode | name       | what happens                                                        |
//! |-----:|:-----------|:--------------------------------------------------------------------|
//! |    1 | stream in  | the client writes until it shuts down; the sink reads into a 1 MiB buffer, then answers the byte count (u64) |
//! |    2 | stream out | the sink writes `arg` bytes in 1 MiB writes; the client reads them  |
//! |    3 | ping       | repeat: the client writes `arg` bytes, the sink answers 32 bytes (a push and its ack) |
//! |    4 | pong       | repeat: the client writes 32 bytes, the sink answers `arg` bytes (a pull and its reply) |
//!
//! The client functions ([`stream_in`], [`stream_out`], [`ping`], [`pong`]) run in the
//! benchmark process on the same runtime as the parameter-server clients they are
//! compared with.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Context as _;
use clap::Args;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Barrier;

use elasticps_report::stats::Lane;
use elasticps_runtime::events::{Emitter, Event};

/// Size of one write of a stream, like `iperf3 -l 1M`.
pub const CHUNK: usize = 1 << 20;
/// Size of the small message of a ping or pong: a frame header, the size of a PushAck or
/// of a Pull request.
pub const SMALL: usize = 32;

const STREAM_IN: u8 = 1;
const STREAM_OUT: u8 = 2;
const PING: u8 = 3;
const PONG: u8 = 4;

/// `elasticps bench tcp-sink`.
#[derive(Args, Clone, Debug)]
pub struct SinkCmd {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Worker threads of the sink's runtime (a server process has 2).
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Print a JSON `listening` event on stdout.
    #[arg(long)]
    pub events: bool,
}

/// Serves connections until killed.
pub async fn run(cmd: SinkCmd) -> crate::Result<()> {
    let rt = crate::multi_thread_runtime(cmd.threads.max(1))?;
    let emitter = Emitter::new(cmd.events);
    let served = rt.spawn(async move {
        let listener = TcpListener::bind(&cmd.listen).await.with_context(|| format!("binding {}", cmd.listen))?;
        let addr = listener.local_addr()?;
        emitter.emit(&Event::Listening { addr: addr.to_string() });
        loop {
            let (stream, _) = listener.accept().await.context("accepting a connection")?;
            tokio::spawn(async move {
                if let Err(e) = serve(stream).await {
                    tracing::debug!(error = %e, "raw connection ends");
                }
            });
        }
    });
    let result: crate::Result<()> = served.await.context("the sink's accept loop panicked")?;
    rt.shutdown_background();
    result
}

async fn serve(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut hello = [0u8; 16];
    s.read_exact(&mut hello).await?;
    let arg = u64::from_le_bytes(hello[8..].try_into().unwrap_or_default());
    let arg_usize = usize::try_from(arg).map_err(|_| std::io::Error::other("argument too large"))?;
    match hello[0] {
        STREAM_IN => {
            let mut buf = vec![0u8; CHUNK];
            let mut total = 0u64;
            loop {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            s.write_all(&total.to_le_bytes()).await?;
        }
        STREAM_OUT => {
            let buf = vec![1u8; CHUNK];
            let mut left = arg_usize;
            while left > 0 {
                let n = left.min(CHUNK);
                s.write_all(&buf[..n]).await?;
                left -= n;
            }
        }
        PING => {
            let mut buf = vec![0u8; arg_usize];
            let ack = [2u8; SMALL];
            loop {
                match s.read_exact(&mut buf).await {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(e),
                }
                s.write_all(&ack).await?;
            }
        }
        PONG => {
            let buf = vec![3u8; arg_usize];
            let mut req = [0u8; SMALL];
            loop {
                match s.read_exact(&mut req).await {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                    Err(e) => return Err(e),
                }
                s.write_all(&buf).await?;
            }
        }
        other => return Err(std::io::Error::other(format!("unknown mode {other}"))),
    }
    Ok(())
}

async fn open(addr: &str, mode: u8, arg: u64) -> crate::Result<TcpStream> {
    let mut s = TcpStream::connect(addr).await.with_context(|| format!("connecting to the tcp sink at {addr}"))?;
    s.set_nodelay(true)?;
    let mut hello = [0u8; 16];
    hello[0] = mode;
    hello[8..].copy_from_slice(&arg.to_le_bytes());
    s.write_all(&hello).await?;
    Ok(s)
}

/// Bounds of a phase: at most `count` operations (or `count` payloads of a stream), and
/// no new operation after `time`.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Largest number of operations.
    pub count: u64,
    /// Longest duration.
    pub time: Duration,
}

/// Writes up to `total` bytes in 1 MiB writes (stopping at the time bound), and counts
/// what the sink received.
pub async fn stream_in(addr: String, total: u64, time: Duration, start: Arc<Barrier>) -> crate::Result<Lane> {
    let mut s = open(&addr, STREAM_IN, 0).await?;
    let buf = vec![1u8; CHUNK];
    start.wait().await;
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < total && t0.elapsed() < time {
        let n = (total - sent).min(CHUNK as u64) as usize;
        s.write_all(&buf[..n]).await?;
        sent += n as u64;
    }
    s.shutdown().await?;
    let mut got = [0u8; 8];
    s.read_exact(&mut got).await.context("reading the sink's byte count")?;
    let end = Instant::now();
    let received = u64::from_le_bytes(got);
    crate::error::ensure_measured!(received == sent, "the tcp sink received {received} bytes of {sent}");
    Ok(Lane { start: t0, end, bytes: received, ops: Vec::new() })
}

/// Reads up to `total` bytes that the sink writes in 1 MiB writes (stopping at the time
/// bound) into a 1 MiB buffer.
pub async fn stream_out(addr: String, total: u64, time: Duration, start: Arc<Barrier>) -> crate::Result<Lane> {
    let mut s = open(&addr, STREAM_OUT, total).await?;
    let mut buf = vec![0u8; CHUNK];
    start.wait().await;
    let t0 = Instant::now();
    let mut got = 0u64;
    while got < total && t0.elapsed() < time {
        let n = s.read(&mut buf).await?;
        crate::error::ensure_measured!(n > 0, "the tcp sink closed after {got} of {total} bytes");
        got += n as u64;
    }
    Ok(Lane { start: t0, end: Instant::now(), bytes: got, ops: Vec::new() })
}

/// Round trips of `size` bytes up and a 32-byte answer (the shape of a push).
pub async fn ping(addr: String, size: usize, b: Bounds, warmup: u64, start: Arc<Barrier>) -> crate::Result<Lane> {
    let mut s = open(&addr, PING, size as u64).await?;
    let buf = vec![1u8; size];
    let mut ack = [0u8; SMALL];
    for _ in 0..warmup {
        s.write_all(&buf).await?;
        s.read_exact(&mut ack).await?;
    }
    start.wait().await;
    let mut ops = Vec::new();
    let t0 = Instant::now();
    while (ops.len() as u64) < b.count && t0.elapsed() < b.time {
        let t = Instant::now();
        s.write_all(&buf).await?;
        s.read_exact(&mut ack).await?;
        ops.push(t.elapsed());
    }
    Ok(Lane { start: t0, end: Instant::now(), bytes: ops.len() as u64 * size as u64, ops })
}

/// Round trips of a 32-byte request up and `size` bytes back (the shape of a pull).
pub async fn pong(addr: String, size: usize, b: Bounds, warmup: u64, start: Arc<Barrier>) -> crate::Result<Lane> {
    let mut s = open(&addr, PONG, size as u64).await?;
    let mut buf = vec![0u8; size];
    let req = [4u8; SMALL];
    for _ in 0..warmup {
        s.write_all(&req).await?;
        s.read_exact(&mut buf).await?;
    }
    start.wait().await;
    let mut ops = Vec::new();
    let t0 = Instant::now();
    while (ops.len() as u64) < b.count && t0.elapsed() < b.time {
        let t = Instant::now();
        s.write_all(&req).await?;
        s.read_exact(&mut buf).await?;
        ops.push(t.elapsed());
    }
    Ok(Lane { start: t0, end: Instant::now(), bytes: ops.len() as u64 * size as u64, ops })
}
