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

/// A reader of the socket that never reads past the TLS record in progress.
pub struct Bounded<'a> {
    pub sock: &'a mut TcpStream,
    pub records: &'a mut loopd::tls::RecordBoundary,
}

impl std::io::Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(self.records.max_read());
        let got = self.sock.read(&mut buf[..n])?;
        self.records.consumed(&buf[..got]);
        Ok(got)
    }
}

/// Like [`handshake`], but the client sends `early` as soon as its side of
/// the handshake is done, and the server reads the socket record by record
/// ([`Bounded`]), pausing 200 ms after each flight it sends, so that the
/// client's data is in the socket, right behind its Finished, when the
/// server reads that. Returns where the server's reads stopped.
pub fn handshake_pipelined(
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    early: Vec<u8>,
) -> (Handshake, loopd::tls::RecordBoundary) {
    use std::io::Write;
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
        let mut s = StreamOwned::new(c, sock);
        s.write_all(&early).map_err(|e| e.to_string())?;
        s.flush().map_err(|e| e.to_string())?;
        Ok(s)
    });
    let (mut sock, _) = l.accept().expect("accept");
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut s = ServerConnection::new(server).expect("server connection");
    let mut records = loopd::tls::RecordBoundary::new();
    let mut run = || -> Result<(), String> {
        while s.is_handshaking() {
            let mut sent = false;
            while s.wants_write() {
                s.write_tls(&mut sock).map_err(|e| e.to_string())?;
                sent = true;
            }
            if sent {
                std::thread::sleep(Duration::from_millis(200));
            }
            if !s.is_handshaking() {
                break;
            }
            let mut r = Bounded {
                sock: &mut sock,
                records: &mut records,
            };
            if s.read_tls(&mut r).map_err(|e| e.to_string())? == 0 {
                return Err("EOF during the handshake".into());
            }
            s.process_new_packets().map_err(|e| e.to_string())?;
        }
        while s.wants_write() {
            s.write_tls(&mut sock).map_err(|e| e.to_string())?;
        }
        Ok(())
    };
    let result = run();
    if result.is_err() {
        let _ = sock.shutdown(Shutdown::Both);
    }
    let client = t.join().expect("client thread");
    (
        Handshake {
            server_sock: sock,
            server: result.map(|()| s),
            client,
        },
        records,
    )
}
