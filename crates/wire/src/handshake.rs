//! The connection handshake: before any frame, the two ends of a new connection prove to
//! each other that they hold the cluster secret, by challenge and response with
//! HMAC-SHA256 (docs/PROTOCOL.md §1.1). Pure functions over fixed-size byte arrays; the
//! runtime moves the bytes and draws the nonces.
//!
//! ```text
//! dialer (client)                                   acceptor (server)
//!   ClientHello  "EPSH" v 0 0 0 | nonce_c[32]   ->
//!                                               <-  ServerHello  "EPSH" v 0 0 0 | nonce_s[32]
//!   ClientProof  HMAC(k, "elasticps client" | nonce_c | nonce_s)   ->   checked
//!                                               <-  Verdict  status 0 0 0 | HMAC(k, "elasticps server" | nonce_c | nonce_s)
//! ```
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
//! assert!(accepted.is_ok());
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

/// A hello message: magic, version, 3 zero bytes, nonce.
fn hello(nonce: &[u8; NONCE_LEN]) -> [u8; HELLO_LEN] {
    let mut m = [0u8; HELLO_LEN];
    m[..4].copy_from_slice(&HANDSHAKE_MAGIC);
    m[4] = HANDSHAKE_VERSION;
    m[8..].copy_from_slice(nonce);
    m
}

/// Checks the first four bytes of a connection: an acceptor refuses a peer that does not
/// start with the handshake as soon as they arrive (a short frame may never fill a hello).
pub fn check_magic(first: [u8; 4]) -> Result<(), WireError> {
    if first == HANDSHAKE_MAGIC { Ok(()) } else { Err(WireError::NoHandshake { got: first, frame: first == MAGIC }) }
}

/// The nonce of a peer's hello, or why it is not one.
fn parse_hello(m: &[u8; HELLO_LEN]) -> Result<[u8; NONCE_LEN], WireError> {
    check_magic(m[..4].try_into().unwrap_or_default())?;
    if m[4] != HANDSHAKE_VERSION {
        return Err(WireError::BadVersion { got: m[4] });
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&m[8..]);
    Ok(nonce)
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
    secret: Vec<u8>,
    nonce_c: [u8; NONCE_LEN],
}

/// The dialer's side, before the verdict.
#[derive(Clone)]
pub struct ClientAwaitingVerdict {
    expected: [u8; PROOF_LEN],
}

impl ClientHandshake {
    /// Starts a handshake with a fresh random `nonce`: the `ClientHello` to send.
    pub fn start(secret: &[u8], nonce: [u8; NONCE_LEN]) -> (Self, [u8; HELLO_LEN]) {
        (Self { secret: secret.to_vec(), nonce_c: nonce }, hello(&nonce))
    }

    /// The acceptor's hello: the proof to send.
    pub fn on_hello(self, m: &[u8; HELLO_LEN]) -> Result<(ClientAwaitingVerdict, [u8; PROOF_LEN]), WireError> {
        let nonce_s = parse_hello(m)?;
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
    nonce_s: [u8; NONCE_LEN],
}

/// The acceptor's side, before the dialer's proof.
#[derive(Clone)]
pub struct ServerAwaitingProof {
    secret: Vec<u8>,
    nonce_c: [u8; NONCE_LEN],
    nonce_s: [u8; NONCE_LEN],
}

impl ServerHandshake {
    /// An acceptor with a fresh random `nonce`.
    pub fn new(secret: &[u8], nonce: [u8; NONCE_LEN]) -> Self {
        Self { secret: secret.to_vec(), nonce_s: nonce }
    }

    /// The dialer's hello: the `ServerHello` to send, or why the peer is refused (it sent
    /// a frame, or something else, before the handshake).
    pub fn on_hello(self, m: &[u8; HELLO_LEN]) -> Result<(ServerAwaitingProof, [u8; HELLO_LEN]), WireError> {
        let nonce_c = parse_hello(m)?;
        let reply = hello(&self.nonce_s);
        Ok((ServerAwaitingProof { secret: self.secret, nonce_c, nonce_s: self.nonce_s }, reply))
    }
}

impl ServerAwaitingProof {
    /// The dialer's proof: the verdict to send, and whether the dialer is accepted.
    pub fn on_proof(&self, proof: &[u8; PROOF_LEN]) -> ([u8; VERDICT_LEN], Result<(), WireError>) {
        let mut verdict = [0u8; VERDICT_LEN];
        if mac(&self.secret, CLIENT_ROLE, &self.nonce_c, &self.nonce_s).verify_slice(proof).is_err() {
            verdict[0] = WRONG_SECRET;
            return (verdict, Err(WireError::Unauthenticated { refused_by_peer: false }));
        }
        let ours: [u8; PROOF_LEN] =
            mac(&self.secret, SERVER_ROLE, &self.nonce_c, &self.nonce_s).finalize().into_bytes().into();
        verdict[4..].copy_from_slice(&ours);
        (verdict, Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs a whole handshake: (the acceptor's result, the dialer's result).
    fn run(client_secret: &[u8], server_secret: &[u8]) -> (Result<(), WireError>, Result<(), WireError>) {
        let (c, hello) = ClientHandshake::start(client_secret, [7; NONCE_LEN]);
        let (s, reply) = ServerHandshake::new(server_secret, [9; NONCE_LEN]).on_hello(&hello).unwrap();
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
    fn a_different_secret_is_refused_and_the_dialer_is_told() {
        let (server, client) = run(b"wrong", b"secret");
        assert_eq!(server, Err(WireError::Unauthenticated { refused_by_peer: false }));
        assert_eq!(client, Err(WireError::Unauthenticated { refused_by_peer: true }));
        assert!(client.unwrap_err().to_string().contains("refused"));
    }

    #[test]
    fn an_impostor_acceptor_that_accepts_anything_is_caught_by_the_dialer() {
        let (c, _) = ClientHandshake::start(b"secret", [7; NONCE_LEN]);
        let (c, _) = c.on_hello(&hello(&[9; NONCE_LEN])).unwrap();
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
        let mut v2 = hello(&[0; NONCE_LEN]);
        v2[4] = 2;
        assert_eq!(
            ServerHandshake::new(b"k", [0; NONCE_LEN]).on_hello(&v2).err(),
            Some(WireError::BadVersion { got: 2 })
        );
    }
}
