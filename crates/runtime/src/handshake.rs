//! The handshake on a new TCP connection, before any frame: the bytes of
//! [`elasticps_wire::handshake`] moved over the socket, with fresh nonces and a deadline.
//! The dialer calls [`dial`], the acceptor [`accept`]; either returns an error naming the
//! peer when it does not hold the cluster secret, skipped the handshake, or stalled.

use std::time::Duration;

use elasticps_wire::handshake::{
    ClientHandshake, HELLO_LEN, KeyId, NONCE_LEN, PROOF_LEN, ServerHandshake, VERDICT_LEN, check_magic,
};
use elasticps_wire::{Codec, ErrorCode, ErrorReply, Message, WireError};
use rand::{RngCore, SeedableRng};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::error::{Result, RuntimeError};

/// How long a whole handshake may take.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// A fresh nonce from the operating system's randomness.
fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    rand::rngs::StdRng::from_os_rng().fill_bytes(&mut n);
    n
}

/// Proves to the acceptor at the other end of `stream` that this node holds `secret`, and
/// checks that it does too. `peer` names it in errors.
pub async fn dial<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, secret: &[u8], peer: &str) -> Result<()> {
    dial_with(stream, KeyId::Cluster, secret, peer).await
}

/// [`dial`] with the secret of `key` (a worker that holds the worker secret).
pub async fn dial_with<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: KeyId,
    secret: &[u8],
    peer: &str,
) -> Result<()> {
    crate::timeout(HANDSHAKE_TIMEOUT, format!("{peer} to complete the handshake"), async {
        let io = |e| io_err(peer, e);
        let wire = |source| RuntimeError::Wire { peer: peer.to_string(), source };
        let (client, hello) = ClientHandshake::start_with(key, secret, nonce());
        stream.write_all(&hello).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        let mut reply = [0u8; HELLO_LEN];
        read(stream, &mut reply, peer).await?;
        let (client, proof) = client.on_hello(&reply).map_err(wire)?;
        stream.write_all(&proof).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        let mut verdict = [0u8; VERDICT_LEN];
        read(stream, &mut verdict, peer).await?;
        client.on_verdict(&verdict).map_err(wire)
    })
    .await
}

/// Checks that the dialer at the other end of `stream` holds `secret`, and proves that
/// this node does, within `deadline` ([`HANDSHAKE_TIMEOUT`] at most makes sense). A refused
/// dialer is told so (and the caller should log the refusal).
pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
    peer: &str,
    deadline: Duration,
) -> Result<()> {
    accept_with(stream, secret, None, peer, deadline).await.map(|_| ())
}

/// [`accept`] that also takes dialers of the `worker_secret` (`--worker-secret`): the key
/// the dialer proved.
pub async fn accept_with<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
    worker_secret: Option<&[u8]>,
    peer: &str,
    deadline: Duration,
) -> Result<KeyId> {
    crate::timeout(deadline, format!("{peer} to complete the handshake"), async {
        let io = |e| io_err(peer, e);
        let wire = |source| RuntimeError::Wire { peer: peer.to_string(), source };
        let mut hello = [0u8; HELLO_LEN];
        read(stream, &mut hello[..4], peer).await?;
        if hello[0] == crate::tls::TLS_HANDSHAKE_RECORD && hello[1] == 3 {
            return Err(RuntimeError::Tls {
                peer: peer.to_string(),
                what: "it opened with a TLS ClientHello, but this node runs without TLS: start every node with \
                       the same --tls-cert, --tls-key and --tls-ca"
                    .into(),
            });
        }
        check_magic(hello[..4].try_into().unwrap_or_default()).map_err(wire)?;
        read(stream, &mut hello[4..], peer).await?;
        let acceptor = ServerHandshake::new(secret, nonce()).with_worker_secret(worker_secret);
        let (server, reply) = acceptor.on_hello(&hello).map_err(wire)?;
        stream.write_all(&reply).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        let mut proof = [0u8; PROOF_LEN];
        read(stream, &mut proof, peer).await?;
        let (verdict, accepted) = server.on_proof(&proof);
        stream.write_all(&verdict).await.map_err(io)?;
        stream.flush().await.map_err(io)?;
        accepted.map_err(wire)
    })
    .await
}

/// Logs the refusal of the dialer at `peer` and, if it sent a frame instead of the
/// handshake (a node of an older version, a hand-written client), answers it with an
/// `Error` frame that says why (with this node's `codec`), before the connection closes.
pub async fn refused<S: AsyncWrite + Unpin>(stream: &mut S, codec: &Codec, peer: &str, e: &RuntimeError) {
    tracing::warn!(peer = %peer, error = %e, "connection refused");
    if let RuntimeError::Wire { source: source @ WireError::NoHandshake { frame: true, .. }, .. } = e {
        let reply = ErrorReply::new(
            ErrorCode::Unauthenticated,
            format!("{source}: every connection starts with the HMAC-SHA256 handshake (docs/PROTOCOL.md §1.1)"),
        );
        if let Ok((head, payload)) = codec.encode(0, &Message::Error(reply)) {
            let _ = stream.write_all(&head).await;
            let _ = stream.write_all(&payload).await;
            let _ = stream.flush().await;
        }
    }
    let _ = stream.shutdown().await;
}

/// An I/O error of the handshake with `peer`; inside TLS, a peer's alert (it refused this
/// node's certificate after the TLS handshake ended on this side) says so.
fn io_err(peer: &str, e: std::io::Error) -> RuntimeError {
    if let Some(rustls::Error::AlertReceived(alert)) = e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
        return RuntimeError::Tls {
            peer: peer.to_string(),
            what: format!(
                "it refused this node's certificate (alert {alert:?}): is it signed by the CA the peer trusts \
                 (its --tls-ca)?"
            ),
        };
    }
    RuntimeError::io(format!("handshake with {peer}"), e)
}

async fn read<S: AsyncRead + Unpin>(stream: &mut S, buf: &mut [u8], peer: &str) -> Result<()> {
    match stream.read_exact(buf).await {
        Ok(_) => Ok(()),
        Err(e) if matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset) => {
            Err(RuntimeError::Closed(format!(
                "{peer} (during the handshake; a node with TLS closes a plain-TCP connection at once)"
            )))
        }
        Err(e) => Err(io_err(peer, e)),
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::duplex;

    use super::*;

    async fn both(dialer: &'static [u8], acceptor: &'static [u8]) -> (Result<()>, Result<()>) {
        let (mut a, mut b) = duplex(1024);
        tokio::join!(dial(&mut a, dialer, "acceptor"), accept(&mut b, acceptor, "dialer", HANDSHAKE_TIMEOUT))
    }

    #[tokio::test]
    async fn the_same_secret_connects() {
        let (d, a) = both(b"s3cret", b"s3cret").await;
        assert!(d.is_ok() && a.is_ok(), "{d:?} {a:?}");
    }

    #[tokio::test]
    async fn a_wrong_secret_is_refused_on_both_sides_with_clear_errors() {
        let (d, a) = both(b"wrong", b"s3cret").await;
        let (d, a) = (d.unwrap_err(), a.unwrap_err());
        assert!(
            matches!(&d, RuntimeError::Wire { source: WireError::Unauthenticated { refused_by_peer: true }, .. }),
            "{d}"
        );
        assert!(d.to_string().contains("cluster secret differs"), "{d}");
        assert!(a.to_string().contains("does not hold this node's cluster secret"), "{a}");
    }

    #[tokio::test]
    async fn a_peer_that_sends_a_frame_first_is_refused() {
        let (mut a, mut b) = duplex(1024);
        let codec = elasticps_wire::Codec::new(b"", 1 << 20);
        let (head, _) = codec.encode(1, &elasticps_wire::Control::Heartbeat.into()).unwrap();
        a.write_all(&head).await.unwrap(); // shorter than a hello: refused on its magic
        let e = accept(&mut b, b"", "peer", HANDSHAKE_TIMEOUT).await.unwrap_err();
        assert!(e.to_string().contains("sent a frame before the handshake"), "{e}");
    }

    #[tokio::test]
    async fn a_peer_that_stalls_mid_handshake_times_out_naming_it() {
        let (mut a, mut b) = duplex(1024);
        a.write_all(b"EP").await.unwrap(); // half a hello, then nothing
        let limit = std::time::Duration::from_millis(200);
        let e = accept(&mut b, b"", "worker at 10.0.0.7:5000", limit).await.unwrap_err();
        assert!(matches!(e, RuntimeError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("worker at 10.0.0.7:5000 to complete the handshake"), "{e}");
        drop(a);
    }
}
