//! The kernel's NBD client over TLS: `nbd-client HOST PORT -N NAME
//! -cacertfile -certfile -keyfile` (nbd-client does the TLS in its own
//! process and hands the kernel a socket pair) connected to `loopd serve
//! --tls require --tls-verify-peer --listen 127.0.0.1:PORT`: ext4 on
//! /dev/nbdN survives a cache drop and a new TLS session, with the records in
//! loopd's userspace layer (`--no-ktls`) and in the kernel (kTLS, proved by
//! /proc/net/tls_stat); a plaintext client, a client with a certificate from
//! another CA and a client without a certificate are refused and nothing is
//! attached.
//!
//! Runs as root inside the VM `scripts/vm-test.sh tls` boots (modules `nbd`
//! and `tls` loaded, TMPDIR on a tmpfs). The PKI is `common::pki` (openssl)
//! in the test's temp dir. Every server, device and mount is a guard
//! released on drop.

#![cfg(feature = "vm-tests")]

mod common;

use common::kernel::*;
use common::pki::Pki;
use common::*;
use std::collections::BTreeMap;
use std::ffi::{OsStr, OsString};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The logical block size the server advertises and `nbd-client -b` sets.
const BS: u32 = 4096;

/// Bound on an nbd-client that must be refused (it must not hang either).
const REFUSE_TIMEOUT: Duration = Duration::from_secs(60);

fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-ktls")
        .tempdir()
        .expect("tempdir in TMPDIR")
}

/// `loopd serve IMG --listen 127.0.0.1:PORT --tls require --tls-certs DIR
/// --tls-verify-peer EXTRA...`, ready once it printed its control line
/// (after the nbds:// URIs).
fn serve_tls(img: &Path, certs: &Path, extra: &[&str]) -> Server {
    require_root();
    Server::builder(img)
        .tcp()
        .with_control()
        .args([
            "--block-size",
            &BS.to_string(),
            "--tls",
            "require",
            "--tls-certs",
        ])
        .arg(certs)
        .arg("--tls-verify-peer")
        .args(extra)
        .start()
}

/// A client's TLS files as nbd-client takes them.
struct ClientTls {
    ca: PathBuf,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

impl ClientTls {
    /// The three files of a `Pki::client_dir`.
    fn from_dir(dir: &Path) -> ClientTls {
        ClientTls {
            ca: dir.join("ca-cert.pem"),
            cert: Some(dir.join("client-cert.pem")),
            key: Some(dir.join("client-key.pem")),
        }
    }
}

/// nbd-client's arguments (without the device) for the server's TCP port,
/// with TLS when `tls` is given.
fn client_args(srv: &Server, tls: Option<&ClientTls>) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec![
        "127.0.0.1".into(),
        srv.port().to_string().into(),
        "-N".into(),
        srv.name().into(),
        "-b".into(),
        BS.to_string().into(),
    ];
    if let Some(t) = tls {
        a.extend(["-cacertfile".into(), t.ca.clone().into_os_string()]);
        match (&t.cert, &t.key) {
            (Some(c), Some(k)) => a.extend([
                "-certfile".into(),
                c.clone().into_os_string(),
                "-keyfile".into(),
                k.clone().into_os_string(),
            ]),
            _ => a.push("-enable-tls".into()),
        }
    }
    a
}

fn connect(args: &[OsString]) -> NbdDev {
    let refs: Vec<&OsStr> = args.iter().map(OsString::as_os_str).collect();
    NbdDev::connect_with(&refs)
}

/// The software kTLS counters of /proc/net/tls_stat (`Tls*Sw` and
/// `TlsDecryptError`) as name → value; `None` without the `tls` module.
fn tls_stat() -> Option<BTreeMap<String, u64>> {
    let text = fs::read_to_string("/proc/net/tls_stat").ok()?;
    Some(
        text.lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                Some((it.next()?.to_string(), it.next()?.parse().ok()?))
            })
            .filter(|(k, _)| k.ends_with("Sw") || k == "TlsDecryptError")
            .collect(),
    )
}

fn stat(s: &BTreeMap<String, u64>, k: &str) -> u64 {
    *s.get(k)
        .unwrap_or_else(|| panic!("/proc/net/tls_stat has no {k}: {s:?}"))
}

fn require_tls_stat() -> BTreeMap<String, u64> {
    require_module("tls");
    tls_stat().expect("/proc/net/tls_stat missing with the tls module loaded")
}

/// Drops the page cache, dentries and inodes (nothing read later can come
/// from memory).
fn drop_caches() {
    sh(KCMD_TIMEOUT, "sync", Vec::<&str>::new());
    fs::write("/proc/sys/vm/drop_caches", "3").expect("write /proc/sys/vm/drop_caches");
}

/// ext4 on /dev/nbdN over TLS: files written and synced; the device
/// disconnected, caches dropped, a new TLS session: e2fsck finds the
/// filesystem clean and every file reads back byte for byte. With `ktls`
/// the kernel carried the records of loopd's side of both sessions
/// (TlsCurrTxSw/RxSw up while connected, TlsTxSw/RxSw counted them); with
/// `--no-ktls` it carried none.
fn ext4_over_tls(ktls: bool) {
    let before = require_tls_stat();
    let dir = scratch();
    let pki = Pki::new(dir.path().join("pki"));
    let server = pki.server_dir("server");
    let client = ClientTls::from_dir(&pki.client_dir("alice"));
    let img = dir.path().join("ext4.img");
    create_sparse_image(&img, 64 * MIB);
    let srv = serve_tls(&img, &server, if ktls { &[] } else { &["--no-ktls"] });
    let args = client_args(&srv, Some(&client));
    let mnt = dir.path().join("mnt");
    let files: Vec<(&str, Vec<u8>)> = vec![
        ("big.bin", pattern_bytes(1, 0, 3 * 1024 * 1024 + 123)),
        ("sub/small.bin", pattern_bytes(2, 0, 5000)),
        ("sub/deeper/one-block.bin", pattern_bytes(3, 0, 4096)),
    ];

    let nbd = connect(&args);
    let curr_up = |s: &BTreeMap<String, u64>| {
        (
            stat(s, "TlsCurrTxSw").saturating_sub(stat(&before, "TlsCurrTxSw")),
            stat(s, "TlsCurrRxSw").saturating_sub(stat(&before, "TlsCurrRxSw")),
        )
    };
    // loopd may hand the keys to the kernel just after the handshake the
    // client already finished: look for up to 5 s.
    let mut during = require_tls_stat();
    for _ in 0..50 {
        if !ktls || curr_up(&during) == (1, 1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        during = require_tls_stat();
    }
    if ktls {
        assert_eq!(
            curr_up(&during),
            (1, 1),
            "with kTLS loopd's socket should have kernel TLS for TX and RX while connected: \
             before {before:?}, during {during:?}\n--- loopd stderr ---\n{}",
            srv.stderr_text()
        );
    } else {
        assert_eq!(
            curr_up(&during),
            (0, 0),
            "--no-ktls: no socket should have kernel TLS: before {before:?}, during {during:?}"
        );
    }
    mkfs_ext4(nbd.path());
    let m = Mount::new(nbd.path(), &mnt, None);
    for (name, data) in &files {
        let p = m.dir().join(name);
        if let Some(parent) = p.parent() {
            fs::create_dir_all(parent).expect("mkdir in the mounted filesystem");
        }
        fs::write(&p, data).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
    }
    sh(
        KCMD_TIMEOUT,
        "sync",
        [OsStr::new("-f"), m.dir().as_os_str()],
    );
    m.unmount();
    nbd.disconnect();
    drop_caches();
    assert_eq!(
        read_range(&img, 1024 + 56, 2),
        [0x53, 0xEF],
        "no ext4 superblock in the image file after the TLS session"
    );

    let nbd = connect(&args);
    let fsck = sh_status(
        KCMD_TIMEOUT,
        "e2fsck",
        [OsStr::new("-fn"), nbd.path().as_os_str()],
    );
    assert!(fsck.success(), "e2fsck -fn over TLS found problems: {fsck}");
    let m = Mount::new(nbd.path(), &mnt, Some("ro"));
    for (name, data) in &files {
        let got = read_file(&m.dir().join(name));
        assert_bytes_eq(&got, data, 0, &format!("{name} after remount over TLS"));
    }
    m.unmount();
    nbd.disconnect();

    let after = require_tls_stat();
    let counted = |k: &str| stat(&after, k) - stat(&before, k);
    if ktls {
        assert!(
            counted("TlsTxSw") >= 2 && counted("TlsRxSw") >= 2,
            "two sessions with kTLS should count 2 TX and 2 RX kernel TLS sockets: \
             before {before:?}, after {after:?}"
        );
        assert_eq!(counted("TlsDecryptError"), 0, "kernel TLS decrypt errors");
    } else {
        assert_eq!(
            (counted("TlsTxSw"), counted("TlsRxSw")),
            (0, 0),
            "--no-ktls: the kernel took TLS keys: before {before:?}, after {after:?}"
        );
    }
}

#[test]
fn ext4_over_tls_userspace_records() {
    ext4_over_tls(false);
}

#[test]
fn ext4_over_ktls() {
    ext4_over_tls(true);
}

/// Runs nbd-client on a free device; it must fail and leave the device free.
fn assert_refused(srv: &mut Server, tls: Option<&ClientTls>, what: &str) {
    require_module("nbd");
    let index = first_free_nbd().expect("a free /dev/nbdN");
    let dev = PathBuf::from(format!("/dev/nbd{index}"));
    let mut args = client_args(srv, tls);
    args.push(dev.clone().into_os_string());
    let out = sh_status(REFUSE_TIMEOUT, "nbd-client", &args);
    let free = nbd_is_free(index);
    if out.success() || !free {
        // Let go of the device before failing.
        let _ = sh_status(
            KCMD_TIMEOUT,
            "nbd-client",
            [OsStr::new("-d"), dev.as_os_str()],
        );
        panic!(
            "{what}: nbd-client was not refused ({} {}): {out}\n--- loopd stderr ---\n{}",
            dev.display(),
            if free { "free" } else { "attached" },
            srv.stderr_text()
        );
    }
    srv.assert_running();
}

/// A plaintext nbd-client, a client whose certificate comes from another CA
/// and a client with no certificate are each refused by `--tls require
/// --tls-verify-peer`, with no device attached; a client with a good
/// certificate still connects afterwards (the refusals were about the
/// credentials, not a broken server).
#[test]
fn bad_clients_are_refused_and_nothing_attaches() {
    let dir = scratch();
    let pki = Pki::new(dir.path().join("pki"));
    let other = Pki::new(dir.path().join("other"));
    let server = pki.server_dir("server");
    let good = ClientTls::from_dir(&pki.client_dir("alice"));
    let foreign = other.client_dir("mallory");
    let img = dir.path().join("r.img");
    create_sparse_image(&img, 16 * MIB);
    let mut srv = serve_tls(&img, &server, &[]);

    assert_refused(&mut srv, None, "plaintext client against --tls require");
    let wrong_ca = ClientTls {
        ca: pki.ca_cert().to_path_buf(),
        cert: Some(foreign.join("client-cert.pem")),
        key: Some(foreign.join("client-key.pem")),
    };
    assert_refused(
        &mut srv,
        Some(&wrong_ca),
        "client certificate from another CA with --tls-verify-peer",
    );
    let no_cert = ClientTls {
        ca: pki.ca_cert().to_path_buf(),
        cert: None,
        key: None,
    };
    assert_refused(
        &mut srv,
        Some(&no_cert),
        "TLS client without a certificate with --tls-verify-peer",
    );

    let nbd = connect(&client_args(&srv, Some(&good)));
    assert_eq!(nbd.size(), 16 * MIB, "the good client's device size");
    nbd.disconnect();
}
