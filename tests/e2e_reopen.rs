//! A root daemon opens an image path again only if it names the file it first
//! opened. The image is swapped (by whoever owns its directory) for a symbolic
//! link to a root-only 0600 file holding a secret, for another regular file,
//! or for a FIFO, and then each way loopd could open it again is tried: `set`
//! and `resize` keep serving the file the device has, a restart and the
//! retry of a missing device refuse the path with a reason; no NBD client
//! reads the secret or writes that file (its bytes are checked), and a FIFO
//! hangs nothing. Putting the image back brings the device back.

mod common;

use common::*;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const SIZE: u64 = 4 * MIB;

/// A root-only (0600) file of 8 MiB of `TOPSECRET-…` in a directory of its own.
fn secret(dir: &Path) -> (PathBuf, Vec<u8>) {
    let d = dir.join("root-only");
    std::fs::create_dir(&d).unwrap();
    let p = d.join("secret");
    let bytes: Vec<u8> = b"TOPSECRET-"
        .iter()
        .copied()
        .cycle()
        .take(8 << 20)
        .collect();
    std::fs::write(&p, &bytes).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    (p, bytes)
}

/// "544f50534543524554": how the secret looks in a client's hex dump.
const SECRET_HEX: &str = "544f50534543524554";

/// What the image path is swapped for.
#[derive(Clone, Copy, Debug)]
enum Swap {
    /// A symbolic link to the secret.
    Link,
    /// Another regular file (a copy of the secret).
    Other,
    /// A FIFO.
    Fifo,
}

impl Swap {
    /// Words of the reason a refused device is missing for.
    fn reason(self) -> &'static str {
        match self {
            Swap::Link => "now goes through a symbolic link",
            Swap::Other => "now names a different file",
            Swap::Fifo => "is a FIFO, not a regular file or block device",
        }
    }
}

/// Put `what` at `img` (which must be free).
fn plant(img: &Path, what: Swap, secret: &Path) {
    match what {
        Swap::Link => std::os::unix::fs::symlink(secret, img).unwrap(),
        Swap::Other => {
            std::fs::copy(secret, img).unwrap();
        }
        Swap::Fifo => {
            run("mkfifo", [path_str(img)]);
        }
    }
}

/// An NBD client tries device `name` over `sock`: open it, read its first
/// 64 bytes, write 4 KiB of 0xee at 0, flush. Its output (hex of what it read).
fn client_tries(sock: &Path, name: &str) -> String {
    let uri = format!("nbd+unix:///{name}?socket={}", sock.display());
    let script = format!(
        "g = nbd.NBD()\n\
         try:\n    g.connect_uri({u})\n\
         except nbd.Error as e:\n    print('REFUSED', e.string)\n    sys.exit(0)\n\
         print('READ', g.pread(64, 0).hex())\n\
         try:\n    g.pwrite(b'\\xee' * 4096, 0)\n    g.flush()\n    print('WROTE')\n\
         except nbd.Error as e:\n    print('WRITE FAILED', e.string)\n",
        u = py_str(&uri)
    );
    nbdsh(&script).stdout
}

#[track_caller]
fn assert_secret_safe(client: &str, secret: &Path, bytes: &[u8]) {
    assert!(
        !client.contains(SECRET_HEX),
        "an NBD client read the secret:\n{client}"
    );
    assert!(
        std::fs::read(secret).unwrap() == bytes,
        "the secret file was written through loopd"
    );
}

/// Polls `list` until device `name` is in `state` with a reason containing
/// `words` (any reason for "live"); panics after `timeout`.
fn wait_device(srv: &Server, name: &str, state: &str, words: &str, timeout: Duration) {
    let t = Instant::now();
    loop {
        let d = srv.device(name);
        if let Some(d) = &d {
            let reason = d
                .get("reason")
                .map(|r| r.str().to_owned())
                .unwrap_or_default();
            if d.at("state").str() == state && reason.contains(words) {
                return;
            }
        }
        assert!(
            t.elapsed() < timeout,
            "device {name:?} not {state} ({words:?}) after {timeout:?}: {d:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `set` (which opens the file anew for its new cache mode) and `resize`
/// (which reads the size again) after the image was swapped for a link to the
/// secret, another file and a FIFO: they keep the file the device serves (its
/// bytes, its size), say in the log that the path names another file now, and
/// return at once with a FIFO there; the secret is neither read nor written.
#[test]
fn set_and_resize_keep_the_file_the_device_has() {
    let dir = tempdir();
    let (secret, secret_bytes) = secret(dir.path());
    let img = dir.path().join("v.img");
    create_pattern_image(&img, SIZE, 1);
    let srv = Server::daemon().start();
    srv.ctl_ok(&["attach", path_str(&img), "--cache", "buffered"]);
    let sock = srv.socket().to_path_buf();
    let orig = dir.path().join("v.orig");
    std::fs::rename(&img, &orig).unwrap();
    let caches = ["direct", "buffered", "direct"];
    for (swap, cache) in [Swap::Link, Swap::Other, Swap::Fifo]
        .into_iter()
        .zip(caches)
    {
        plant(&img, swap, &secret);
        let t = Instant::now();
        srv.ctl_ok(&["set", "v", "--cache", cache]);
        srv.ctl_ok(&["resize", "v"]);
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{swap:?}: set/resize took {:?}",
            t.elapsed()
        );
        let d = srv.device("v").unwrap();
        assert_eq!(
            d.at("size").u64(),
            SIZE,
            "{swap:?}: took the size of another file"
        );
        let client = client_tries(&sock, "v");
        assert!(client.contains("WROTE"), "{swap:?}: {client}");
        let want: String = pattern_bytes(1, 0, 64)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(
            client.contains(&format!("READ {want}")) || client.contains(&"ee".repeat(64)),
            "{swap:?}: the device does not serve its own file:\n{client}"
        );
        assert_secret_safe(&client, &secret, &secret_bytes);
        assert_file_filled(
            &orig,
            0,
            4096,
            0xee,
            "the write went to the device's own file",
        );
        std::fs::remove_file(&img).unwrap();
    }
    let log = srv.stderr_text();
    assert!(
        log.contains("no longer names the file the device serves"),
        "no notice in the log:\n{log}"
    );
}

/// A restart from the state file after the image was swapped: the device
/// stays missing, with a reason that says what the path names now and what to
/// do; the daemon starts (a FIFO does not block it); no client reaches the
/// secret. The image put back, the retry brings the device back.
#[test]
fn restart_refuses_a_path_that_names_another_file() {
    let dir = tempdir();
    let (secret, secret_bytes) = secret(dir.path());
    let img = dir.path().join("v.img");
    create_pattern_image(&img, SIZE, 2);
    let state = dir.path().join("r.state");
    let sock = dir.path().join("r.sock");
    let serve = || {
        Server::daemon()
            .socket_path(&sock)
            .arg("--state")
            .arg(&state)
            .start()
    };
    let mut srv = serve();
    srv.ctl_ok(&["attach", path_str(&img)]);
    let orig = dir.path().join("v.orig");
    for swap in [Swap::Link, Swap::Other, Swap::Fifo] {
        srv.stop_ok();
        std::fs::rename(&img, &orig).unwrap();
        plant(&img, swap, &secret);
        srv = serve();
        wait_device(&srv, "v", "missing", swap.reason(), Duration::from_secs(5));
        let reason = srv.device("v").unwrap().at("reason").str().to_owned();
        if !matches!(swap, Swap::Fifo) {
            assert!(
                reason.contains("detach the device, or attach") && reason.contains("again"),
                "{swap:?}: the reason says what to do: {reason}"
            );
        }
        assert_secret_safe(&client_tries(&sock, "v"), &secret, &secret_bytes);
        // Put back: the retry (every 2 s) finds the recorded file again.
        std::fs::remove_file(&img).unwrap();
        std::fs::rename(&orig, &img).unwrap();
        wait_device(&srv, "v", "live", "", Duration::from_secs(6));
    }
    let client = client_tries(&sock, "v");
    let want: String = pattern_bytes(2, 0, 64)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert!(client.contains(&format!("READ {want}")), "{client}");
}

/// The retry of a missing device (image gone at start): a link to the secret,
/// another file and a FIFO appearing at the path are refused, one after the
/// other, and the reason follows; `list` keeps answering (the FIFO blocks
/// nothing); no client reaches the secret. The image itself brings it back.
#[test]
fn missing_retry_refuses_a_path_that_names_another_file() {
    let dir = tempdir();
    let (secret, secret_bytes) = secret(dir.path());
    let img = dir.path().join("m.img");
    create_pattern_image(&img, SIZE, 4);
    let state = dir.path().join("m.state");
    let sock = dir.path().join("m.sock");
    let serve = || {
        Server::daemon()
            .socket_path(&sock)
            .arg("--state")
            .arg(&state)
            .start()
    };
    let mut srv = serve();
    srv.ctl_ok(&["attach", path_str(&img)]);
    srv.stop_ok();
    let orig = dir.path().join("m.orig");
    std::fs::rename(&img, &orig).unwrap();
    let srv = serve();
    wait_device(&srv, "m", "missing", "No such file", Duration::from_secs(5));
    for swap in [Swap::Link, Swap::Other, Swap::Fifo] {
        plant(&img, swap, &secret);
        wait_device(&srv, "m", "missing", swap.reason(), Duration::from_secs(6));
        // Two more retries: still refused.
        std::thread::sleep(Duration::from_millis(4500));
        wait_device(&srv, "m", "missing", swap.reason(), Duration::from_secs(1));
        assert_secret_safe(&client_tries(&sock, "m"), &secret, &secret_bytes);
        std::fs::remove_file(&img).unwrap();
    }
    std::fs::rename(&orig, &img).unwrap();
    wait_device(&srv, "m", "live", "", Duration::from_secs(6));
}

/// A state file of an older loopd (records without the file's identity): the
/// device comes back where its path names a regular file through no link, and
/// its identity is recorded from then on; a path through a link is refused
/// with a reason that says to attach it again.
#[test]
fn records_without_an_identity_refuse_links() {
    let dir = tempdir();
    let (secret, secret_bytes) = secret(dir.path());
    let plain = dir.path().join("p.img");
    create_pattern_image(&plain, SIZE, 5);
    let linked = dir.path().join("l.img");
    std::os::unix::fs::symlink(&secret, &linked).unwrap();
    let state = dir.path().join("o.state");
    let put = |name: &str, image: &Path| {
        format!(
            "{{\"put\":{{\"image\":\"{}\",\"name\":\"{name}\",\"offset\":0,\"cache\":\"auto\",\"read_only\":false,\"autoclear\":false}}}}\n",
            image.display()
        )
    };
    std::fs::write(
        &state,
        format!(
            "{{\"loopd_state\":1}}\n{}{}",
            put("p", &plain),
            put("l", &linked)
        ),
    )
    .unwrap();
    let sock = dir.path().join("o.sock");
    let srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    wait_device(&srv, "p", "live", "", Duration::from_secs(5));
    wait_device(&srv, "l", "missing", "older loopd", Duration::from_secs(5));
    assert_secret_safe(&client_tries(&sock, "l"), &secret, &secret_bytes);
    let text = std::fs::read_to_string(&state).unwrap();
    let p_line = text
        .lines()
        .rfind(|l| l.contains("\"name\":\"p\""))
        .unwrap();
    assert!(
        p_line.contains("\"file\":"),
        "identity not recorded: {text}"
    );
}

/// Review F11: a state record of an older loopd names a path in a directory
/// a user owns (`fs.protected_hardlinks` off, or a file the user may read
/// but not write), and before the first restart of the new loopd the user
/// hard-links a root-only file there. The record has no identity to compare,
/// so the file is trusted only if its directory's owner can have put it
/// there, as theirs: two links (or root's file in the user's directory) are
/// refused with a reason that says to attach it again; nothing of the secret
/// is served; the user's own image next to it comes back.
#[test]
fn records_without_an_identity_refuse_files_the_directory_owner_did_not_put_there() {
    let dir = tempdir();
    let (secret, secret_bytes) = secret(dir.path());
    let user_dir = dir.path().join("user");
    std::fs::create_dir(&user_dir).unwrap();
    std::fs::set_permissions(&user_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let own = user_dir.join("own.img");
    create_pattern_image(&own, SIZE, 6);
    let linked = user_dir.join("linked.img");
    std::fs::hard_link(&secret, &linked).unwrap();
    // Another of root's files, with one link, in the user's directory.
    let moved = user_dir.join("moved.img");
    std::fs::copy(&secret, &moved).unwrap();
    let user = rustix::process::Uid::from_raw(4242);
    for p in [&user_dir, &own] {
        rustix::fs::chown(p.as_path(), Some(user), None).expect("chown (tests run as root)");
    }
    let state = dir.path().join("o.state");
    let put = |name: &str, image: &Path| {
        format!(
            "{{\"put\":{{\"image\":\"{}\",\"name\":\"{name}\",\"offset\":0,\"cache\":\"auto\",\"read_only\":false,\"autoclear\":false}}}}\n",
            image.display()
        )
    };
    std::fs::write(
        &state,
        format!(
            "{{\"loopd_state\":1}}\n{}{}{}",
            put("own", &own),
            put("linked", &linked),
            put("moved", &moved)
        ),
    )
    .unwrap();
    let sock = dir.path().join("o.sock");
    let srv = Server::daemon()
        .socket_path(&sock)
        .arg("--state")
        .arg(&state)
        .start();
    wait_device(&srv, "own", "live", "", Duration::from_secs(5));
    wait_device(
        &srv,
        "linked",
        "missing",
        "2 hard links",
        Duration::from_secs(5),
    );
    wait_device(
        &srv,
        "moved",
        "missing",
        "belongs to uid 0",
        Duration::from_secs(5),
    );
    let reason = srv.device("linked").unwrap().at("reason").str().to_owned();
    assert!(
        reason.contains("older loopd") && reason.contains("loopd attach"),
        "{reason}"
    );
    assert_secret_safe(&client_tries(&sock, "linked"), &secret, &secret_bytes);
    let moved_bytes = std::fs::read(&moved).unwrap();
    assert!(!client_tries(&sock, "moved").contains(SECRET_HEX));
    assert_eq!(
        std::fs::read(&moved).unwrap(),
        moved_bytes,
        "moved.img was written"
    );
}

/// After a reboot device numbers may change (btrfs subvolumes, NFS, tmpfs,
/// renumbered disks): a record from another boot (its boot id and device
/// number rewritten here) comes back on the same inode and owner, and is then
/// recorded with this boot's identity; a record from another boot whose inode
/// differs stays missing.
#[test]
fn another_boot_needs_the_same_inode_not_the_same_device() {
    let dir = tempdir();
    let img = dir.path().join("b.img");
    create_pattern_image(&img, SIZE, 6);
    let state = dir.path().join("b.state");
    let sock = dir.path().join("b.sock");
    let serve = || {
        Server::daemon()
            .socket_path(&sock)
            .arg("--state")
            .arg(&state)
            .start()
    };
    let mut srv = serve();
    srv.ctl_ok(&["attach", path_str(&img)]);
    srv.stop_ok();
    let file_of = || {
        let text = std::fs::read_to_string(&state).unwrap();
        let line = text
            .lines()
            .rfind(|l| l.contains("\"name\":\"b\""))
            .expect("a record of b")
            .to_owned();
        let f = Json::parse(&line).at("put").at("file").clone();
        (text, f)
    };
    let (text, f) = file_of();
    let (dev, ino, boot) = (
        f.at("dev").u64(),
        f.at("ino").u64(),
        f.at("boot").str().to_owned(),
    );
    assert!(!boot.is_empty(), "no boot id recorded: {f:?}");
    let other_boot = |text: &str, ino_now: u64| {
        text.replace(&format!("\"boot\":\"{boot}\""), "\"boot\":\"another-boot\"")
            .replace(&format!("\"dev\":{dev},"), &format!("\"dev\":{},", dev + 1))
            .replace(&format!("\"ino\":{ino},"), &format!("\"ino\":{ino_now},"))
    };
    std::fs::write(&state, other_boot(&text, ino)).unwrap();
    let mut srv = serve();
    wait_device(&srv, "b", "live", "", Duration::from_secs(5));
    srv.stop_ok();
    let (text, f) = file_of();
    assert_eq!(
        f.at("boot").str(),
        boot,
        "this boot is recorded again: {f:?}"
    );
    assert_eq!(f.at("dev").u64(), dev, "{f:?}");
    std::fs::write(&state, other_boot(&text, ino + 1)).unwrap();
    let srv = serve();
    wait_device(
        &srv,
        "b",
        "missing",
        "now names a different file",
        Duration::from_secs(5),
    );
    let reason = srv.device("b").unwrap().at("reason").str().to_owned();
    assert!(
        reason.contains(&format!("inode {} recorded, {ino} now", ino + 1)),
        "{reason}"
    );
}
