//! Accepting connections on a node's port: a bound on the connections still in the
//! handshake, a bound on the authenticated connections open at once, and TLS if installed
//! ([`crate::tls`]) then the handshake ([`crate::handshake`]) before a connection is handed
//! to its role. A connection above either bound is closed at once and logged, so a flood
//! of peers cannot exhaust a node's tasks, buffers or file descriptors while its workers
//! are served; and since peers in the handshake have places of their own, peers without
//! the secret cannot take the places of authenticated ones.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use elasticps_wire::{Codec, KeyId};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::handshake;
use crate::tls::{Stream, TlsConfig};

/// How many authenticated connections a scheduler or server keeps open at once by
/// default (workers, servers, operator tools); one more is refused. `--max-connections`
/// sets it ([`set_max_connections`]).
pub const MAX_CONNECTIONS: usize = 4096;

/// How many connections a scheduler or server keeps in the handshake at once by default
/// (each for [`handshake::HANDSHAKE_TIMEOUT`] at most); one more is refused.
/// `--max-handshakes` sets it ([`set_max_handshakes`]).
pub const MAX_HANDSHAKES: usize = 1024;

/// The bounds of this process's acceptors ([`max_connections`], [`max_handshakes`]).
static BOUND: AtomicUsize = AtomicUsize::new(MAX_CONNECTIONS);
static HANDSHAKES: AtomicUsize = AtomicUsize::new(MAX_HANDSHAKES);

/// Sets the bound on authenticated connections of the acceptors this process builds from
/// now on (at least 1). Call it once at the start of a node.
pub fn set_max_connections(n: usize) {
    BOUND.store(n.max(1), Ordering::Relaxed);
}

/// The bound on authenticated connections of an acceptor: [`MAX_CONNECTIONS`] unless
/// [`set_max_connections`] changed it.
pub fn max_connections() -> usize {
    BOUND.load(Ordering::Relaxed)
}

/// Sets the bound on connections in the handshake of the acceptors this process builds
/// from now on (at least 1).
pub fn set_max_handshakes(n: usize) {
    HANDSHAKES.store(n.max(1), Ordering::Relaxed);
}

/// The bound on connections in the handshake: [`MAX_HANDSHAKES`] unless
/// [`set_max_handshakes`] changed it.
pub fn max_handshakes() -> usize {
    HANDSHAKES.load(Ordering::Relaxed)
}

/// A listener with its bounds.
pub struct Acceptor {
    listener: TcpListener,
    handshakes: Arc<Semaphore>,
    max_handshakes: usize,
    slots: Arc<Semaphore>,
    max: usize,
}

/// One accepted connection, before its handshake; it counts against the handshake bound
/// until it is [`Accepted::authenticate`]d or dropped.
pub struct Accepted {
    /// The connection (no byte read yet).
    pub stream: TcpStream,
    /// The peer's address.
    pub addr: SocketAddr,
    /// Its place under the handshake bound.
    handshake: OwnedSemaphorePermit,
    /// The places of authenticated connections.
    slots: Arc<Semaphore>,
    max: usize,
}

/// An authenticated connection: it counts against the bound on open connections until
/// `permit` is dropped.
pub struct Admitted {
    /// The connection, after TLS and the handshake.
    pub stream: Stream,
    /// The key the peer proved (its frames are checked with [`Codec::for_key`] of it).
    pub key: KeyId,
    /// Its place under the bound: keep it as long as the connection lives.
    pub permit: OwnedSemaphorePermit,
}

impl Acceptor {
    /// Accepts on `listener`: at most `max` authenticated connections open at once, and
    /// at most [`max_handshakes`] in the handshake.
    pub fn new(listener: TcpListener, max: usize) -> Self {
        Self::with_bounds(listener, max, max_handshakes())
    }

    /// [`Acceptor::new`] with its handshake bound.
    pub fn with_bounds(listener: TcpListener, max: usize, max_handshakes: usize) -> Self {
        Self {
            listener,
            handshakes: Arc::new(Semaphore::new(max_handshakes)),
            max_handshakes,
            slots: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// The next connection under the handshake bound. Failed accepts (out of descriptors,
    /// a reset before accept) are logged and retried after a short pause; connections
    /// above the bound are closed and logged.
    pub async fn next(&self) -> Accepted {
        loop {
            let (stream, addr) = match self.listener.accept().await {
                Ok(x) => x,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            match self.handshakes.clone().try_acquire_owned() {
                Ok(handshake) => {
                    return Accepted { stream, addr, handshake, slots: self.slots.clone(), max: self.max };
                }
                Err(_) => {
                    tracing::warn!(peer = %addr, max_handshakes = self.max_handshakes, "connection refused: too many connections in the handshake");
                    drop(stream);
                }
            }
        }
    }
}

impl Accepted {
    /// TLS and the handshake within `stall` (and [`handshake::HANDSHAKE_TIMEOUT`]), then a
    /// place under the bound on open connections: `None` if the peer was refused (logged,
    /// and its connection closed) or no place is free.
    pub async fn authenticate(self, codec: &Codec, stall: Duration) -> Option<Admitted> {
        let Accepted { stream, addr, handshake, slots, max } = self;
        let peer = addr.to_string();
        let (stream, key) = authenticate(stream, codec, &peer, stall).await?;
        drop(handshake);
        match slots.try_acquire_owned() {
            Ok(permit) => Some(Admitted { stream, key, permit }),
            Err(_) => {
                tracing::warn!(peer = %addr, max, "connection refused: too many connections open");
                None
            }
        }
    }
}

/// Runs the acceptor's side of TLS (if this process [`crate::tls::install`]ed it) and of
/// the handshake on `stream`, within `stall` in all (and at most
/// [`handshake::HANDSHAKE_TIMEOUT`]); a refused peer is logged (and told why, if it sent a
/// frame) and its connection closed: `None`. Otherwise the stream, and the key the peer
/// proved (its frames are checked with [`Codec::for_key`] of it).
pub async fn authenticate(stream: TcpStream, codec: &Codec, peer: &str, stall: Duration) -> Option<(Stream, KeyId)> {
    authenticate_with(stream, codec, peer, stall, crate::tls::installed().as_deref()).await
}

/// [`authenticate`] with these TLS settings (`None`: plain TCP) instead of the installed ones.
pub async fn authenticate_with(
    stream: TcpStream,
    codec: &Codec,
    peer: &str,
    stall: Duration,
    tls: Option<&TlsConfig>,
) -> Option<(Stream, KeyId)> {
    let deadline = stall.min(handshake::HANDSHAKE_TIMEOUT);
    let start = Instant::now();
    let mut stream = match tls {
        None => Stream::Plain(stream),
        Some(tls) => match tls.accept(stream, peer, deadline).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(peer = %peer, error = %e, "connection refused");
                return None;
            }
        },
    };
    let left = deadline.saturating_sub(start.elapsed()).max(Duration::from_millis(1));
    match handshake::accept_with(&mut stream, codec.secret(), codec.worker_secret(), peer, left).await {
        Ok(key) => Some((stream, key)),
        Err(e) => {
            handshake::refused(&mut stream, codec, peer, &e).await;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    #[tokio::test]
    async fn a_connection_above_the_handshake_bound_is_closed_and_a_freed_place_is_taken_again() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = Acceptor::with_bounds(listener, MAX_CONNECTIONS, 2);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let node = tokio::spawn(async move {
            loop {
                if tx.send(acceptor.next().await).is_err() {
                    return;
                }
            }
        });
        let within = Duration::from_secs(5);
        let _a = TcpStream::connect(addr).await.unwrap();
        let first = tokio::time::timeout(within, rx.recv()).await.unwrap().unwrap();
        let _b = TcpStream::connect(addr).await.unwrap();
        let _second = tokio::time::timeout(within, rx.recv()).await.unwrap().unwrap();
        // A third peer: accepted by the kernel, closed by the node.
        let mut c = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        let closed = tokio::time::timeout(within, c.read(&mut buf)).await.expect("closed in time");
        assert!(matches!(closed, Ok(0) | Err(_)), "the third peer must be closed: {closed:?}");
        // A place frees up: the next peer gets it.
        drop(first);
        let d = TcpStream::connect(addr).await.unwrap();
        let fourth = tokio::time::timeout(within, rx.recv()).await.unwrap().unwrap();
        assert_eq!(fourth.addr, d.local_addr().unwrap());
        node.abort();
    }
}
