use super::*;
use proptest::prelude::*;
use std::os::unix::fs::PermissionsExt;

fn owner(name: &str, image: &str, who: &str) -> Owner {
    Owner {
        name: name.into(),
        image: image.into(),
        ceph_conf: Some("/etc/ceph/ceph.conf".into()),
        ceph_id: Some("admin".into()),
        owner: who.into(),
    }
}

const HEADER: &[u8] = b"{\"loopd_rbd_owners\":1}\n";

#[test]
fn encode_then_parse_gives_the_owners_back() {
    let a = owner("a", "rbd:rbd/a", "127.0.0.1:0/1");
    let b = Owner {
        ceph_conf: None,
        ceph_id: None,
        ..owner("b", "rbd:rbd/b", "127.0.0.1:0/2")
    };
    let text = encode([&a, &b]);
    assert!(text.starts_with(HEADER));
    let p = parse(&text);
    assert!(p.damaged.is_empty(), "{:?}", p.damaged);
    assert_eq!(p.owners.len(), 2);
    assert_eq!(p.owners["a"], a);
    assert_eq!(p.owners["b"], b);
}

#[test]
fn without_the_header_nothing_is_believed() {
    let mut t = b"{\"loopd_state\":1}\n".to_vec();
    t.extend(encode([&owner("a", "rbd:rbd/a", "x")]).split_off(HEADER.len()));
    let p = parse(&t);
    assert!(p.owners.is_empty());
    assert_eq!(p.damaged.len(), 1);
    assert!(parse(b"").owners.is_empty());
    assert!(parse(b"\0\0\0\0").owners.is_empty());
}

#[test]
fn a_damaged_line_is_reported_and_the_others_kept() {
    let mut t = HEADER.to_vec();
    t.extend(b"{\"name\":\"a\",\"image\":\"rbd:rbd/a\",\"own\n");
    t.extend(b"{\"name\":\"e\",\"image\":\"rbd:rbd/e\",\"owner\":\"\"}\n");
    t.extend(b"{\"name\":\"u\",\"image\":\"rbd:rbd/u\",\"owner\":\"o\",\"extra\":1}\n");
    t.extend(encode([&owner("b", "rbd:rbd/b", "127.0.0.1:0/2")]).split_off(HEADER.len()));
    t.extend(b"{\"name\":\"c\"");
    let p = parse(&t);
    assert_eq!(p.owners.keys().collect::<Vec<_>>(), ["b"]);
    assert_eq!(p.damaged.len(), 4, "{:?}", p.damaged);
    assert!(p.damaged[0].starts_with("line 2:"), "{:?}", p.damaged);
    assert!(p.damaged[1].contains("empty owner"), "{:?}", p.damaged);
}

#[test]
fn the_previous_owner_is_offered_only_for_the_same_device() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("s.state");
    let was = owner("r", "rbd:rbd/img", "127.0.0.1:0/111");
    std::fs::write(path_for(&state), encode([&was])).unwrap();
    let mut o = RbdOwners::load(&state);
    let ask = |o: &RbdOwners, w: Owner| {
        o.previous(&Owner {
            owner: String::new(),
            ..w
        })
    };
    assert_eq!(ask(&o, was.clone()), Some(was.owner.clone()));
    for other in [
        owner("r", "rbd:rbd/other", ""),
        owner("r2", "rbd:rbd/img", ""),
        Owner {
            ceph_conf: Some("/elsewhere/ceph.conf".into()),
            ..owner("r", "rbd:rbd/img", "")
        },
        Owner {
            ceph_id: None,
            ..owner("r", "rbd:rbd/img", "")
        },
    ] {
        assert_eq!(ask(&o, other.clone()), None, "{other:?}");
    }
    // This run's owner is recorded, never offered: its client is alive.
    let now = owner("r", "rbd:rbd/img", "127.0.0.1:0/222");
    o.set(now.clone()).unwrap();
    assert_eq!(ask(&o, was.clone()), None);
    let mode = std::fs::metadata(path_for(&state))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600);
    // The next run is offered this run's owner.
    let next = RbdOwners::load(&state);
    assert_eq!(ask(&next, was.clone()), Some(now.owner.clone()));
    o.remove("r").unwrap();
    assert_eq!(ask(&RbdOwners::load(&state), was.clone()), None);
    o.set(now).unwrap();
    o.clear().unwrap();
    assert!(
        parse(&std::fs::read(path_for(&state)).unwrap())
            .owners
            .is_empty()
    );
}

#[test]
fn a_damaged_or_foreign_sidecar_is_ignored_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("s.state");
    std::fs::create_dir(path_for(&state)).unwrap();
    let mut o = RbdOwners::load(&state);
    assert_eq!(o.previous(&owner("r", "rbd:rbd/img", "")), None);
    assert!(
        o.set(owner("r", "rbd:rbd/img", "x")).is_err(),
        "a directory is in the way"
    );
    std::fs::remove_dir(path_for(&state)).unwrap();
    std::fs::write(path_for(&state), b"\xff\xfe garbage\n{\"name\":").unwrap();
    let mut o = RbdOwners::load(&state);
    assert_eq!(o.previous(&owner("r", "rbd:rbd/img", "")), None);
    // The next write replaces it with a whole file.
    o.set(owner("r", "rbd:rbd/img", "x")).unwrap();
    assert_eq!(
        parse(&std::fs::read(path_for(&state)).unwrap())
            .owners
            .len(),
        1
    );
}

fn arb_owner() -> impl Strategy<Value = Owner> {
    (
        "[a-d]",
        "rbd:[a-z]{1,4}/[a-z/@\"\\\\\u{1}é]{1,8}",
        proptest::option::of("[ -~]{0,12}"),
        proptest::option::of("[a-z]{0,6}"),
        "[0-9.:/]{1,20}",
    )
        .prop_map(|(name, image, ceph_conf, ceph_id, owner)| Owner {
            name,
            image,
            ceph_conf,
            ceph_id,
            owner,
        })
}

proptest! {
    /// Whole files read back exactly (the last owner of a name wins).
    #[test]
    fn whole_files_read_back_exactly(os in proptest::collection::vec(arb_owner(), 0..12)) {
        let p = parse(&encode(&os));
        prop_assert!(p.damaged.is_empty(), "{:?}", p.damaged);
        let mut want = BTreeMap::new();
        for o in os {
            want.insert(o.name.clone(), o);
        }
        prop_assert_eq!(p.owners, want);
    }

    /// Any bytes: never a panic, never more owners than lines, every owner
    /// non-empty.
    #[test]
    fn any_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..400)) {
        let p = parse(&b);
        let lines = b.split(|&c| c == b'\n').count();
        prop_assert!(p.owners.len() + p.damaged.len() <= lines);
        prop_assert!(p.owners.values().all(|o| !o.owner.is_empty()));
    }

    /// Corrupted bytes of a real file: never a panic; every line yields at
    /// most one owner or one report, and no owner is empty.
    #[test]
    fn corrupted_files_never_panic(
        os in proptest::collection::vec(arb_owner(), 1..8),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
    ) {
        let mut text = encode(&os);
        for (at, b) in flips {
            let i = at % text.len();
            text[i] = b;
        }
        let p = parse(&text);
        let lines = text.split(|&c| c == b'\n').count();
        prop_assert!(p.owners.len() + p.damaged.len() <= lines);
        prop_assert!(p.owners.values().all(|o| !o.owner.is_empty()));
    }
}
