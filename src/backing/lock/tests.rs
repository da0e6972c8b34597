use super::*;
use proptest::prelude::*;

const RW: Mode = Mode {
    read_only: false,
    shared: false,
};
const RO: Mode = Mode {
    read_only: true,
    shared: false,
};
const RW_SHARED: Mode = Mode {
    read_only: false,
    shared: true,
};

fn unshared(m: Mode) -> u8 {
    perm::ALL & !m.shared_perm()
}

fn between(new: Mode, old: Mode) -> Option<Conflict> {
    conflict(new, old.perm(), unshared(old))
}

#[test]
fn writers_exclude_each_other_and_readers_exclude_writers() {
    assert_eq!(between(RW, RW), Some(Conflict::TheyForbid(perm::WRITE)));
    assert_eq!(between(RO, RW), Some(Conflict::TheyUse(perm::WRITE)));
    assert_eq!(between(RW, RO), Some(Conflict::TheyForbid(perm::WRITE)));
    assert_eq!(between(RO, RO), None);
}

#[test]
fn force_share_skips_the_test_but_still_shows_its_write() {
    assert_eq!(between(RW_SHARED, RW), None);
    // A later plain writer sees the shared writer's write byte.
    assert_eq!(between(RW, RW_SHARED), Some(Conflict::TheyUse(perm::WRITE)));
    assert_eq!(
        between(RW_SHARED, RW_SHARED),
        None,
        "two writers who both ask to share"
    );
}

#[test]
fn qemu_nbd_writer_bytes_are_refused() {
    // What `qemu-nbd -f raw` 10.0 holds: bytes 100, 101 and 203.
    let held = perm::CONSISTENT_READ | perm::WRITE;
    let unshared = perm::RESIZE;
    assert_eq!(
        conflict(RW, held, unshared),
        Some(Conflict::TheyUse(perm::WRITE))
    );
    assert_eq!(
        conflict(RO, held, unshared),
        Some(Conflict::TheyUse(perm::WRITE))
    );
    assert_eq!(conflict(RW_SHARED, held, unshared), None);
}

proptest! {
    /// Between two modes that do not force-share, a conflict is seen from both
    /// sides (so the order in which two devices open does not matter).
    #[test]
    fn conflicts_are_symmetric(a_ro in any::<bool>(), b_ro in any::<bool>()) {
        let a = Mode { read_only: a_ro, shared: false };
        let b = Mode { read_only: b_ro, shared: false };
        prop_assert_eq!(between(a, b).is_some(), between(b, a).is_some());
        prop_assert_eq!(between(a, b).is_none(), a_ro && b_ro);
    }
}

fn image() -> (tempfile::TempDir, PathBuf, File) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("a.img");
    std::fs::write(&path, vec![0u8; 4096]).expect("write image");
    let f = File::open(&path).expect("open image");
    (dir, path, f)
}

/// The bytes some other open file description holds on `path`, as /proc/locks
/// would show them: test each of 100..104 and 200..204 from a fresh fd.
fn bytes_seen_from_outside(path: &Path) -> Vec<i64> {
    let probe = File::open(path).expect("open probe fd");
    (PERM_BASE..PERM_BASE + 4)
        .chain(SHARED_BASE..SHARED_BASE + 4)
        .filter(|&b| {
            let fl = ofd(&probe, libc::F_OFD_GETLK, libc::F_WRLCK, b, 1).expect("getlk");
            i32::from(fl.l_type) != libc::F_UNLCK
        })
        .collect()
}

#[test]
fn a_writer_holds_qemus_bytes_and_releases_them_on_drop() {
    let (_d, path, f) = image();
    let l = ImageLock::acquire(&path, &f, "a", RW).expect("first writer");
    assert_eq!(bytes_seen_from_outside(&path), vec![100, 101, 201, 203]);
    drop(l);
    assert_eq!(bytes_seen_from_outside(&path), Vec::<i64>::new());
}

#[test]
fn two_owners_writing_one_image_are_refused_in_one_process() {
    let (_d, path, f) = image();
    let _a = ImageLock::acquire(&path, &f, "a", RW).expect("first writer");
    let e = ImageLock::acquire(&path, &f, "b", RW).expect_err("second writer");
    let msg = e.to_string();
    assert!(
        msg.contains("device \"a\"") && msg.contains("--shared"),
        "{msg}"
    );
    let e = ImageLock::acquire(&path, &f, "c", RO).expect_err("reader of a written image");
    assert!(e.to_string().contains("open for writing"), "{e}");
    ImageLock::acquire(&path, &f, "d", RW_SHARED).expect("a force-shared writer joins");
}

#[test]
fn the_same_owner_reconfigures_and_the_union_narrows_after() {
    let (_d, path, f) = image();
    let old = ImageLock::acquire(&path, &f, "a", RW).expect("writer");
    let new = ImageLock::acquire(&path, &f, "a", RO).expect("same export, now read-only");
    assert!(new.is_reconfiguration() && !old.is_reconfiguration());
    drop(old);
    assert_eq!(bytes_seen_from_outside(&path), vec![100, 201, 203]);
    let _r = ImageLock::acquire(&path, &f, "b", RO).expect("two readers");
}

#[test]
fn another_description_writing_is_seen_as_another_process() {
    let (_d, path, f) = image();
    // What a QEMU writer holds, on its own open file description.
    let other = File::open(&path).expect("open");
    for b in [100, 101, 203] {
        ofd(&other, libc::F_OFD_SETLK, libc::F_RDLCK, b, 1).expect("setlk");
    }
    let e = ImageLock::acquire(&path, &f, "a", RW).expect_err("refused");
    assert_eq!(
        e.to_string(),
        format!(
            "{:?} is in use: another process has the image open for writing; pass --shared to \
             serve it anyway",
            path.display().to_string()
        )
    );
    let _s = ImageLock::acquire(&path, &f, "a", RW_SHARED).expect("force-shared");
    drop(other);
    drop(_s);
    let _ok = ImageLock::acquire(&path, &f, "a", RW).expect("free again");
}

#[test]
fn a_read_only_kernel_loop_yields_only_to_writers_that_do_not_share() {
    let rw = (RW.perm(), unshared(RW));
    let rw_shared = (RW_SHARED.perm(), unshared(RW_SHARED));
    let ro = (RO.perm(), unshared(RO));
    assert_eq!(
        kernel_reader_conflict(rw.0, rw.1),
        Some(Conflict::TheyUse(perm::WRITE))
    );
    assert_eq!(kernel_reader_conflict(rw_shared.0, rw_shared.1), None);
    assert_eq!(kernel_reader_conflict(ro.0, ro.1), None);
    // qemu-nbd 10 (bytes 100, 101, 203) shares writing.
    assert_eq!(
        kernel_reader_conflict(perm::CONSISTENT_READ | perm::WRITE, perm::RESIZE),
        None
    );
}

#[test]
fn kernel_attach_check_sees_a_writable_device() {
    let (_d, path, f) = image();
    let lock = ImageLock::acquire(&path, &f, "dev", RW).expect("lock");
    // Another description of the file, as `loopd kernel attach` has.
    let probe = File::open(&path).expect("open");
    let e = check_kernel_attach(&path, &probe, false, false).unwrap_err();
    assert!(
        e.to_string().contains("another process has the image open"),
        "{e}"
    );
    let e = check_kernel_attach(&path, &probe, true, false).unwrap_err();
    assert!(e.to_string().contains("--shared"), "{e}");
    assert!(check_kernel_attach(&path, &probe, false, true).is_ok());
    drop(lock);
    assert!(check_kernel_attach(&path, &probe, false, false).is_ok());
}

#[test]
fn runs_cover_exactly_the_bits_in_adjacent_pieces() {
    assert_eq!(runs(0).collect::<Vec<_>>(), vec![]);
    assert_eq!(runs(0b0011).collect::<Vec<_>>(), vec![(0, 2)]);
    assert_eq!(runs(0b1010).collect::<Vec<_>>(), vec![(1, 1), (3, 1)]);
    assert_eq!(runs(0b1111).collect::<Vec<_>>(), vec![(0, 4)]);
    for bits in 0..=255u8 {
        let mut back = 0u8;
        let mut last_end = None;
        for (first, len) in runs(bits) {
            assert!(len >= 1);
            // Pieces are maximal: never adjacent to the one before.
            assert!(last_end.is_none_or(|e: u8| first > e), "{bits:#b}");
            assert_eq!(back & run_bits(first, len), 0, "{bits:#b}");
            back |= run_bits(first, len);
            last_end = Some(first + len);
        }
        assert_eq!(back, bits);
    }
}

#[test]
fn a_conflict_inside_a_run_of_bytes_names_its_own_permission() {
    let (_d, path, f) = image();
    // Another description does not share writing (byte 201) but uses
    // nothing: a writer's test of bytes 200..=201 finds it in one run.
    let other = File::open(&path).expect("open");
    ofd(&other, libc::F_OFD_SETLK, libc::F_RDLCK, 201, 1).expect("setlk");
    let e = ImageLock::acquire(&path, &f, "a", RW).expect_err("refused");
    assert!(
        e.to_string()
            .contains("another process has the image open and does not share \"write\" access"),
        "{e}"
    );
    // A reader needs only byte 200: let in.
    let r = ImageLock::acquire(&path, &f, "b", RO).expect("a reader is let in");
    assert_eq!(bytes_seen_from_outside(&path), vec![100, 201, 203]);
    drop(r);
    assert_eq!(bytes_seen_from_outside(&path), vec![201]);
}

#[test]
fn a_detached_devices_conflict_is_waited_out_and_a_live_ones_refused() {
    let (_d, path, f) = image();
    let live = ImageLock::acquire(&path, &f, "a", RW).expect("writer");
    let e = ImageLock::acquire(&path, &f, "b", RW).expect_err("a live device is in the way");
    assert!(e.to_string().contains("device \"a\""), "{e}");
    // Detached (retired), going 30 ms later: waited for.
    live.retire();
    let gone = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(30));
        drop(live);
    });
    let _b =
        ImageLock::acquire(&path, &f, "b", RW).expect("the detached device's lock is waited out");
    gone.join().expect("dropper");
}
