//! Images that are not raw are refused, with the format named and the way to
//! convert it, unless the user declares `--format raw`. Images are made by the
//! real `qemu-img create`.

mod common;

use common::*;
use std::path::{Path, PathBuf};

fn qemu_img_create(dir: &Path, fmt: &str) -> PathBuf {
    let p = dir.join(format!("vm.{fmt}"));
    let mut args: Vec<String> = vec!["create".into(), "-q".into(), "-f".into(), fmt.into()];
    if fmt == "luks" {
        args.extend(
            [
                "--object",
                "secret,id=sec0,data=loopd",
                "-o",
                "key-secret=sec0,iter-time=10",
            ]
            .map(String::from),
        );
    }
    args.push(path_str(&p).into());
    args.push("1M".into());
    run("qemu-img", &args);
    p
}

#[test]
fn serve_refuses_a_qcow2_image_and_says_how_to_convert_it() {
    let dir = tempdir();
    let img = qemu_img_create(dir.path(), "qcow2");
    let out = loopd_run([
        "serve",
        path_str(&img),
        "--socket",
        path_str(&dir.path().join("l.sock")),
    ]);
    assert!(!out.success(), "a qcow2 image was served:\n{out}");
    let raw = dir.path().join("vm.raw");
    let want = format!(
        "{:?} is a qcow2 image; loopd serves raw images only: convert it with 'qemu-img \
         convert -f qcow2 -O raw {:?} {:?}', or pass --format raw to serve its bytes as they are",
        img.display().to_string(),
        img.display().to_string(),
        raw.display().to_string()
    );
    assert!(out.stderr.contains(&want), "expected {want:?}:\n{out}");
}

#[test]
fn attach_refuses_every_known_container_format_by_name() {
    let dir = tempdir();
    let d = Server::daemon().start();
    for fmt in ["qcow2", "qcow", "vmdk", "vhdx", "vdi", "vpc", "qed", "luks"] {
        let img = qemu_img_create(dir.path(), fmt);
        let out = d.ctl_err(&["attach", path_str(&img)], "invalid");
        assert!(
            out.stderr.contains(&format!("is a {fmt} image"))
                && out.stderr.contains("--format raw"),
            "{fmt}: {out}"
        );
    }
    assert!(
        d.device_names().is_empty(),
        "a refused attach left a device"
    );
}

#[test]
fn format_raw_serves_a_qcow2_file_byte_for_byte_and_is_remembered() {
    let dir = tempdir();
    let img = qemu_img_create(dir.path(), "qcow2");
    let state = dir.path().join("loopd.state");
    let len = file_len(&img);
    let mut d = Server::daemon().arg("--state").arg(&state).start();
    d.ctl_ok(&["attach", path_str(&img), "--format", "raw", "--read-only"]);
    let check = |d: &Server| {
        let uri = d.uri_for_name("vm");
        assert_eq!(nbd_size(&uri), len.div_ceil(512) * 512);
        // "QFI\xfb": the qcow2 header itself, as the bytes of the disk.
        run(
            "qemu-io",
            [
                "-r",
                "-f",
                "raw",
                &uri,
                "-c",
                "read -P 0x51 0 1",
                "-c",
                "read -P 0xfb 3 1",
            ],
        );
    };
    check(&d);
    d.stop_ok();
    // The state file carries the declaration: the restart serves it again.
    let d = Server::daemon().arg("--state").arg(&state).start();
    assert_eq!(d.device_names(), vec!["vm".to_string()]);
    check(&d);
}

#[test]
fn config_file_format_raw_serves_a_vmdk_file() {
    let dir = tempdir();
    let img = qemu_img_create(dir.path(), "vmdk");
    let cfg = dir.path().join("loopd.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[device]]\nimage = {:?}\nname = \"v\"\nformat = \"raw\"\nread_only = true\n",
            path_str(&img)
        ),
    )
    .expect("write config");
    let d = Server::daemon().arg("--config").arg(&cfg).start();
    assert_eq!(d.device_names(), vec!["v".to_string()]);
}

#[test]
fn a_raw_image_whose_client_writes_a_qcow2_header_is_restored_after_restart() {
    let dir = tempdir();
    let img = dir.path().join("disk.img");
    create_sparse_image(&img, 1 << 20);
    let state = dir.path().join("loopd.state");
    let mut d = Server::daemon().arg("--state").arg(&state).start();
    d.ctl_ok(&["attach", path_str(&img)]);
    // A guest makes a qcow2 image inside its raw disk.
    let nested = qemu_img_create(dir.path(), "qcow2");
    let head = read_range(&nested, 0, 512);
    let uri = d.uri_for_name("disk");
    let pat = dir.path().join("head.bin");
    std::fs::write(&pat, &head).expect("write head");
    run(
        "qemu-img",
        [
            "dd",
            "-f",
            "raw",
            "-O",
            "raw",
            "bs=512",
            "count=1",
            &format!("if={}", path_str(&pat)),
            &format!("of={uri}"),
        ],
    );
    assert_eq!(read_range(&img, 0, 4), b"QFI\xfb".to_vec());
    d.kill9();
    let d = Server::daemon().arg("--state").arg(&state).start();
    assert_eq!(
        d.device_names(),
        vec!["disk".to_string()],
        "{}",
        d.stderr_text()
    );
}

/// How many of `path`'s pages are in the page cache (`mincore` over a
/// mapping of it).
fn cached_pages(path: &Path) -> usize {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).expect("open image");
    let len = usize::try_from(f.metadata().expect("stat").len()).expect("image size");
    // SAFETY: a private read-only mapping of `len` bytes of an open file;
    // unmapped below, never dereferenced.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, libc::MAP_FAILED, "mmap");
    let mut vec = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `map` is a mapping of `len` bytes; `vec` has one byte per page.
    let rc = unsafe { libc::mincore(map, len, vec.as_mut_ptr()) };
    // SAFETY: the mapping made above.
    unsafe { libc::munmap(map, len) };
    assert_eq!(rc, 0, "mincore");
    vec.iter().filter(|b| **b & 1 == 1).count()
}

/// The format probe of a direct-I/O device reads the image's head with
/// `O_DIRECT`: attaching it leaves nothing of the image in the page cache
/// (a buffered probe made the kernel read ahead and keep its first pages;
/// a thousand attaches kept megabytes of cache nobody asked for).
#[test]
fn a_direct_attach_leaves_the_image_out_of_the_page_cache() {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let dir = tempdir();
    let img = dir.path().join("cold.img");
    let mut f = std::fs::File::create(&img).expect("create");
    f.write_all(&vec![0x5a; 1 << 20]).expect("write");
    f.sync_all().expect("fsync");
    // SAFETY: an advice call on an open descriptor.
    let rc = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    assert_eq!(rc, 0, "fadvise");
    drop(f);
    assert_eq!(
        cached_pages(&img),
        0,
        "the image is still cached before the attach"
    );
    let d = Server::daemon().start();
    let out = d.ctl(&["attach", "--cache", "direct", path_str(&img)]);
    assert!(out.success(), "attach:\n{out}");
    assert_eq!(
        cached_pages(&img),
        0,
        "the attach's format probe left pages of the image in the page cache"
    );
}
