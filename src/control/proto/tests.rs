use super::*;
use proptest::prelude::*;

#[test]
fn attach_round_trips() {
    let r = Request::Attach(Box::new(DeviceSpec {
        image: "/tmp/a.img".into(),
        name: Some("a".into()),
        offset: 4096,
        size_limit: Some(1 << 20),
        block_size: Some(4096),
        cache: CacheMode::Direct,
        read_only: true,
        autoclear: true,
        create: None,
        shared: true,
        format: Some(crate::backing::format::ImageFormat::Raw),
        ..Default::default()
    }));
    assert_eq!(parse_request(encode_request(&r).as_bytes()), Ok(r));
}

#[test]
fn request_without_version_is_rejected() {
    let e = parse_request(br#"{"op":"list"}"#).unwrap_err();
    assert_eq!(e.code, ErrorCode::UnsupportedVersion);
}

#[test]
fn request_with_future_version_is_rejected() {
    let e = parse_request(br#"{"v":2,"op":"list"}"#).unwrap_err();
    assert_eq!(e.code, ErrorCode::UnsupportedVersion);
}

#[test]
fn unknown_field_is_rejected() {
    let e = parse_request(br#"{"v":1,"op":"detach","name":"a","forse":true}"#).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest);
    let e = parse_request(br#"{"v":1,"op":"attach","image":"x","colour":1}"#).unwrap_err();
    assert_eq!(e.code, ErrorCode::BadRequest);
}

#[test]
fn unknown_op_and_garbage_are_rejected() {
    for bad in [
        &br#"{"v":1,"op":"explode"}"#[..],
        b"[1,2]",
        b"not json",
        b"",
    ] {
        assert_eq!(
            parse_request(bad).unwrap_err().code,
            ErrorCode::BadRequest,
            "{bad:?}"
        );
    }
}

#[test]
fn replies_round_trip() {
    let ok = ok_reply(&serde_json::json!({"name": "a"}));
    assert_eq!(parse_reply(ok.as_bytes()).unwrap().unwrap()["name"], "a");
    let e = ErrorBody {
        code: ErrorCode::Busy,
        message: "2 clients".into(),
    };
    assert_eq!(parse_reply(err_reply(&e).as_bytes()).unwrap(), Err(e));
}

fn name() -> impl Strategy<Value = String> {
    // Any Unicode, including quotes, backslashes and control characters JSON escapes.
    any::<String>()
}

fn cache() -> impl Strategy<Value = CacheMode> {
    prop_oneof![
        Just(CacheMode::Auto),
        Just(CacheMode::Direct),
        Just(CacheMode::Buffered)
    ]
}

fn device_spec() -> impl Strategy<Value = DeviceSpec> {
    (
        (name(), proptest::option::of(name()), any::<u64>()),
        (
            proptest::option::of(any::<u64>()),
            proptest::option::of(any::<u32>()),
            cache(),
        ),
        (
            any::<bool>(),
            any::<bool>(),
            proptest::option::of(any::<u64>()),
        ),
        (any::<bool>(), any::<bool>(), any::<bool>()),
    )
        .prop_map(
            |(
                (image, name, offset),
                (size_limit, block_size, cache),
                (read_only, autoclear, create),
                (shared, raw, strict_block_size),
            )| {
                DeviceSpec {
                    image: image.into(),
                    name,
                    offset,
                    size_limit,
                    block_size,
                    cache,
                    read_only,
                    autoclear,
                    create,
                    shared,
                    format: raw.then_some(crate::backing::format::ImageFormat::Raw),
                    strict_block_size,
                    ..Default::default()
                }
            },
        )
}

fn set_spec() -> impl Strategy<Value = SetSpec> {
    (
        name(),
        proptest::option::of(proptest::option::of(any::<u64>())),
        proptest::option::of(any::<u64>()),
        proptest::option::of(any::<u32>()),
        proptest::option::of(cache()),
        proptest::option::of(any::<bool>()),
        any::<bool>(),
    )
        .prop_map(
            |(name, size_limit, offset, block_size, cache, read_only, force)| SetSpec {
                name,
                size_limit,
                offset,
                block_size,
                cache,
                read_only,
                force,
            },
        )
}

fn request() -> impl Strategy<Value = Request> {
    prop_oneof![
        device_spec().prop_map(|d| Request::Attach(Box::new(d))),
        proptest::collection::vec(device_spec(), 0..4)
            .prop_map(|devices| Request::AttachBatch { devices }),
        (name(), any::<bool>()).prop_map(|(name, force)| Request::Detach { name, force }),
        Just(Request::List),
        proptest::option::of(name()).prop_map(|name| Request::Status { name }),
        set_spec().prop_map(Request::Set),
        name().prop_map(|name| Request::Resize { name }),
        Just(Request::Version),
        Just(Request::ReloadTls),
        Just(Request::Reload),
    ]
}

proptest! {
    /// Whatever a client sends, the parser answers (never panics) and an accepted
    /// request re-encodes to one that parses back the same.
    #[test]
    fn arbitrary_bytes_parse_or_fail_cleanly(b in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(r) = parse_request(&b) {
            prop_assert_eq!(parse_request(encode_request(&r).as_bytes()), Ok(r));
        }
        let _ = parse_reply(&b);
    }

    /// Every request the CLI can encode is read back exactly by the daemon.
    #[test]
    fn every_request_round_trips(r in request()) {
        prop_assert_eq!(parse_request(encode_request(&r).as_bytes()), Ok(r));
    }

    /// Cutting an encoded request short never yields a different request.
    #[test]
    fn truncated_requests_are_rejected(r in request(), cut in any::<prop::sample::Index>()) {
        let line = encode_request(&r);
        let n = cut.index(line.len());
        prop_assert!(parse_request(&line.as_bytes()[..n]).is_err());
    }

    /// A field the document does not name is refused, whatever the op.
    #[test]
    fn unknown_fields_are_refused_for_every_op(r in request(), k in "x[a-z_]{0,8}") {
        let mut j: serde_json::Value = serde_json::from_str(&encode_request(&r)).unwrap();
        j[k.as_str()] = 1.into();
        let e = parse_request(j.to_string().as_bytes()).unwrap_err();
        prop_assert_eq!(e.code, ErrorCode::BadRequest);
    }

    /// Any other version number is refused as such, whatever the request.
    #[test]
    fn other_versions_are_refused(r in request(), v in any::<u64>()) {
        prop_assume!(v != u64::from(VERSION));
        let mut j: serde_json::Value = serde_json::from_str(&encode_request(&r)).unwrap();
        j["v"] = v.into();
        let e = parse_request(j.to_string().as_bytes()).unwrap_err();
        prop_assert_eq!(e.code, ErrorCode::UnsupportedVersion);
    }
}

#[test]
fn list_and_version_with_fields_are_rejected() {
    for (line, field) in [
        (&br#"{"v":1,"op":"list","all":true}"#[..], "all"),
        (&br#"{"v":1,"op":"version","x":1}"#[..], "x"),
    ] {
        let e = parse_request(line).unwrap_err();
        assert_eq!(e.code, ErrorCode::BadRequest, "{line:?}");
        assert!(
            e.message.contains(&format!("unknown field `{field}`")),
            "{}",
            e.message
        );
    }
    assert_eq!(parse_request(br#"{"v":1,"op":"list"}"#), Ok(Request::List));
    assert_eq!(
        parse_request(br#"{"op":"version","v":1}"#),
        Ok(Request::Version)
    );
}

#[test]
fn set_size_limit_absent_null_or_number() {
    let p = |l: &str| match parse_request(l.as_bytes()) {
        Ok(Request::Set(s)) => s.size_limit,
        other => panic!("{other:?}"),
    };
    assert_eq!(p(r#"{"v":1,"op":"set","name":"a"}"#), None);
    assert_eq!(
        p(r#"{"v":1,"op":"set","name":"a","size_limit":null}"#),
        Some(None)
    );
    assert_eq!(
        p(r#"{"v":1,"op":"set","name":"a","size_limit":4096}"#),
        Some(Some(4096))
    );
}

#[test]
fn attach_batch_parses_and_its_items_encode() {
    let r = parse_request(
        br#"{"v":1,"op":"attach_batch","devices":[{"image":"/a"},{"image":"/b","name":"b"}]}"#,
    );
    match r {
        Ok(Request::AttachBatch { devices }) => {
            assert_eq!(devices.len(), 2);
            assert_eq!(devices[1].name.as_deref(), Some("b"));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        parse_request(br#"{"v":1,"op":"attach_batch"}"#).map_err(|e| e.code),
        Err(ErrorCode::BadRequest)
    );
    let bad = serde_json::to_value(batch_item::<u32>(Err(ErrorBody {
        code: ErrorCode::NotFound,
        message: "x".into(),
    })))
    .unwrap();
    assert_eq!(bad["ok"], false);
    assert_eq!(bad["error"]["code"], "not_found");
    assert_eq!(bad["error"]["message"], "x");
    let good = serde_json::to_value(batch_item::<u32>(Ok(7))).unwrap();
    assert_eq!((&good["ok"], &good["result"]), (&true.into(), &7.into()));
}

/// The devices reply written straight from its items is, byte for byte, the
/// reply of the JSON tree (sorted keys), for batch items of both kinds.
#[test]
fn devices_reply_is_the_sorted_reply() {
    let items = vec![
        batch_item(Ok(serde_json::json!({"b": 1, "a": [true]}))),
        batch_item(Err(ErrorBody {
            code: ErrorCode::NameTaken,
            message: "taken \"x\"".into(),
        })),
    ];
    let tree = ok_reply(&serde_json::json!({ "devices": items }));
    assert_eq!(devices_reply(&items), tree);
    assert_eq!(
        devices_reply::<u32>(&[]),
        ok_reply(&serde_json::json!({ "devices": [] }))
    );
}
