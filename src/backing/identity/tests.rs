use super::*;
use proptest::prelude::*;
use std::time::{Duration, Instant};

fn id(kind: FileKind, dev: u64, ino: u64, uid: u32, boot: &str) -> FileIdentity {
    FileIdentity {
        kind,
        dev,
        ino,
        uid,
        rdev: 0,
        symlink: false,
        target: None,
        boot: boot.into(),
    }
}

#[test]
fn same_boot_needs_the_same_device_and_inode() {
    let rec = id(FileKind::File, 1, 2, 0, "b1");
    assert_eq!(mismatch(&rec, &rec.clone()), None);
    assert!(mismatch(&rec, &id(FileKind::File, 9, 2, 0, "b1")).is_some());
    assert!(mismatch(&rec, &id(FileKind::File, 1, 9, 0, "b1")).is_some());
    assert!(mismatch(&rec, &id(FileKind::Block, 1, 2, 0, "b1")).is_some());
}

#[test]
fn after_a_reboot_the_inode_and_owner_count_not_the_device() {
    let rec = id(FileKind::File, 1, 2, 1000, "b1");
    assert_eq!(mismatch(&rec, &id(FileKind::File, 7, 2, 1000, "b2")), None);
    assert!(mismatch(&rec, &id(FileKind::File, 7, 3, 1000, "b2")).is_some());
    assert!(mismatch(&rec, &id(FileKind::File, 7, 2, 0, "b2")).is_some());
    // An unknown boot counts as another one.
    let unknown = id(FileKind::File, 1, 2, 1000, "");
    assert_eq!(
        mismatch(&unknown, &id(FileKind::File, 7, 2, 1000, "")),
        None
    );
    assert!(mismatch(&unknown, &id(FileKind::File, 1, 3, 1000, "")).is_some());
}

#[test]
fn after_a_reboot_links_must_lead_to_the_same_name() {
    let mut rec = id(FileKind::Block, 5, 6, 0, "b1");
    rec.symlink = true;
    rec.rdev = rustix::fs::makedev(8, 0);
    rec.target = Some("/dev/sda".into());
    let mut now = rec.clone();
    now.boot = "b2".into();
    now.rdev = rustix::fs::makedev(8, 16);
    assert_eq!(mismatch(&rec, &now), None, "a renumbered disk, same name");
    now.target = Some("/dev/sdb".into());
    assert!(mismatch(&rec, &now).is_some());
    // In the same boot the device number decides.
    now.boot = "b1".into();
    assert!(mismatch(&rec, &now).unwrap().contains("8:0"));
}

proptest! {
    /// Within one boot, a file with another device or inode is never accepted;
    /// the same one always is.
    #[test]
    fn one_boot_accepts_exactly_the_same_inode(dev in 0u64..4, ino in 0u64..4,
                                               dev2 in 0u64..4, ino2 in 0u64..4,
                                               uid in 0u32..3, link in any::<bool>()) {
        let mut rec = id(FileKind::File, dev, ino, uid, "b");
        rec.symlink = link;
        let mut now = id(FileKind::File, dev2, ino2, uid, "b");
        now.symlink = link;
        prop_assert_eq!(mismatch(&rec, &now).is_none(), (dev, ino) == (dev2, ino2));
    }

    /// Across boots a file is accepted only with the same inode and owner.
    #[test]
    fn across_boots_inode_and_owner_decide(ino in 0u64..4, ino2 in 0u64..4,
                                           uid in 0u32..3, uid2 in 0u32..3,
                                           dev in 0u64..4, dev2 in 0u64..4) {
        let rec = id(FileKind::File, dev, ino, uid, "b1");
        let now = id(FileKind::File, dev2, ino2, uid2, "b2");
        prop_assert_eq!(mismatch(&rec, &now).is_none(), ino == ino2 && uid == uid2);
    }
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

#[test]
fn first_open_records_the_file_and_whether_a_link_led_there() {
    let d = tmp();
    let img = d.path().join("a.img");
    std::fs::write(&img, b"data").unwrap();
    let p = Pinned::first(&img).unwrap();
    let m = std::fs::metadata(&img).unwrap();
    assert_eq!((p.identity().dev, p.identity().ino), (m.dev(), m.ino()));
    assert_eq!(p.identity().kind, FileKind::File);
    assert!(!p.identity().symlink);
    assert_eq!(p.identity().boot, boot_id());

    let link = d.path().join("link.img");
    std::os::unix::fs::symlink(&img, &link).unwrap();
    let q = Pinned::first(&link).unwrap();
    assert!(q.identity().symlink);
    assert_eq!(
        q.identity().target.as_deref(),
        Some(std::fs::canonicalize(&img).unwrap().as_path())
    );
    assert_eq!(q.identity().ino, p.identity().ino);
}

#[test]
fn again_refuses_a_link_another_file_and_a_fifo() {
    let d = tmp();
    let img = d.path().join("a.img");
    std::fs::write(&img, b"mine").unwrap();
    let rec = Pinned::first(&img).unwrap().identity().clone();
    assert!(Pinned::again(&img, &rec).is_ok());

    let other = d.path().join("other");
    std::fs::write(&other, b"secret").unwrap();
    std::fs::rename(&img, d.path().join("moved.img")).unwrap();
    std::os::unix::fs::symlink(&other, &img).unwrap();
    let e = Pinned::again(&img, &rec).unwrap_err();
    assert!(matches!(e, IdentityError::NowSymlink { .. }), "{e}");

    std::fs::remove_file(&img).unwrap();
    std::fs::copy(&other, &img).unwrap();
    let e = Pinned::again(&img, &rec).unwrap_err();
    assert!(matches!(e, IdentityError::Different { .. }), "{e}");

    std::fs::remove_file(&img).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        &img,
        rustix::fs::FileType::Fifo,
        Mode::from_raw_mode(0o600),
        0,
    )
    .unwrap();
    let t = Instant::now();
    let e = Pinned::again(&img, &rec).unwrap_err();
    assert!(
        matches!(e, IdentityError::NotAFile { what: "a FIFO", .. }),
        "{e}"
    );
    let e = Pinned::first(&img).unwrap_err();
    assert!(matches!(e, IdentityError::NotAFile { .. }), "{e}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "opening a FIFO blocked"
    );
}

#[test]
fn unrecorded_records_refuse_links_only() {
    let d = tmp();
    let img = d.path().join("a.img");
    std::fs::write(&img, b"x").unwrap();
    assert!(Pinned::unrecorded(&img).is_ok());
    let link = d.path().join("l.img");
    std::os::unix::fs::symlink(&img, &link).unwrap();
    assert!(matches!(
        Pinned::unrecorded(&link).unwrap_err(),
        IdentityError::UnrecordedSymlink { .. }
    ));
}

fn facts(uid: u32, mode: u32, nlink: u64) -> Facts {
    Facts { uid, mode, nlink }
}

#[test]
fn an_unrecorded_file_is_trusted_only_if_its_directorys_owner_put_it_there() {
    let file = |uid, nlink| facts(uid, libc::S_IFREG | 0o600, nlink);
    let dir = |uid, mode| facts(uid, libc::S_IFDIR | mode, 2);
    // A user's image in the user's directory, a root image in root's.
    assert_eq!(unrecorded_doubt(&file(1000, 1), &dir(1000, 0o755)), None);
    assert_eq!(unrecorded_doubt(&file(0, 1), &dir(0, 0o755)), None);
    // A user's image in a directory only root may write.
    assert_eq!(unrecorded_doubt(&file(1000, 1), &dir(0, 0o700)), None);
    // A hard link to someone else's file: two links.
    let e = unrecorded_doubt(&file(0, 2), &dir(1000, 0o755)).unwrap();
    assert!(e.contains("2 hard links"), "{e}");
    // Root's file moved, or left behind with one link, in a user's directory.
    let e = unrecorded_doubt(&file(0, 1), &dir(1000, 0o700)).unwrap();
    assert!(e.contains("belongs to uid 0"), "{e}");
    // A directory others may write (/tmp, a group's): anyone may have put it.
    for mode in [0o1777, 0o775, 0o757] {
        let e = unrecorded_doubt(&file(0, 1), &dir(0, mode)).unwrap();
        assert!(e.contains("written by others"), "{mode:o}: {e}");
    }
    // A block device node: its link count is not the question.
    let node = facts(0, libc::S_IFBLK | 0o660, 1);
    assert_eq!(unrecorded_doubt(&node, &dir(0, 0o755)), None);
}

#[test]
fn unrecorded_records_refuse_hard_links_and_files_of_others() {
    use std::os::unix::fs::PermissionsExt;
    let d = tmp();
    let user_dir = d.path().join("user");
    std::fs::create_dir(&user_dir).unwrap();
    std::fs::set_permissions(&user_dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let secret = d.path().join("secret");
    std::fs::write(&secret, b"x").unwrap();
    let img = user_dir.join("a.img");
    std::fs::hard_link(&secret, &img).unwrap();
    let e = Pinned::unrecorded(&img).unwrap_err();
    assert!(
        matches!(e, IdentityError::UnrecordedDoubt { .. }) && e.to_string().contains("hard links"),
        "{e}"
    );
    // The same file with one link, in a directory of the same owner: trusted.
    std::fs::remove_file(&secret).unwrap();
    assert!(Pinned::unrecorded(&img).is_ok());
    // The directory given to another user (the tests run as root): the
    // file, still root's, is no longer trusted.
    rustix::fs::chown(&user_dir, Some(rustix::process::Uid::from_raw(4242)), None)
        .expect("chown (the tests run as root)");
    let e = Pinned::unrecorded(&img).unwrap_err();
    assert!(e.to_string().contains("belongs to uid"), "{e}");
}

#[test]
fn reopen_reaches_the_pinned_inode_whatever_the_path_names_now() {
    use std::io::Read;
    let d = tmp();
    let img = d.path().join("a.img");
    std::fs::write(&img, b"mine").unwrap();
    let p = Pinned::first(&img).unwrap();
    std::fs::rename(&img, d.path().join("moved.img")).unwrap();
    std::fs::write(&img, b"theirs").unwrap();
    assert!(!p.path_still_names_it());
    let mut s = String::new();
    p.open(true, false).unwrap().read_to_string(&mut s).unwrap();
    assert_eq!(s, "mine");
}

#[test]
fn lexical_cleans_dots() {
    assert_eq!(
        lexical(Path::new("/a/./b/../c")),
        Some(PathBuf::from("/a/c"))
    );
}

#[test]
fn a_reopen_is_a_description_of_its_own_with_the_files_facts() {
    use std::io::{Read, Seek, SeekFrom};
    let d = tmp();
    let img = d.path().join("a.img");
    std::fs::write(&img, b"0123456789").unwrap();
    let p = Pinned::first(&img).unwrap();
    let (mut a, st) = p.open_statx(false, false).unwrap();
    assert_eq!(st.stx_size, 10);
    assert_eq!(st.stx_ino, p.identity().ino);
    let mut b = p.open(true, false).unwrap();
    // Offsets are per description: moving one leaves the other at 0.
    a.seek(SeekFrom::Start(6)).unwrap();
    let mut s = String::new();
    b.read_to_string(&mut s).unwrap();
    assert_eq!(s, "0123456789");
    s.clear();
    a.read_to_string(&mut s).unwrap();
    assert_eq!(s, "6789");
}
