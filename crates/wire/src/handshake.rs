//! The connection handshake: before any frame, the two ends of a new connection prove to
//! each other that they hold the cluster secret, by challenge and response with
//! HMAC-SHA256 (docs/PROTOCOL.md §1.1). Pure functions over fixed-size byte arrays; the
//! runtime moves the bytes and draws the nonces.
//!
//! ```text
//! dialer (client)                                   acceptor (server)
//!   ClientHello  "EPSH" v key 0 0 | nonce_c[32]   ->
//!                                               <-  ServerHello  "EPSH" v 0 0 0 | nonce_s[32]
//!   ClientProof  HMAC(k, "elasticps client" | nonce_c | nonce_s)   ->   checked
//!                                               <-  Verdict  status 0 0 0 | HMAC(k, "elasticps server" | nonce_c | nonce_s)
//! ```
//!
//! `key` says which secret `k` the dialer holds ([`KeyId`]): the cluster secret, or the
//! worker secret (`--worker-secret`), which workers hold instead of the cluster secret.
//! The acceptor answers with the same key, and the handshake's result says which one the
//! dialer proved: the frames that follow use that secret in their checksum.
//!
//! The acceptor checks the dialer's proof first, so that a dialer with the wrong secret
//! learns it from the verdict (status 1, and the acceptor logs the refusal); the dialer
//! then checks the acceptor's proof, so that it never talks to an impostor. Fresh nonces
//! on both sides make a recorded exchange worthless. The handshake authenticates the
//! peers, not the frames after it: on an untrusted network, use TLS as well.
//!
//! ```
//! # use elasticps_wire::handshake::*;
//! let (client, hello) = ClientHandshake::start(b"k", [1; NONCE_LEN]);
//! let server = ServerHandshake::new(b"k", [2; NONCE_LEN]);
//! let (server, reply) = server.on_hello(&hello).unwrap();
//! let (client, proof) = client.on_hello(&reply).unwrap();
//! let (verdict, accepted) = server.on_proof(&proof);
//! assert_eq!(accepted.unwrap(), KeyId::Cluster);
//! client.on_verdict(&verdict).unwrap();
//! ```

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::WireError;
use crate::header::MAGIC;

/// The first four bytes of a handshake message (a frame starts with `EPS1`).
pub const HANDSHAKE_MAGIC: [u8; 4] = *b"EPSH";
/// The handshake version this node speaks.
pub const HANDSHAKE_VERSION: u8 = 1;
/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Bytes of an HMAC-SHA256 proof.
pub const PROOF_LEN: usize = 32;
/// Bytes of a `ClientHello` or `ServerHello`: magic, version, 3 zero bytes, nonce.
pub const HELLO_LEN: usize = 8 + NONCE_LEN;
/// Bytes of a verdict: status, 3 zero bytes, the acceptor's proof.
pub const VERDICT_LEN: usize = 4 + PROOF_LEN;

/// Verdict status: the dialer's proof holds.
const ACCEPTED: u8 = 0;
/// Verdict status: the dialer's proof does not hold (a different secret).
const WRONG_SECRET: u8 = 1;

type HmacSha256 = Hmac<Sha256>;

/// Which secret the dialer proves (byte 5 of its hello).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum KeyId {
    /// 0: the cluster secret (`--secret`): any role.
    #[default]
    Cluster,
    /// 1: the worker secret (`--worker-secret`): a worker only, which can be no server,
    /// no scheduler and no other worker.
    Worker,
}

impl KeyId {
    /// The key's byte in the hello.
    pub fn byte(self) -> u8 {
        match self {
            KeyId::Cluster => 0,
            KeyId::Worker => 1,
        }
    }

    fn from_byte(b: u8) -> Result<Self, WireError> {
        match b {
            0 => Ok(KeyId::Cluster),
            1 => Ok(KeyId::Worker),
            other => {
                Err(WireError::BadHandshake(format!("unknown key id {other} (0 cluster secret, 1 worker secret)")))
            }
        }
    }
}

/// A hello message: magic, version, key id, 2 zero bytes, nonce.
fn hello(key: KeyId, nonce: &[u8; NONCE_LEN]) -> [u8; HELLO_LEN] {
    let mut m = [0u8; HELLO_LEN];
    m[..4].copy_from_slice(&HANDSHAKE_MAGIC);
    m[4] = HANDSHAKE_VERSION;
    m[5] = key.byte();
    m[8..].copy_from_slice(nonce);
    m
}

/// Checks the first four bytes of a connection: an acceptor refuses a peer that does not
/// start with the handshake as soon as they arrive (a short frame may never fill a hello).
pub fn check_magic(first: [u8; 4]) -> Result<(), WireError> {
    if first == HANDSHAKE_MAGIC { Ok(()) } else { Err(WireError::NoHandshake { got: first, frame: first == MAGIC }) }
}

/// The key id and nonce of a peer's hello, or why it is not one.
fn parse_hello(m: &[u8; HELLO_LEN]) -> Result<(KeyId, [u8; NONCE_LEN]), WireError> {
    check_magic(m[..4].try_into().unwrap_or_default())?;
    if m[4] != HANDSHAKE_VERSION {
        return Err(WireError::BadVersion { got: m[4] });
    }
    let key = KeyId::from_byte(m[5])?;
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&m[8..]);
    Ok((key, nonce))
}

/// The MAC over `role | nonce_c | nonce_s` with the secret.
fn mac(secret: &[u8], role: &[u8], nonce_c: &[u8; NONCE_LEN], nonce_s: &[u8; NONCE_LEN]) -> HmacSha256 {
    // HMAC takes a key of any length (an empty secret too).
    let mut m = HmacSha256::new_from_slice(secret).unwrap_or_else(|_| unreachable!("hmac keys have any length"));
    m.update(role);
    m.update(nonce_c);
    m.update(nonce_s);
    m
}

const CLIENT_ROLE: &[u8] = b"elasticps client";
const SERVER_ROLE: &[u8] = b"elasticps server";

/// The dialer's side, before the acceptor's hello.
#[derive(Clone)]
pub struct ClientHandshake {
    key: KeyId,
    secret: Vec<u8>,
    nonce_c: [u8; NONCE_LEN],
}

/// The dialer's side, before the verdict.
#[derive(Clone)]
pub struct ClientAwaitingVerdict {
    expected: [u8; PROOF_LEN],
}

impl ClientHandshake {
    /// Starts a handshake with the cluster `secret` and a fresh random `nonce`: the
    /// `ClientHello` to send.
    pub fn start(secret: &[u8], nonce: [u8; NONCE_LEN]) -> (Self, [u8; HELLO_LEN]) {
        Self::start_with(KeyId::Cluster, secret, nonce)
    }

    /// [`ClientHandshake::start`] with the secret of `key` (the worker secret, say).
    pub fn start_with(key: KeyId, secret: &[u8], nonce: [u8; NONCE_LEN]) -> (Self, [u8; HELLO_LEN]) {
        (Self { key, secret: secret.to_vec(), nonce_c: nonce }, hello(key, &nonce))
    }

    /// The acceptor's hello: the proof to send. A hello of another key id than this
    /// side's is refused: the acceptor must echo it.
    pub fn on_hello(self, m: &[u8; HELLO_LEN]) -> Result<(ClientAwaitingVerdict, [u8; PROOF_LEN]), WireError> {
        let (key, nonce_s) = parse_hello(m)?;
        if key != self.key {
            return Err(WireError::BadHandshake(format!(
                "the acceptor's hello names key id {}, not this dialer's {}",
                key.byte(),
                self.key.byte()
            )));
        }
        let proof = mac(&self.secret, CLIENT_ROLE, &self.nonce_c, &nonce_s).finalize().into_bytes().into();
        let expected = mac(&self.secret, SERVER_ROLE, &self.nonce_c, &nonce_s).finalize().into_bytes().into();
        Ok((ClientAwaitingVerdict { expected }, proof))
    }
}

impl ClientAwaitingVerdict {
    /// The verdict: `Ok` once the acceptor accepted this side and proved it holds the secret.
    pub fn on_verdict(&self, m: &[u8; VERDICT_LEN]) -> Result<(), WireError> {
        match m[0] {
            ACCEPTED => {}
            WRONG_SECRET => return Err(WireError::Unauthenticated { refused_by_peer: true }),
            other => return Err(WireError::BadHandshake(format!("unknown verdict status {other}"))),
        }
        // Constant time: compare the MACs' bytes without an early exit.
        let diff = self.expected.iter().zip(&m[4..]).fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff == 0 { Ok(()) } else { Err(WireError::Unauthenticated { refused_by_peer: false }) }
    }
}

/// The acceptor's side, before the dialer's hello.
#[derive(Clone)]
pub struct ServerHandshake {
    secret: Vec<u8>,
    worker_secret: Option<Vec<u8>>,
    nonce_s: [u8; NONCE_LEN],
}

/// The acceptor's side, before the dialer's proof.
#[derive(Clone)]
pub struct ServerAwaitingProof {
    /// The secret of the dialer's key, if this acceptor has that key.
    secret: Option<Vec<u8>>,
    key: KeyId,
    nonce_c: [u8; NONCE_LEN],
    nonce_s: [u8; NONCE_LEN],
}

impl ServerHandshake {
    /// An acceptor with a fresh random `nonce`.
    pub fn new(secret: &[u8], nonce: [u8; NONCE_LEN]) -> Self {
        Self { secret: secret.to_vec(), worker_secret: None, nonce_s: nonce }
    }

    /// Also accepts dialers that prove the worker secret ([`KeyId::Worker`]).
    pub fn with_worker_secret(mut self, worker_secret: Option<&[u8]>) -> Self {
        self.worker_secret = worker_secret.map(<[u8]>::to_vec);
        self
    }

    /// The dialer's hello: the `ServerHello` to send, or why the peer is refused (it sent
    /// a frame, or something else, before the handshake).
    pub fn on_hello(self, m: &[u8; HELLO_LEN]) -> Result<(ServerAwaitingProof, [u8; HELLO_LEN]), WireError> {
        let (key, nonce_c) = parse_hello(m)?;
        let reply = hello(key, &self.nonce_s);
        let secret = match key {
            KeyId::Cluster => Some(self.secret),
            KeyId::Worker => self.worker_secret,
        };
        Ok((ServerAwaitingProof { secret, key, nonce_c, nonce_s: self.nonce_s }, reply))
    }
}

impl ServerAwaitingProof {
    /// The dialer's proof: the verdict to send, and whether the dialer is accepted (with
    /// the key it proved). A dialer of the worker key is refused by an acceptor without a
    /// worker secret.
    pub fn on_proof(&self, proof: &[u8; PROOF_LEN]) -> ([u8; VERDICT_LEN], Result<KeyId, WireError>) {
        let mut verdict = [0u8; VERDICT_LEN];
        let Some(secret) = self.secret.as_deref() else {
            verdict[0] = WRONG_SECRET;
            return (
                verdict,
                Err(WireError::BadHandshake(
                    "the dialer proves the worker secret, and this node has none (--worker-secret)".into(),
                )),
            );
        };
        if mac(secret, CLIENT_ROLE, &self.nonce_c, &self.nonce_s).verify_slice(proof).is_err() {
            verdict[0] = WRONG_SECRET;
            return (verdict, Err(WireError::Unauthenticated { refused_by_peer: false }));
        }
        let ours: [u8; PROOF_LEN] =
            mac(secret, SERVER_ROLE, &self.nonce_c, &self.nonce_s).finalize().into_bytes().into();
        verdict[4..].copy_from_slice(&ours);
        (verdict, Ok(self.key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dialer_refuses_a_hello_that_does_not_echo_its_key_id() {
        let (client, _) = ClientHandshake::start_with(KeyId::Worker, b"w", [1; NONCE_LEN]);
        let err = client.clone().on_hello(&hello(KeyId::Cluster, &[2; NONCE_LEN])).err().expect("refused");
        assert!(err.to_string().contains("names key id 0, not this dialer's 1"), "{err}");
        assert!(client.on_hello(&hello(KeyId::Worker, &[2; NONCE_LEN])).is_ok());
    }

    /// Runs a whole handshake: (the acceptor's result, the dialer's result).
    fn run(client_secret: &[u8], server_secret: &[u8]) -> (Result<(), WireError>, Result<(), WireError>) {
        let (a, d) = run_with(KeyId::Cluster, client_secret, server_secret, None);
        (a.map(|_| ()), d)
    }

    /// [`run`] with the dialer's key and the acceptor's worker secret.
    fn run_with(
        key: KeyId,
        client_secret: &[u8],
        server_secret: &[u8],
        worker_secret: Option<&[u8]>,
    ) -> (Result<KeyId, WireError>, Result<(), WireError>) {
        let (c, hello) = ClientHandshake::start_with(key, client_secret, [7; NONCE_LEN]);
        let acceptor = ServerHandshake::new(server_secret, [9; NONCE_LEN]).with_worker_secret(worker_secret);
        let (s, reply) = acceptor.on_hello(&hello).unwrap();
        let (c, proof) = c.on_hello(&reply).unwrap();
        let (verdict, accepted) = s.on_proof(&proof);
        (accepted, c.on_verdict(&verdict))
    }

    #[test]
    fn the_same_secret_is_accepted_on_both_sides() {
        assert_eq!(run(b"secret", b"secret"), (Ok(()), Ok(())));
        assert_eq!(run(b"", b""), (Ok(()), Ok(())), "no secret: both ends agree on the empty key");
    }

    #[test]
    fn a_worker_secret_is_accepted_as_the_worker_key_only() {
        let ws = Some(&b"workers"[..]);
        assert_eq!(run_with(KeyId::Worker, b"workers", b"cluster", ws), (Ok(KeyId::Worker), Ok(())));
        assert_eq!(run_with(KeyId::Cluster, b"cluster", b"cluster", ws), (Ok(KeyId::Cluster), Ok(())));
        // The worker secret does not pass as the cluster key, nor without --worker-secret.
        assert!(run_with(KeyId::Cluster, b"workers", b"cluster", ws).0.is_err());
        let (a, d) = run_with(KeyId::Worker, b"workers", b"cluster", None);
        assert!(a.unwrap_err().to_string().contains("--worker-secret"));
        assert_eq!(d, Err(WireError::Unauthenticated { refused_by_peer: true }));
    }

    #[test]
    fn a_different_secret_is_refused_and_the_dialer_is_told() {
        let (server, client) = run(b"wrong", b"secret");
        assert_eq!(server, Err(WireError::Unauthenticated { refused_by_peer: false }));
        assert_eq!(client, Err(WireError::Unauthenticated { refused_by_peer: true }));
        assert!(client.unwrap_err().to_string().contains("refused"));
    }

    #[test]
    fn an_impostor_acceptor_that_accepts_anything_is_caught_by_the_dialer() {
        let (c, _) = ClientHandshake::start(b"secret", [7; NONCE_LEN]);
        let (c, _) = c.on_hello(&hello(KeyId::Cluster, &[9; NONCE_LEN])).unwrap();
        let forged = [0u8; VERDICT_LEN]; // "accepted", with a proof it cannot compute
        assert_eq!(c.on_verdict(&forged), Err(WireError::Unauthenticated { refused_by_peer: false }));
    }

    #[test]
    fn a_replayed_proof_fails_under_a_fresh_nonce() {
        let (c, hello1) = ClientHandshake::start(b"secret", [7; NONCE_LEN]);
        let (_, reply) = ServerHandshake::new(b"secret", [9; NONCE_LEN]).on_hello(&hello1).unwrap();
        let (_, proof) = c.on_hello(&reply).unwrap();
        // The attacker replays the recorded hello and proof against a fresh acceptor nonce.
        let (s2, _) = ServerHandshake::new(b"secret", [10; NONCE_LEN]).on_hello(&hello1).unwrap();
        assert!(s2.on_proof(&proof).1.is_err());
    }

    #[test]
    fn a_frame_or_garbage_before_the_handshake_is_named() {
        let mut frame = [0u8; HELLO_LEN];
        frame[..4].copy_from_slice(&MAGIC);
        let e = ServerHandshake::new(b"k", [0; NONCE_LEN]).on_hello(&frame).err().unwrap();
        assert_eq!(e, WireError::NoHandshake { got: MAGIC, frame: true });
        assert!(e.to_string().contains("sent a frame before the handshake"), "{e}");
        let garbage = [b'G'; HELLO_LEN];
        let e = ServerHandshake::new(b"k", [0; NONCE_LEN]).on_hello(&garbage).err().unwrap();
        assert!(matches!(e, WireError::NoHandshake { frame: false, .. }));
        let mut v2 = hello(KeyId::Cluster, &[0; NONCE_LEN]);
        v2[4] = 2;
        assert_eq!(
            ServerHandshake::new(b"k", [0; NONCE_LEN]).on_hello(&v2).err(),
            Some(WireError::BadVersion { got: 2 })
        );
    }
}
