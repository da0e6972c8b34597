//! A throwaway X.509 PKI for the TLS tests, made with the `openssl` command
//! (installed by scripts/install-test-deps.sh) in the test's temp dir.
//!
//! Layout under the directory given to [`Pki::new`]:
//!
//! - `ca/ca-cert.pem`, `ca/ca-key.pem`: the CA. Its key never leaves `ca/`.
//! - [`Pki::server_dir`]`(name)` → `NAME/` with `ca-cert.pem`,
//!   `server-cert.pem`, `server-key.pem` (what `loopd --tls-certificates`,
//!   nbdkit and qemu's `tls-creds-x509,endpoint=server,dir=` read). The
//!   certificate names `IP:127.0.0.1` and `DNS:localhost`.
//! - [`Pki::client_dir`]`(cn)` → `client-CN/` with `ca-cert.pem`,
//!   `client-cert.pem`, `client-key.pem` (what libnbd's `tls-certificates=`
//!   and qemu's `tls-creds-x509,endpoint=client,dir=` read; nbd-client takes
//!   the three files as `-cacertfile -certfile -keyfile`).
//! - [`Pki::trust_dir`]`(name)` → `NAME/` with `ca-cert.pem` only: a client
//!   that checks the server but has no certificate of its own.
//!
//! Leaf certificates are v3 with basicConstraints CA:FALSE, keyUsage
//! digitalSignature and keyEncipherment (qemu wants both), extendedKeyUsage
//! serverAuth or clientAuth, subject/authority key identifiers — what
//! GnuTLS (libnbd, qemu, nbdkit) and webpki (rustls) demand. Keys are EC
//! P-256 in PKCS#8 unless [`KeyFormat`] says otherwise, mode 0600 (the tests
//! run as root). Every certificate gets a fresh random serial.
//!
//! Revocation: [`Pki::revoke`] records a certificate as revoked in the CA's
//! `openssl ca` database (`ca/index.txt`), and [`Pki::write_crl`] writes the
//! CA's current CRL as `ca-crl.pem` into a directory (nbdkit's and QEMU's
//! name for it); [`Pki::write_expired_crl`] writes one whose nextUpdate is
//! past.
//!
//! A second, independent CA is just another `Pki::new` (in another
//! directory). Renewal: [`Pki::renew_server`] re-issues `server-cert.pem`
//! and `server-key.pem` in an existing server directory, signed by `self`
//! (renamed into place, so a reader never sees half a file).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// How a leaf's private key is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyFormat {
    /// EC P-256, `BEGIN PRIVATE KEY` (PKCS#8). The default.
    Pkcs8Ec,
    /// RSA 2048, `BEGIN PRIVATE KEY` (PKCS#8).
    Pkcs8Rsa,
    /// RSA 2048, `BEGIN RSA PRIVATE KEY` (PKCS#1).
    Pkcs1Rsa,
    /// EC P-256, `BEGIN EC PRIVATE KEY` (SEC1).
    Sec1Ec,
}

impl KeyFormat {
    fn is_rsa(self) -> bool {
        matches!(self, KeyFormat::Pkcs8Rsa | KeyFormat::Pkcs1Rsa)
    }
}

/// Which extendedKeyUsage a leaf gets, and the file names it is stored under.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Server,
    Client,
}

impl Role {
    fn eku(self) -> &'static str {
        match self {
            Role::Server => "serverAuth",
            Role::Client => "clientAuth",
        }
    }
    fn files(self) -> (&'static str, &'static str) {
        match self {
            Role::Server => ("server-cert.pem", "server-key.pem"),
            Role::Client => ("client-cert.pem", "client-key.pem"),
        }
    }
}

/// What to put in one leaf certificate ([`Pki::issue`]).
#[derive(Clone, Debug)]
pub struct Leaf {
    pub role: Role,
    /// The subject in openssl's `-subj` form, e.g. `/O=Example/CN=alice`.
    pub subject: String,
    /// subjectAltName entries in openssl's form (`DNS:x`, `IP:1.2.3.4`,
    /// `email:a@b`, `URI:nbd://x`); empty for none.
    pub sans: Vec<String>,
    pub key: KeyFormat,
    pub days: u32,
}

impl Leaf {
    /// A server leaf for `IP:127.0.0.1, DNS:localhost`.
    pub fn server() -> Leaf {
        Leaf {
            role: Role::Server,
            subject: "/O=loopd tests/CN=localhost".into(),
            sans: vec!["IP:127.0.0.1".into(), "DNS:localhost".into()],
            key: KeyFormat::Pkcs8Ec,
            days: 365,
        }
    }

    /// A client leaf with subject `/CN=cn` and no SANs.
    pub fn client(cn: &str) -> Leaf {
        Leaf {
            role: Role::Client,
            subject: format!("/CN={cn}"),
            sans: Vec::new(),
            key: KeyFormat::Pkcs8Ec,
            days: 365,
        }
    }
}

/// One test CA and the directories issued from it.
pub struct Pki {
    dir: PathBuf,
    ca_cert: PathBuf,
    ca_key: PathBuf,
}

fn openssl(args: &[&str]) {
    let bin = super::require_tool("openssl");
    let out = Command::new(&bin)
        .args(args)
        .env("PATH", super::tool_path_env())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
    if !out.status.success() {
        panic!(
            "openssl {} failed ({}):\n{}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

fn openssl_out(args: &[&str]) -> String {
    let bin = super::require_tool("openssl");
    let out = Command::new(&bin)
        .args(args)
        .env("PATH", super::tool_path_env())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
    assert!(
        out.status.success(),
        "openssl {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn s(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// A serial number no other certificate of this test run has: 16 hex
/// digits from the time, the PID and a counter (positive: first digit 1..7).
fn fresh_serial() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() ^ (u64::from(d.subsec_nanos()) << 32))
        .unwrap_or(0);
    let mixed = t ^ (u64::from(std::process::id()) << 40) ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    format!(
        "0x{:016x}",
        (mixed & 0x3fff_ffff_ffff_ffff) | 0x1000_0000_0000_0000
    )
}

fn write_private(path: &Path, text: &str) {
    fs::write(path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
}

fn gen_key(path: &Path, format: KeyFormat) {
    let tmp = path.with_extension("pkcs8");
    if format.is_rsa() {
        openssl(&[
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
            s(&tmp),
        ]);
    } else {
        openssl(&[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            s(&tmp),
        ]);
    }
    match format {
        KeyFormat::Pkcs8Ec | KeyFormat::Pkcs8Rsa => {
            fs::rename(&tmp, path).expect("rename the key");
        }
        KeyFormat::Pkcs1Rsa => {
            openssl(&["rsa", "-in", s(&tmp), "-traditional", "-out", s(path)]);
            fs::remove_file(&tmp).expect("remove the PKCS#8 key");
        }
        KeyFormat::Sec1Ec => {
            openssl(&["ec", "-in", s(&tmp), "-out", s(path)]);
            fs::remove_file(&tmp).expect("remove the PKCS#8 key");
        }
    }
    fs::set_permissions(path, fs::Permissions::from_mode(0o600)).expect("chmod the key");
}

impl Pki {
    /// A new CA (subject `/O=loopd tests/CN=loopd test CA <dir>`) under
    /// `dir/ca/`; `dir` is created if missing.
    pub fn new(dir: impl AsRef<Path>) -> Pki {
        let dir = dir.as_ref().to_path_buf();
        let ca = dir.join("ca");
        fs::create_dir_all(&ca).unwrap_or_else(|e| panic!("mkdir {}: {e}", ca.display()));
        let ca_cert = ca.join("ca-cert.pem");
        let ca_key = ca.join("ca-key.pem");
        gen_key(&ca_key, KeyFormat::Pkcs8Ec);
        let cfg = ca.join("ca.cnf");
        write_private(
            &cfg,
            "[req]\ndistinguished_name = dn\nx509_extensions = ext\n[dn]\n[ext]\n\
             basicConstraints = critical, CA:TRUE\n\
             keyUsage = critical, keyCertSign, cRLSign\n\
             subjectKeyIdentifier = hash\n",
        );
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let subject = format!("/O=loopd tests/CN=loopd test CA {name}");
        let serial = fresh_serial();
        openssl(&[
            "req",
            "-x509",
            "-new",
            "-config",
            s(&cfg),
            "-key",
            s(&ca_key),
            "-subj",
            &subject,
            "-set_serial",
            &serial,
            "-days",
            "3650",
            "-out",
            s(&ca_cert),
        ]);
        Pki {
            dir,
            ca_cert,
            ca_key,
        }
    }

    /// The `openssl ca` configuration for this CA's CRLs (made on first use:
    /// an empty database, CRL number 1).
    fn ca_config(&self) -> PathBuf {
        let ca = self.dir.join("ca");
        let cfg = ca.join("crl.cnf");
        if !cfg.exists() {
            write_private(&ca.join("index.txt"), "");
            write_private(&ca.join("index.txt.attr"), "unique_subject = no\n");
            write_private(&ca.join("crlnumber"), "01\n");
            write_private(
                &cfg,
                &format!(
                    "[ca]\ndefault_ca = loopd_test\n[loopd_test]\n\
                     database = {}\ncrlnumber = {}\ncertificate = {}\nprivate_key = {}\n\
                     default_md = sha256\ndefault_crl_days = 30\n",
                    s(&ca.join("index.txt")),
                    s(&ca.join("crlnumber")),
                    s(&self.ca_cert),
                    s(&self.ca_key)
                ),
            );
        }
        cfg
    }

    /// Record the certificate `cert` (issued by this CA) as revoked; the next
    /// [`Pki::write_crl`] lists it.
    pub fn revoke(&self, cert: &Path) {
        let cfg = self.ca_config();
        openssl(&["ca", "-config", s(&cfg), "-revoke", s(cert)]);
    }

    /// Write this CA's CRL (every certificate revoked so far; valid 30 days)
    /// to `dir/ca-crl.pem`, renamed into place.
    pub fn write_crl(&self, dir: &Path) {
        self.gen_crl(dir, &[]);
    }

    /// Like [`Pki::write_crl`], but the CRL's lastUpdate is two days ago and
    /// its nextUpdate yesterday: expired.
    pub fn write_expired_crl(&self, dir: &Path) {
        let day = |ago: u64| {
            let t = std::time::SystemTime::now() - std::time::Duration::from_secs(ago * 86_400);
            openssl_time(t)
        };
        self.gen_crl(
            dir,
            &["-crl_lastupdate", &day(2), "-crl_nextupdate", &day(1)],
        );
    }

    fn gen_crl(&self, dir: &Path, extra: &[&str]) {
        let cfg = self.ca_config();
        let tmp = dir.join(".ca-crl.pem.tmp");
        let mut args = vec!["ca", "-config", s(&cfg), "-gencrl", "-out", s(&tmp)];
        args.extend_from_slice(extra);
        openssl(&args);
        fs::rename(&tmp, dir.join("ca-crl.pem")).expect("rename the CRL into place");
    }

    /// The CA's certificate (`dir/ca/ca-cert.pem`).
    pub fn ca_cert(&self) -> &Path {
        &self.ca_cert
    }

    /// The directory given to [`Pki::new`].
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Copies this CA's certificate to `dir/ca-cert.pem` (creating `dir`).
    pub fn install_ca(&self, dir: &Path) {
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let tmp = dir.join(".ca-cert.pem.tmp");
        fs::copy(&self.ca_cert, &tmp).expect("copy the CA certificate");
        fs::rename(&tmp, dir.join("ca-cert.pem")).expect("rename the CA certificate");
    }

    /// Issues `leaf`, signed by this CA, into `dir` under the role's file
    /// names (`server-cert.pem`/`server-key.pem` or `client-…`), replacing
    /// any earlier ones by rename. Does not touch `dir/ca-cert.pem`.
    pub fn issue(&self, dir: &Path, leaf: &Leaf) {
        fs::create_dir_all(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let work = tempfile::Builder::new()
            .prefix(".issue-")
            .tempdir_in(dir)
            .expect("a work directory");
        let key = work.path().join("key.pem");
        let csr = work.path().join("req.csr");
        let cert = work.path().join("cert.pem");
        let cfg = work.path().join("leaf.cnf");
        gen_key(&key, leaf.key);
        // qemu demands keyEncipherment in a critical keyUsage whatever the
        // key type ("usage does not permit key encipherment").
        let usage = "digitalSignature, keyEncipherment";
        let mut ext = format!(
            "[req]\ndistinguished_name = dn\n[dn]\n[ext]\n\
             basicConstraints = critical, CA:FALSE\n\
             keyUsage = critical, {usage}\n\
             extendedKeyUsage = {}\n\
             subjectKeyIdentifier = hash\n\
             authorityKeyIdentifier = keyid\n",
            leaf.role.eku()
        );
        if !leaf.sans.is_empty() {
            ext.push_str(&format!("subjectAltName = {}\n", leaf.sans.join(", ")));
        }
        write_private(&cfg, &ext);
        openssl(&[
            "req",
            "-new",
            "-utf8",
            "-config",
            s(&cfg),
            "-key",
            s(&key),
            "-subj",
            &leaf.subject,
            "-out",
            s(&csr),
        ]);
        let days = leaf.days.to_string();
        let serial = fresh_serial();
        openssl(&[
            "x509",
            "-req",
            "-in",
            s(&csr),
            "-CA",
            s(&self.ca_cert),
            "-CAkey",
            s(&self.ca_key),
            "-set_serial",
            &serial,
            "-days",
            &days,
            "-extfile",
            s(&cfg),
            "-extensions",
            "ext",
            "-out",
            s(&cert),
        ]);
        let (cert_name, key_name) = leaf.role.files();
        fs::rename(&key, dir.join(key_name)).expect("rename the key into place");
        fs::rename(&cert, dir.join(cert_name)).expect("rename the certificate into place");
    }

    /// `self.dir/name/` with `ca-cert.pem` (this CA), `server-cert.pem` and
    /// `server-key.pem` for `IP:127.0.0.1, DNS:localhost`.
    pub fn server_dir(&self, name: &str) -> PathBuf {
        self.server_dir_with(name, &Leaf::server())
    }

    /// [`Pki::server_dir`] with a leaf of your own (key format, SANs, subject).
    pub fn server_dir_with(&self, name: &str, leaf: &Leaf) -> PathBuf {
        let dir = self.dir.join(name);
        self.install_ca(&dir);
        self.issue(&dir, leaf);
        dir
    }

    /// Re-issues `server-cert.pem` and `server-key.pem` (fresh key and
    /// serial, same names) in an existing server directory, signed by this
    /// CA, which may be another CA than the one that made `dir`.
    pub fn renew_server(&self, dir: &Path) {
        self.issue(dir, &Leaf::server());
    }

    /// `self.dir/client-CN/` with `ca-cert.pem` (this CA), `client-cert.pem`
    /// (subject `/CN=cn`, extendedKeyUsage clientAuth) and `client-key.pem`.
    pub fn client_dir(&self, cn: &str) -> PathBuf {
        self.client_dir_with(&format!("client-{cn}"), &Leaf::client(cn))
    }

    /// `self.dir/name/` with `ca-cert.pem` and the client leaf described.
    pub fn client_dir_with(&self, name: &str, leaf: &Leaf) -> PathBuf {
        let dir = self.dir.join(name);
        self.install_ca(&dir);
        self.issue(&dir, leaf);
        dir
    }

    /// `self.dir/name/` with only `ca-cert.pem`: trusts this CA, no
    /// certificate of its own.
    pub fn trust_dir(&self, name: &str) -> PathBuf {
        let dir = self.dir.join(name);
        self.install_ca(&dir);
        dir
    }
}

/// `t` as `openssl ca -crl_lastupdate` takes it: `YYYYMMDDHHMMSSZ` (UTC),
/// from date(1).
fn openssl_time(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs();
    let out = Command::new("date")
        .args(["-u", "-d", &format!("@{secs}"), "+%Y%m%d%H%M%SZ"])
        .output()
        .unwrap_or_else(|e| panic!("run date: {e}"));
    assert!(out.status.success(), "date failed");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A certificate's serial as openssl prints it (upper-case hex, no `0x`).
pub fn serial_of(cert: &Path) -> String {
    let out = openssl_out(&["x509", "-in", s(cert), "-noout", "-serial"]);
    out.trim()
        .strip_prefix("serial=")
        .unwrap_or(out.trim())
        .to_string()
}

/// A certificate's subject in RFC 2253 order (`CN=alice,O=Example`).
pub fn subject_of(cert: &Path) -> String {
    let out = openssl_out(&[
        "x509",
        "-in",
        s(cert),
        "-noout",
        "-subject",
        "-nameopt",
        "RFC2253",
    ]);
    out.trim()
        .strip_prefix("subject=")
        .unwrap_or(out.trim())
        .to_string()
}

/// The DER bytes of the first certificate in a PEM file.
pub fn cert_der(cert: &Path) -> Vec<u8> {
    let bin = super::require_tool("openssl");
    let out = Command::new(&bin)
        .args(["x509", "-in", s(cert), "-outform", "DER"])
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()));
    assert!(out.status.success(), "openssl x509 -outform DER failed");
    out.stdout
}
