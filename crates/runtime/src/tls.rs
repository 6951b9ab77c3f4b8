//! Optional TLS 1.3 under the handshake: mutual TLS with rustls (ring provider), both ends
//! proving a certificate signed by the cluster's CA, before the HMAC-SHA256 handshake
//! ([`crate::handshake`]) runs inside the encrypted stream.
//!
//! A connection is a [`Stream`]: plain TCP, or TLS over TCP. Its halves ([`ReadHalf`],
//! [`WriteHalf`]) are enums too, so the plain path stays what it was: the socket's own
//! lock-free halves (`TcpStream::into_split`) and its vectored writes, behind one match.
//! A TLS stream is split with [`tokio::io::split`] (rustls holds one state for both
//! directions) and writes vectored into rustls, which cuts records.
//!
//! **What is verified.** The acceptor requires a client certificate whose chain ends at
//! `--tls-ca`; the dialer checks the acceptor's chain against the same CA, its validity
//! dates and key usage, but not its name: nodes are dialed by the address they advertise
//! (an IP, a pod address behind NAT, `0.0.0.0` rewritten by a launcher), and one
//! certificate per cluster or per host is the usual way to run it, so a name check would
//! refuse correct clusters. The CA is the trust boundary: any certificate it signed is a
//! member of the cluster (and every member still proves the shared secret). Use a CA for
//! this cluster only, not a public one.
//!
//! **Process-wide.** The TLS settings of a node are installed once at its start
//! ([`install`]) and read by [`crate::conn::dial`] and [`crate::accept::authenticate`]:
//! every connection of the process (to the scheduler, to servers, between servers, of
//! operator tools) is TLS, or none is.

use std::io::IoSlice;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

pub use crate::error::TlsPart;
use crate::error::{Result, RuntimeError};

/// First byte of a TLS handshake record (a ClientHello starts with it).
pub const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// A node's TLS settings: the acceptor's and the dialer's rustls configurations, built from
/// one certificate, its key and the cluster's CA.
pub struct TlsConfig {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsConfig { tls 1.3, mutual }")
    }
}

fn setup_err(part: TlsPart, path: &str, what: impl Into<String>) -> RuntimeError {
    RuntimeError::TlsSetup { part, path: path.to_string(), what: what.into() }
}

impl TlsConfig {
    /// Reads the PEM files: `cert` (this node's chain, leaf first), `key` (its private
    /// key: PKCS#8, PKCS#1 or SEC1) and `ca` (the cluster's CA certificates). The
    /// certificate serves both ends, so its extended key usage (if any) must allow
    /// serverAuth and clientAuth. Errors name the file.
    pub fn from_files(cert: &Path, key: &Path, ca: &Path) -> Result<Self> {
        let read = |part, path: &Path| {
            std::fs::read(path)
                .map_err(|e| setup_err(part, &path.display().to_string(), format!("cannot read it: {e}")))
        };
        let (c, k, a) = (read(TlsPart::Cert, cert)?, read(TlsPart::Key, key)?, read(TlsPart::Ca, ca)?);
        Self::from_pem(
            (&c, &cert.display().to_string()),
            (&k, &key.display().to_string()),
            (&a, &ca.display().to_string()),
        )
    }

    /// [`TlsConfig::from_files`] on the files' contents, each with the name errors give it.
    pub fn from_pem(cert: (&[u8], &str), key: (&[u8], &str), ca: (&[u8], &str)) -> Result<Self> {
        let certs = certificates(TlsPart::Cert, cert)?;
        let key_der = PrivateKeyDer::from_pem_slice(key.0)
            .map_err(|e| setup_err(TlsPart::Key, key.1, format!("no PEM private key in it ({e})")))?;
        let mut roots = RootCertStore::empty();
        for c in certificates(TlsPart::Ca, ca)? {
            roots.add(c).map_err(|e| setup_err(TlsPart::Ca, ca.1, format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());

        let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| setup_err(TlsPart::Ca, ca.1, e.to_string()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| setup_err(TlsPart::Cert, cert.1, e.to_string()))?
            .with_client_cert_verifier(clients)
            .with_single_cert(certs.clone(), key_der.clone_key())
            .map_err(|e| setup_err(TlsPart::Key, key.1, format!("does not fit the certificate {}: {e}", cert.1)))?;

        let servers = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(|e| setup_err(TlsPart::Ca, ca.1, e.to_string()))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| setup_err(TlsPart::Cert, cert.1, e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainOnly(servers)))
            .with_client_auth_cert(certs, key_der)
            .map_err(|e| setup_err(TlsPart::Key, key.1, format!("does not fit the certificate {}: {e}", cert.1)))?;
        Ok(Self { server: Arc::new(server), client: Arc::new(client) })
    }

    /// Runs the dialer's TLS handshake on `tcp`, connected to `addr`, within `deadline`.
    pub async fn connect(&self, tcp: TcpStream, addr: &str, peer: &str, deadline: Duration) -> Result<Stream> {
        let name = server_name(addr);
        let connector = tokio_rustls::TlsConnector::from(self.client.clone());
        let what = format!("{peer} to complete the tls handshake");
        let tls = crate::timeout(deadline, what, async {
            connector.connect(name, tcp).await.map_err(|e| RuntimeError::Tls {
                peer: peer.to_string(),
                what: format!("{e} (does it run with the same --tls-ca, and with TLS at all?)"),
            })
        })
        .await?;
        Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Client(tls))))
    }

    /// Runs the acceptor's TLS handshake on `tcp` within `deadline`. A peer whose first
    /// bytes are not TLS (a node without TLS opening with the plain handshake) is refused
    /// with an error that says so.
    pub async fn accept(&self, tcp: TcpStream, peer: &str, deadline: Duration) -> Result<Stream> {
        let what = format!("{peer} to complete the tls handshake");
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server.clone());
        let tls = crate::timeout(deadline, what, async {
            let mut first = [0u8; 4];
            let n =
                tcp.peek(&mut first).await.map_err(|e| RuntimeError::io(format!("tls handshake with {peer}"), e))?;
            if n == 0 {
                return Err(RuntimeError::Closed(format!("{peer} (before the tls handshake)")));
            }
            if first[0] != TLS_HANDSHAKE_RECORD {
                let plain = elasticps_wire::handshake::HANDSHAKE_MAGIC.starts_with(&first[..n]);
                let what = if plain {
                    "it opened with the plain-TCP handshake, but this node requires TLS: start it with \
                     --tls-cert, --tls-key and --tls-ca too"
                        .to_string()
                } else {
                    format!("it sent {:02x?}, not a TLS ClientHello, and this node requires TLS", &first[..n])
                };
                // Read what it sent, so that closing sends a FIN, not a reset.
                let _ = tcp.try_read(&mut [0u8; 4096]);
                return Err(RuntimeError::Tls { peer: peer.to_string(), what });
            }
            acceptor.accept(tcp).await.map_err(|e| RuntimeError::Tls { peer: peer.to_string(), what: e.to_string() })
        })
        .await?;
        Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Server(tls))))
    }
}

/// The certificates of a PEM file: at least one.
fn certificates(part: TlsPart, (pem, name): (&[u8], &str)) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| setup_err(part, name, format!("invalid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(setup_err(part, name, "no PEM CERTIFICATE block in it"));
    }
    Ok(certs)
}

/// The name the dialer presents for `addr` (`host:port`): its IP, or its DNS name (sent as
/// SNI). Not checked against the certificate (see the module doc).
fn server_name(addr: &str) -> ServerName<'static> {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
    match host.parse::<std::net::IpAddr>() {
        Ok(ip) => ServerName::IpAddress(ip.into()),
        Err(_) => ServerName::try_from(host.to_string())
            .unwrap_or_else(|_| ServerName::IpAddress(std::net::IpAddr::from([127, 0, 0, 1]).into())),
    }
}

/// Verifies the acceptor's certificate chain against the CA (with webpki: signatures,
/// validity dates, key usage) for any name: see the module doc for why.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        // webpki checks the chain first, the name last: a name error means the chain held.
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The TLS settings of this process, if any ([`install`]).
static INSTALLED: RwLock<Option<Arc<TlsConfig>>> = RwLock::new(None);

/// Makes every later connection of this process TLS with `config` (`None`: plain TCP).
/// Call it once at the start of a node, before it dials or accepts.
pub fn install(config: Option<Arc<TlsConfig>>) {
    *INSTALLED.write().unwrap_or_else(|e| e.into_inner()) = config;
}

/// The TLS settings [`install`]ed in this process.
pub fn installed() -> Option<Arc<TlsConfig>> {
    INSTALLED.read().unwrap_or_else(|e| e.into_inner()).clone()
}

/// A connection: plain TCP or TLS over TCP.
pub enum Stream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS 1.3 over TCP, either end.
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

impl From<TcpStream> for Stream {
    fn from(s: TcpStream) -> Self {
        Stream::Plain(s)
    }
}

impl Stream {
    /// The TCP socket beneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }

    /// True for a TLS connection.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }

    /// Read and write halves, for a reader task and a writer: the socket's own halves for
    /// plain TCP (no lock), [`tokio::io::split`] for TLS.
    pub fn into_split(self) -> (ReadHalf, WriteHalf) {
        match self {
            Stream::Plain(s) => {
                let (r, w) = s.into_split();
                (ReadHalf::Plain(r), WriteHalf::Plain(w))
            }
            Stream::Tls(s) => {
                let (r, w) = tokio::io::split(*s);
                (ReadHalf::Tls(r), WriteHalf::Tls(w))
            }
        }
    }
}

/// The read half of a [`Stream`].
pub enum ReadHalf {
    /// Plain TCP.
    Plain(OwnedReadHalf),
    /// TLS.
    Tls(tokio::io::ReadHalf<tokio_rustls::TlsStream<TcpStream>>),
}

/// The write half of a [`Stream`].
pub enum WriteHalf {
    /// Plain TCP.
    Plain(OwnedWriteHalf),
    /// TLS.
    Tls(tokio::io::WriteHalf<tokio_rustls::TlsStream<TcpStream>>),
}

/// Forwards the AsyncRead / AsyncWrite methods to the variant.
macro_rules! forward {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Self::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            Self::Tls($s) => {
                let $s = Pin::new($s);
                $e
            }
        }
    };
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        forward!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncRead for ReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        forward!(self, s => s.poll_read(cx, buf))
    }
}

/// AsyncWrite by forwarding, vectored writes included.
macro_rules! impl_write {
    ($t:ty) => {
        impl AsyncWrite for $t {
            fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
                forward!(self, s => s.poll_write(cx, buf))
            }

            fn poll_write_vectored(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[IoSlice<'_>],
            ) -> Poll<std::io::Result<usize>> {
                forward!(self, s => s.poll_write_vectored(cx, bufs))
            }

            fn is_write_vectored(&self) -> bool {
                match self {
                    Self::Plain(s) => s.is_write_vectored(),
                    Self::Tls(s) => s.is_write_vectored(),
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                forward!(self, s => s.poll_flush(cx))
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
                forward!(self, s => s.poll_shutdown(cx))
            }
        }
    };
}

impl_write!(Stream);
impl_write!(WriteHalf);

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use elasticps_wire::{Codec, Message, Values};
    use tokio::net::TcpListener;

    use super::*;
    use crate::{accept, conn, handshake};

    const WITHIN: Duration = Duration::from_secs(10);

    fn data(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../cli/tests/data/tls").join(name)
    }

    /// The test cluster's node ("node") or the peer of another cluster ("other").
    fn config(who: &str, ca: &str) -> TlsConfig {
        TlsConfig::from_files(&data(&format!("{who}.pem")), &data(&format!("{who}.key")), &data(ca))
            .unwrap_or_else(|e| panic!("loading the test certificates: {e}"))
    }

    /// A listener and its address.
    async fn listen() -> (TcpListener, String) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        (l, addr)
    }

    #[tokio::test]
    async fn frames_cross_a_mutual_tls_connection_with_the_handshake_inside_and_vectored_writes() {
        let tls = Arc::new(config("node", "ca.pem"));
        let (l, addr) = listen().await;
        let codec = Codec::new(b"s3cret", 64 << 20);
        let (acc_tls, acc_codec) = (tls.clone(), codec.clone());
        let acceptor = tokio::spawn(async move {
            let (tcp, _) = l.accept().await.unwrap();
            accept::authenticate_with(tcp, &acc_codec, "dialer", WITHIN, Some(&acc_tls)).await
        });
        let dialed = conn::dial_with(&addr, &codec, "acceptor", Some(&tls)).await.expect("dialing over tls");
        let accepted = tokio::time::timeout(WITHIN, acceptor).await.expect("accepting in time").unwrap();
        let (accepted, _key) = accepted.expect("the acceptor takes a certificate of its CA");
        assert!(dialed.is_tls() && accepted.is_tls());
        let (l, addr) = listen().await;
        let (_, w) = Stream::Plain(TcpStream::connect(&addr).await.unwrap()).into_split();
        assert!(w.is_write_vectored(), "plain tcp writes stay vectored");
        drop(l);

        let (mut a_in, _a_out) = conn::split(accepted, codec.clone(), "dialer".into());
        let (_b_in, b_out) = conn::split(dialed, codec, "acceptor".into());
        assert!(b_out.writer().is_vectored(), "tls writes are vectored (into rustls)");
        let big: Vec<f32> = (0..(1 << 18)).map(|i| i as f32).collect(); // 1 MiB
        b_out.send((1, Message::Push { block: 3, clock: 7, values: Values::from_vec(big.clone()) })).unwrap();
        let w = b_out.writer();
        let head = w.tensor_header(elasticps_wire::Kind::Push, 2, 4, 8, 12, Default::default()).unwrap();
        w.write_frame(&head, bytemuck::cast_slice(&[1.0f32, 2.0, 3.0])).await.unwrap();
        // The direct write may overtake the queued frame: take them in any order.
        let mut got = Vec::new();
        for _ in 0..2 {
            let (h, msg) = tokio::time::timeout(WITHIN, a_in.next())
                .await
                .expect("a frame over tls in time")
                .unwrap()
                .expect("a frame, not the end");
            got.push((h.request_id, msg));
        }
        got.sort_by_key(|(id, _)| *id);
        assert_eq!(got.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [1, 2]);
        for (id, msg) in got {
            match (id, msg) {
                (1, Message::Push { block: 3, clock: 7, values }) => assert_eq!(values.to_vec(), big),
                (2, Message::Push { block: 4, clock: 8, values }) => assert_eq!(values.to_vec(), vec![1.0, 2.0, 3.0]),
                (_, other) => panic!("unexpected frame {other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn a_dialer_with_a_certificate_of_another_ca_is_refused_on_both_sides() {
        let (l, addr) = listen().await;
        let acceptor = tokio::spawn(async move {
            let (tcp, _) = l.accept().await.unwrap();
            config("node", "ca.pem").accept(tcp, "intruder", WITHIN).await.map(|_| ())
        });
        // The intruder trusts our CA (it checks our chain fine), but its own is another's.
        let intruder = config("other", "ca.pem");
        let dialed = conn::dial_with(&addr, &Codec::default(), "acceptor", Some(&intruder)).await;
        let refused = tokio::time::timeout(WITHIN, acceptor).await.expect("refusing in time").unwrap().unwrap_err();
        assert!(matches!(refused, RuntimeError::Tls { .. }), "{refused}");
        assert!(refused.to_string().contains("tls handshake with intruder failed"), "{refused}");
        assert!(refused.to_string().to_lowercase().contains("unknown"), "names the unknown issuer: {refused}");
        let dialed = dialed.err().expect("the intruder's dial must fail, got a connection");
        assert!(dialed.to_string().contains("refused this node's certificate"), "{dialed}");
    }

    #[tokio::test]
    async fn a_dialer_refuses_an_acceptor_whose_certificate_another_ca_signed() {
        let (l, addr) = listen().await;
        let acceptor = tokio::spawn(async move {
            let (tcp, _) = l.accept().await.unwrap();
            config("other", "ca.pem").accept(tcp, "dialer", WITHIN).await.map(|_| ())
        });
        let e = conn::dial_with(&addr, &Codec::default(), "server 1", Some(&config("node", "ca.pem")))
            .await
            .err()
            .expect("the dialer must refuse a chain of another CA");
        assert!(e.to_string().contains("tls handshake with server 1 at"), "{e}");
        assert!(e.to_string().contains("UnknownIssuer"), "{e}");
        let _ = tokio::time::timeout(WITHIN, acceptor).await.expect("the acceptor ends in time");
    }

    #[tokio::test]
    async fn a_plain_dialer_at_a_tls_node_and_a_tls_dialer_at_a_plain_node_are_refused_saying_why() {
        // Plain peer, TLS node.
        let (l, addr) = listen().await;
        let acceptor = tokio::spawn(async move {
            let (tcp, _) = l.accept().await.unwrap();
            config("node", "ca.pem").accept(tcp, "plain peer", WITHIN).await.map(|_| ())
        });
        let dialed = conn::dial_with(&addr, &Codec::default(), "tls node", None).await;
        let e = tokio::time::timeout(WITHIN, acceptor).await.expect("refusing in time").unwrap().unwrap_err();
        assert!(e.to_string().contains("opened with the plain-TCP handshake, but this node requires TLS"), "{e}");
        let d = dialed.err().expect("the plain dial must fail");
        assert!(d.to_string().contains("closed the connection"), "{d}");

        // TLS peer, plain node.
        let (l, addr) = listen().await;
        let acceptor = tokio::spawn(async move {
            let (mut tcp, _) = l.accept().await.unwrap();
            handshake::accept(&mut tcp, b"", "tls peer", WITHIN).await
        });
        let dialed = conn::dial_with(&addr, &Codec::default(), "plain node", Some(&config("node", "ca.pem"))).await;
        let e = tokio::time::timeout(WITHIN, acceptor).await.expect("refusing in time").unwrap().unwrap_err();
        assert!(e.to_string().contains("opened with a TLS ClientHello, but this node runs without TLS"), "{e}");
        assert!(dialed.is_err(), "the tls dial at a plain node must fail");
    }

    #[test]
    fn unusable_files_are_errors_naming_the_file_and_what_is_wrong() {
        let missing = data("nope.pem");
        let e = TlsConfig::from_files(&missing, &data("node.key"), &data("ca.pem")).unwrap_err();
        assert!(matches!(e, RuntimeError::TlsSetup { part: TlsPart::Cert, .. }), "{e}");
        assert!(e.to_string().contains("nope.pem: cannot read it"), "{e}");
        // A key where the certificate should be.
        let e = TlsConfig::from_files(&data("node.key"), &data("node.key"), &data("ca.pem")).unwrap_err();
        assert!(e.to_string().contains("no PEM CERTIFICATE block"), "{e}");
        // A certificate where the key should be.
        let e = TlsConfig::from_files(&data("node.pem"), &data("node.pem"), &data("ca.pem")).unwrap_err();
        assert!(matches!(e, RuntimeError::TlsSetup { part: TlsPart::Key, .. }), "{e}");
        // The key of another certificate.
        let e = TlsConfig::from_files(&data("node.pem"), &data("other.key"), &data("ca.pem")).unwrap_err();
        assert!(e.to_string().contains("does not fit the certificate"), "{e}");
    }

    #[test]
    fn the_dialed_name_is_the_address_host() {
        assert!(matches!(server_name("127.0.0.1:7000"), ServerName::IpAddress(_)));
        assert!(matches!(server_name("[::1]:7000"), ServerName::IpAddress(_)));
        assert!(matches!(server_name("ps-0.cluster:7000"), ServerName::DnsName(n) if n.as_ref() == "ps-0.cluster"));
    }
}
