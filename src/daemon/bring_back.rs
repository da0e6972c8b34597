//! Bringing a missing device back with `attach`: its record wins.
//!
//! Contract: [`merge`] is pure. A device of the state file whose image is
//! missing keeps its record (read-only, window, allow-list, block size, cache
//! mode, …); an `attach` of its image under its name brings it back *as
//! recorded*. A key the request leaves at its default means "as recorded"; a
//! key it sets to something else than the record is a different device, and
//! the request is refused with every such key, what is asked and what is
//! recorded ([`Differs`]). `create` (how to make the image if it is gone) is
//! the request's; the daemon's own records (`ublk_id`) are kept; `file` is
//! recorded anew by the attach, which opens the path as given.

use crate::device::spec::DeviceSpec;
use serde::Serialize;

/// A key a request sets to something else than the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Differs {
    pub key: &'static str,
    pub asked: String,
    pub recorded: String,
}

fn show<T: Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::Null) => "none".to_owned(),
        Ok(serde_json::Value::String(s)) => s,
        Ok(v) => v.to_string(),
        Err(_) => "?".to_owned(),
    }
}

fn check<T: PartialEq + Default + Serialize>(
    key: &'static str,
    asked: &T,
    recorded: &T,
    out: &mut Vec<Differs>,
) {
    if *asked != T::default() && asked != recorded {
        out.push(Differs {
            key,
            asked: show(asked),
            recorded: show(recorded),
        });
    }
}

/// The device to attach when `asked` names a missing device recorded as
/// `recorded` (same name and image, checked by the caller): the record, with
/// the request's `create`; or every key the request sets differently.
pub fn merge(recorded: &DeviceSpec, asked: &DeviceSpec) -> Result<DeviceSpec, Vec<Differs>> {
    // Every key, by name: a key added to DeviceSpec must be decided here.
    let DeviceSpec {
        image: _,
        name: _,
        offset,
        size_limit,
        block_size,
        strict_block_size,
        cache,
        read_only,
        autoclear,
        create,
        preallocate,
        shared,
        format,
        blockdev,
        queues,
        queue_depth,
        no_zero_copy,
        connections,
        partscan,
        ublk_id: _,
        tls_allow,
        file: _,
        ceph_conf,
        ceph_id,
        ceph_timeout,
        rbd_lock_owner: _,
    } = asked;
    let r = recorded;
    let mut d = Vec::new();
    check("offset", offset, &r.offset, &mut d);
    check("size_limit", size_limit, &r.size_limit, &mut d);
    check("block_size", block_size, &r.block_size, &mut d);
    check(
        "strict_block_size",
        strict_block_size,
        &r.strict_block_size,
        &mut d,
    );
    check("cache", cache, &r.cache, &mut d);
    check("read_only", read_only, &r.read_only, &mut d);
    check("autoclear", autoclear, &r.autoclear, &mut d);
    check("shared", shared, &r.shared, &mut d);
    check("format", format, &r.format, &mut d);
    check("blockdev", blockdev, &r.blockdev, &mut d);
    check("queues", queues, &r.queues, &mut d);
    check("queue_depth", queue_depth, &r.queue_depth, &mut d);
    check("no_zero_copy", no_zero_copy, &r.no_zero_copy, &mut d);
    check("connections", connections, &r.connections, &mut d);
    check("partscan", partscan, &r.partscan, &mut d);
    check("tls_allow", tls_allow, &r.tls_allow, &mut d);
    check("ceph_conf", ceph_conf, &r.ceph_conf, &mut d);
    check("ceph_id", ceph_id, &r.ceph_id, &mut d);
    check("ceph_timeout", ceph_timeout, &r.ceph_timeout, &mut d);
    if !d.is_empty() {
        return Err(d);
    }
    Ok(DeviceSpec {
        create: *create,
        preallocate: *preallocate,
        ..recorded.clone()
    })
}

/// `offset 0 asked, 1048576 recorded; read_only …` for an error message.
pub fn describe(d: &[Differs]) -> String {
    d.iter()
        .map(|x| format!("{} {} asked, {} recorded", x.key, x.asked, x.recorded))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CacheMode;
    use proptest::prelude::*;

    fn rec() -> DeviceSpec {
        DeviceSpec {
            image: "/img/a.img".into(),
            name: Some("a".into()),
            offset: 1 << 20,
            size_limit: Some(4 << 20),
            read_only: true,
            cache: CacheMode::Buffered,
            block_size: Some(4096),
            tls_allow: vec!["cn:alice".into()],
            ublk_id: Some(3),
            ..DeviceSpec::default()
        }
    }

    fn plain() -> DeviceSpec {
        DeviceSpec {
            image: "/img/a.img".into(),
            name: Some("a".into()),
            ..DeviceSpec::default()
        }
    }

    #[test]
    fn a_plain_attach_brings_the_record_back() {
        let mut asked = plain();
        asked.create = Some(8 << 20);
        let got = merge(&rec(), &asked).unwrap();
        assert_eq!(
            got,
            DeviceSpec {
                create: Some(8 << 20),
                ..rec()
            }
        );
    }

    #[test]
    fn asking_the_recorded_values_again_is_fine() {
        assert_eq!(merge(&rec(), &rec()).unwrap(), rec());
    }

    #[test]
    fn differing_keys_are_all_named_with_both_values() {
        let mut asked = plain();
        asked.offset = 4096;
        asked.tls_allow = vec!["cn:bob".into()];
        asked.autoclear = true;
        let d = merge(&rec(), &asked).unwrap_err();
        let keys: Vec<&str> = d.iter().map(|x| x.key).collect();
        assert_eq!(keys, ["offset", "autoclear", "tls_allow"]);
        let text = describe(&d);
        assert!(
            text.contains("offset 4096 asked, 1048576 recorded"),
            "{text}"
        );
        assert!(
            text.contains(r#"tls_allow ["cn:bob"] asked, ["cn:alice"] recorded"#),
            "{text}"
        );
    }

    proptest! {
        /// Whatever is asked, the result is the record (but `create`) or a
        /// refusal naming a key asked non-default and unlike the record; a
        /// restriction of the record is never dropped.
        #[test]
        fn the_record_is_kept_or_the_request_refused(
            r_ro in any::<bool>(), a_ro in any::<bool>(),
            r_off in 0u64..3, a_off in 0u64..3,
            r_lim in proptest::option::of(1u64..3), a_lim in proptest::option::of(1u64..3),
            r_allow in proptest::collection::vec("[ab]", 0..2),
            a_allow in proptest::collection::vec("[ab]", 0..2),
        ) {
            let r = DeviceSpec { read_only: r_ro, offset: r_off * 4096, size_limit: r_lim,
                                 tls_allow: r_allow.clone(), ..plain() };
            let a = DeviceSpec { read_only: a_ro, offset: a_off * 4096, size_limit: a_lim,
                                 tls_allow: a_allow.clone(), ..plain() };
            match merge(&r, &a) {
                Ok(m) => prop_assert_eq!(m, r),
                Err(d) => {
                    prop_assert!(!d.is_empty());
                    for x in &d {
                        let differs = match x.key {
                            "read_only" => a_ro && a_ro != r_ro,
                            "offset" => a_off != 0 && a_off != r_off,
                            "size_limit" => a_lim.is_some() && a_lim != r_lim,
                            "tls_allow" => !a_allow.is_empty() && a_allow != r_allow,
                            _ => false,
                        };
                        prop_assert!(differs, "{:?}", x);
                    }
                }
            }
        }
    }
}
