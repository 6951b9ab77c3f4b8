//! Accepting connections on a node's port: a bound on the connections still in the
//! handshake, a bound on the authenticated connections open at once, and TLS if installed
//! ([`crate::tls`]) then the handshake ([`crate::handshake`]) before a connection is handed
//! to its role. A connection above the bound on authenticated connections is closed at once
//! and logged, so a flood of peers cannot exhaust a node's tasks, buffers or file
//! descriptors while its workers are served; and since peers in the handshake have places
//! of their own, peers without the secret cannot take the places of authenticated ones.
//! When every handshake place is taken, the oldest handshake is dropped for the newcomer:
//! an honest peer's handshake takes one round trip, so a flood of silent connections
//! evicts itself and never locks a worker out.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use elasticps_wire::{Codec, KeyId};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::handshake;
use crate::tls::{Stream, TlsConfig};

/// How many authenticated connections a scheduler or server keeps open at once by
/// default (workers, servers, operator tools); one more is refused. `--max-connections`
/// sets it ([`set_max_connections`]).
pub const MAX_CONNECTIONS: usize = 4096;

/// How many connections a scheduler or server keeps in the handshake at once by default
/// (each for [`handshake::HANDSHAKE_TIMEOUT`] at most); one more takes the place of the
/// oldest. `--max-handshakes` sets it ([`set_max_handshakes`]).
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
    handshakes: Arc<Handshakes>,
    slots: Arc<Semaphore>,
    max: usize,
}

/// The connections in the handshake, oldest first: each with its number and what tells it
/// to give up its place.
struct Handshakes {
    max: usize,
    next: std::sync::atomic::AtomicU64,
    open: Mutex<VecDeque<(u64, Arc<Notify>)>>,
}

impl Handshakes {
    /// A place for a new handshake; the oldest one is told to give up its place when
    /// every place is taken (it is logged as evicted).
    fn enter(self: &Arc<Self>) -> Place {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let evict = Arc::new(Notify::new());
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        while open.len() >= self.max {
            match open.pop_front() {
                // `notify_one` keeps a permit: the handshake sees it even before it waits.
                Some((_, oldest)) => oldest.notify_one(),
                None => break,
            }
        }
        open.push_back((id, evict.clone()));
        Place { id, evict, handshakes: self.clone() }
    }
}

/// A connection's place among the handshakes, given up when dropped.
struct Place {
    id: u64,
    evict: Arc<Notify>,
    handshakes: Arc<Handshakes>,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut open = self.handshakes.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = open.iter().position(|(id, _)| *id == self.id) {
            open.remove(i);
        }
    }
}

/// One accepted connection, before its handshake; it holds a handshake place until it is
/// [`Accepted::authenticate`]d, dropped, or evicted by a newer one.
pub struct Accepted {
    /// The connection (no byte read yet).
    pub stream: TcpStream,
    /// The peer's address.
    pub addr: SocketAddr,
    /// Its place among the handshakes.
    place: Place,
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

    /// [`Acceptor::new`] with its handshake bound (at least 1).
    pub fn with_bounds(listener: TcpListener, max: usize, max_handshakes: usize) -> Self {
        let handshakes = Handshakes {
            max: max_handshakes.max(1),
            next: std::sync::atomic::AtomicU64::new(0),
            open: Mutex::new(VecDeque::new()),
        };
        Self { listener, handshakes: Arc::new(handshakes), slots: Arc::new(Semaphore::new(max)), max }
    }

    /// The next connection, with a place among the handshakes (the oldest handshake gives
    /// its place up when all are taken). Failed accepts (out of descriptors, a reset
    /// before accept) are logged and retried after a short pause.
    pub async fn next(&self) -> Accepted {
        loop {
            match self.listener.accept().await {
                Ok((stream, addr)) => {
                    let place = self.handshakes.enter();
                    return Accepted { stream, addr, place, slots: self.slots.clone(), max: self.max };
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    after_failed_accept().await;
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
        let Accepted { stream, addr, place, slots, max } = self;
        let peer = addr.to_string();
        let evicted = place.evict.clone();
        let (stream, key) = tokio::select! {
            done = authenticate(stream, codec, &peer, stall) => done?,
            () = evicted.notified() => {
                tracing::warn!(peer = %addr, max_handshakes = place.handshakes.max, "connection dropped: the oldest of the connections in the handshake when every place was taken");
                return None;
            }
        };
        drop(place);
        match slots.try_acquire_owned() {
            Ok(permit) => Some(Admitted { stream, key, permit }),
            Err(_) => {
                tracing::warn!(peer = %addr, max, "connection refused: too many connections open");
                None
            }
        }
    }
}

/// How long a listener waits after a failed accept before the next.
pub const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// Waits [`ACCEPT_RETRY`] after a failed accept (out of descriptors, a reset before
/// accept), so that a listener whose accepts keep failing does not spin.
// Socket hygiene, no decision of a machine: the listener retries its accept, whatever
// the node's machine is doing (clippy.toml keeps sleeps in the drivers' Timer otherwise).
#[allow(clippy::disallowed_methods)]
pub async fn after_failed_accept() {
    tokio::time::sleep(ACCEPT_RETRY).await;
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
#[allow(clippy::disallowed_methods)] // tests pace their peers with sleeps
mod tests {
    use tokio::io::AsyncReadExt;

    use super::*;

    #[tokio::test]
    async fn a_full_handshake_bound_drops_the_oldest_silent_peer_and_an_honest_one_gets_in() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = Acceptor::with_bounds(listener, MAX_CONNECTIONS, 2);
        let codec = Codec::new(b"s3cret", 1 << 20);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let node = tokio::spawn(async move {
            loop {
                let a = acceptor.next().await;
                let (tx, codec) = (tx.clone(), codec.clone());
                tokio::spawn(async move {
                    let peer = a.addr;
                    let admitted = a.authenticate(&codec, Duration::from_secs(10)).await;
                    let _ = tx.send((peer, admitted.map(|x| x.key)));
                });
            }
        });
        let within = Duration::from_secs(5);
        // Two silent peers take both places; a third evicts the first.
        let mut first = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _second = TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let _third = TcpStream::connect(addr).await.unwrap();
        let (evicted, got) = tokio::time::timeout(within, rx.recv()).await.expect("an eviction in time").unwrap();
        assert_eq!((evicted, got), (first.local_addr().unwrap(), None), "the oldest is dropped");
        let mut buf = [0u8; 1];
        let closed = tokio::time::timeout(within, first.read(&mut buf)).await.expect("closed in time");
        assert!(matches!(closed, Ok(0) | Err(_)), "the evicted peer's connection is closed: {closed:?}");
        // An honest peer gets in at once, although both places were taken.
        let mut honest = TcpStream::connect(addr).await.unwrap();
        let me = honest.local_addr().unwrap();
        crate::handshake::dial(&mut honest, b"s3cret", "node").await.expect("the handshake");
        loop {
            let (peer, got) = tokio::time::timeout(within, rx.recv()).await.expect("admitted in time").unwrap();
            if peer == me {
                assert_eq!(got, Some(KeyId::Cluster));
                break;
            }
        }
        node.abort();
    }
}
