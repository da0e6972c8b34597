//! In-process TLS for tests: a rustls client configured from a client
//! directory of [`super::pki`] (as libnbd reads one: `ca-cert.pem`, and
//! `client-cert.pem` + `client-key.pem` when present), and a handshake
//! between it and a `rustls::ServerConnection` over a loopback TCP pair
//! (blocking sockets, 10 s timeouts, the client in a thread).

use rustls::client::ClientConnection;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::ServerConnection;
use rustls::{
    ClientConfig, RootCertStore, ServerConfig, StreamOwned, SupportedCipherSuite,
    SupportedProtocolVersion,
};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A client trusting `dir/ca-cert.pem`, presenting `dir/client-cert.pem`
/// (with its key) if there is one, offering only `versions` and, if given,
/// only the cipher suite `suite`.
pub fn client_config(
    dir: &Path,
    versions: &[&'static SupportedProtocolVersion],
    suite: Option<rustls::CipherSuite>,
) -> Arc<ClientConfig> {
    let mut provider: CryptoProvider = rustls::crypto::ring::default_provider();
    if let Some(want) = suite {
        provider
            .cipher_suites
            .retain(|s: &SupportedCipherSuite| s.suite() == want);
        assert!(!provider.cipher_suites.is_empty(), "ring has no {want:?}");
    }
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(dir.join("ca-cert.pem")).expect("read ca-cert.pem") {
        roots.add(c.expect("a CA certificate")).expect("add the CA");
    }
    let b = ClientConfig::builder_with_provider(Arc::new(provider))
        .with_protocol_versions(versions)
        .expect("protocol versions")
        .with_root_certificates(roots);
    let cert = dir.join("client-cert.pem");
    let cfg = if cert.exists() {
        let chain = CertificateDer::pem_file_iter(&cert)
            .expect("read client-cert.pem")
            .collect::<Result<Vec<_>, _>>()
            .expect("client certificates");
        let key = PrivateKeyDer::from_pem_file(dir.join("client-key.pem")).expect("client key");
        b.with_client_auth_cert(chain, key).expect("client auth")
    } else {
        b.with_no_client_auth()
    };
    Arc::new(cfg)
}

/// Both ends after a handshake attempt.
pub struct Handshake {
    /// The server's socket (plain TCP; the TLS state is in `server`).
    pub server_sock: TcpStream,
    pub server: Result<ServerConnection, String>,
    pub client: Result<StreamOwned<ClientConnection, TcpStream>, String>,
}

/// Connects a client with `client` to a server with `server` on loopback
/// and runs the handshake to its end on both sides. When the server fails,
/// its socket is shut down before the client is waited for.
pub fn handshake(server: Arc<ServerConfig>, client: Arc<ClientConfig>) -> Handshake {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
    let addr = l.local_addr().expect("local addr");
    let t = std::thread::spawn(move || -> Result<_, String> {
        let mut sock = TcpStream::connect(addr).map_err(|e| e.to_string())?;
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .map_err(|e| e.to_string())?;
        let name = ServerName::try_from("localhost").expect("server name");
        let mut c = ClientConnection::new(client, name).map_err(|e| e.to_string())?;
        while c.is_handshaking() {
            c.complete_io(&mut sock).map_err(|e| e.to_string())?;
        }
        Ok(StreamOwned::new(c, sock))
    });
    let (mut sock, _) = l.accept().expect("accept");
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut s = ServerConnection::new(server).expect("server connection");
    let mut result = Ok(());
    while s.is_handshaking() {
        if let Err(e) = s.complete_io(&mut sock) {
            result = Err(e.to_string());
            break;
        }
    }
    // Flush what the handshake left to send (TLS 1.3 tickets are off, but
    // a TLS 1.2 server's Finished may still be queued).
    while result.is_ok() && s.wants_write() {
        if let Err(e) = s.write_tls(&mut sock) {
            result = Err(e.to_string());
        }
    }
    if result.is_err() {
        let _ = sock.shutdown(Shutdown::Both);
    }
    let client = t.join().expect("client thread");
    Handshake {
        server_sock: sock,
        server: result.map(|()| s),
        client,
    }
}
