use super::*;
use proptest::prelude::*;

fn spec(name: &str) -> DeviceSpec {
    DeviceSpec {
        image: format!("/img/{name}.img").into(),
        name: Some(name.into()),
        offset: 0,
        size_limit: None,
        block_size: None,
        cache: Default::default(),
        read_only: false,
        autoclear: false,
        create: None,
        shared: false,
        format: None,
        ..Default::default()
    }
}

fn line(r: &Record) -> Vec<u8> {
    encode(r)
}

const HEADER: &[u8] = b"{\"loopd_state\":1}\n";

#[test]
fn damaged_middle_line_keeps_the_others() {
    let mut t = HEADER.to_vec();
    t.extend(line(&Record::Put(Box::new(spec("a")))));
    t.extend(b"{\"put\":{\"image\":\"/x\",\"nam\n");
    t.extend(line(&Record::Put(Box::new(spec("c")))));
    let p = parse(&t);
    assert_eq!(p.table, vec![spec("a"), spec("c")]);
    assert_eq!(p.damaged.len(), 1);
    assert!(p.damaged[0].starts_with("line 3:"), "{:?}", p.damaged);
}

#[test]
fn torn_last_line_is_reported() {
    let mut t = HEADER.to_vec();
    t.extend(line(&Record::Put(Box::new(spec("a")))));
    t.extend(b"{\"del\":\"a");
    let p = parse(&t);
    assert_eq!(p.table, vec![spec("a")]);
    assert_eq!(p.damaged.len(), 1);
    assert!(p.damaged[0].contains("torn"), "{:?}", p.damaged);
}

#[test]
fn foreign_bytes_have_no_header() {
    assert!(!has_header(b"QFI\xfb\0\0\0\x03"));
    assert!(!has_header(b"{\"loopd_state\":2}\n"));
    assert!(!has_header(b"\n"));
    assert!(has_header(HEADER));
    assert!(!looks_like_state(b"shopping list\n{\"del\":\"a\"}"));
    assert!(!looks_like_state(b"a\nb\nc\n"));
}

#[test]
fn damaged_header_is_damage_not_a_foreign_file() {
    let mut t = b"{\"loopd_sta\n".to_vec();
    t.extend(line(&Record::Put(Box::new(spec("a")))));
    assert!(looks_like_state(&t));
    let p = parse(&t);
    assert_eq!(p.table, vec![spec("a")]);
    assert_eq!(p.damaged.len(), 1);
    assert!(p.damaged[0].starts_with("line 1:"), "{:?}", p.damaged);
}

#[test]
fn utc_stamp_is_civil_time() {
    assert_eq!(utc_stamp(0), "19700101T000000Z");
    // 2026-11-23 11:25:07 UTC
    assert_eq!(utc_stamp(1_795_433_107), "20261123T112507Z");
    // 2000-02-29 23:59:59 UTC (leap day)
    assert_eq!(utc_stamp(951_868_799), "20000229T235959Z");
}

#[test]
fn records_are_durable_and_a_second_opener_is_locked_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.state");
    let log = StateLog::open(&path).unwrap();
    assert!(!path.exists(), "no file before the first record");
    log.put(&spec("a")).unwrap();
    log.put(&spec("b")).unwrap();
    log.del("a").unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    match StateLog::open(&path) {
        Err(StateError::Locked { pid, .. }) => assert_eq!(pid, std::process::id().to_string()),
        Err(e) => panic!("second open: {e}"),
        Ok(_) => panic!("second open of a locked state file succeeded"),
    }
    drop(log);
    let again = StateLog::open(&path).unwrap();
    assert_eq!(again.table(), &[spec("b")]);
}

/// Group commit: records staged by many threads before any of them waits are
/// written by one `write` and made durable by one `fdatasync`, each thread
/// is answered only then, and every record is read back.
#[test]
fn concurrent_records_share_one_sync() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.state");
    let log = std::sync::Arc::new(StateLog::open(&path).unwrap());
    log.put(&spec("first")).unwrap(); // the file exists: appends from now on
    assert_eq!(log.syncs(), 0, "the first record rewrites the file");
    let n = 16;
    let staged = std::sync::Arc::new(std::sync::Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|i| {
            let (log, staged) = (log.clone(), staged.clone());
            std::thread::spawn(move || {
                let p = log.stage_put(&spec(&format!("d{i}")));
                staged.wait();
                log.wait(p)
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap().unwrap();
    }
    assert_eq!(log.syncs(), 1, "one fdatasync for the {n} records");
    assert_eq!(log.table().len(), n + 1);
    // Later records: each alone, each its own sync.
    log.del("d0").unwrap();
    assert_eq!(log.syncs(), 2);
    drop(log);
    let again = StateLog::open(&path).unwrap();
    let mut names: Vec<_> = again.table().iter().map(name_of).collect();
    names.sort();
    let mut want: Vec<_> = (1..n).map(|i| format!("d{i}")).collect();
    want.push("first".into());
    want.sort();
    assert_eq!(names, want);
}

#[test]
fn a_file_that_is_not_a_state_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    std::fs::write(&path, b"\x00\x01binary image data\n").unwrap();
    assert!(matches!(
        StateLog::open(&path),
        Err(StateError::NotState(..))
    ));
    assert!(matches!(
        StateLog::open(dir.path()),
        Err(StateError::NotState(..))
    ));
}

fn arb_record() -> impl Strategy<Value = Record> {
    prop_oneof![
        "[a-d]".prop_map(|n| Record::Put(Box::new(spec(&n)))),
        "[a-d]".prop_map(Record::Del),
    ]
}

proptest! {
    /// Replaying whole records gives the table the records build, with nothing damaged.
    #[test]
    fn whole_logs_replay_exactly(rs in proptest::collection::vec(arb_record(), 0..40)) {
        let mut text = HEADER.to_vec();
        let mut want = Vec::new();
        for r in rs {
            text.extend(line(&r));
            apply_plain(&mut want, r);
        }
        let p = parse(&text);
        prop_assert!(p.damaged.is_empty());
        prop_assert_eq!(p.table, want);
    }

    /// Corrupting bytes never panics, and every line is either replayed or reported.
    #[test]
    fn corrupted_logs_never_panic(
        rs in proptest::collection::vec(arb_record(), 1..20),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
    ) {
        let mut text = HEADER.to_vec();
        for r in &rs {
            text.extend(line(r));
        }
        for (at, b) in flips {
            let i = HEADER.len() + at % (text.len() - HEADER.len());
            text[i] = b;
        }
        let p = parse(&text);
        prop_assert!(p.table.len() <= 4);
        let lines = text.split(|&b| b == b'\n').count();
        prop_assert!(p.damaged.len() <= lines);
    }
}

#[test]
fn records_with_and_without_a_file_identity_both_load() {
    let mut t = HEADER.to_vec();
    // An older loopd's record: no identity.
    t.extend(b"{\"put\":{\"image\":\"/img/a.img\",\"name\":\"a\",\"offset\":0,\"cache\":\"auto\",\"read_only\":false,\"autoclear\":false}}\n");
    let mut b = spec("b");
    b.file = Some(crate::backing::identity::FileIdentity {
        kind: crate::backing::identity::FileKind::File,
        dev: 2049,
        ino: 77,
        uid: 1000,
        rdev: 0,
        symlink: true,
        target: Some("/srv/b.img".into()),
        boot: "0f2c".into(),
    });
    t.extend(line(&Record::Put(Box::new(b.clone()))));
    let p = parse(&t);
    assert!(p.damaged.is_empty(), "{:?}", p.damaged);
    assert_eq!(p.table[0].file, None);
    assert_eq!(p.table[1], b);
    let text = String::from_utf8(line(&Record::Put(Box::new(b)))).unwrap();
    assert!(
        text.contains(r#""file":{"kind":"file","dev":2049,"ino":77,"uid":1000,"symlink":true,"target":"/srv/b.img","boot":"0f2c"}"#),
        "{text}"
    );
}
