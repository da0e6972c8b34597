//! The `--config` file: reading it, and deciding what a reload changes.
//!
//! Contract: [`read`] parses `[[device]]` tables (unknown keys are errors),
//! checks what needs no file (names valid and unique, block sizes, `create`
//! sizes: a file failing these is refused whole, as a typo is) and makes
//! relative image paths relative to the file's directory. A device that
//! passes but cannot be attached (its image missing or locked) is the
//! daemon's to report, not an error of the file. [`plan_change`]
//! is pure: given the devices of the file as last loaded and as read now, it
//! says per device what a reload does (see `docs/config.md`, "Reloading"):
//! attach a new one; apply size limit, cache and read-only live; apply offset
//! and block size only with no client connected; leave every other change to a
//! detach and attach; keep a device gone from the file, with a warning.
//! [`next_loaded`] (pure too) says what the next reload compares the file with:
//! a device gone from the file but still attached keeps its old table there,
//! so putting it back unchanged is no change and a changed one is a change,
//! never a second attach.

use super::params::{check_create, check_name, name_of};
use super::reload_report::FieldChange;
use crate::device::spec::DeviceSpec;
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read {0}")]
    Read(PathBuf, #[source] std::io::Error),
    #[error("{0} is not a valid config file: {1}")]
    Parse(PathBuf, String),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    device: Vec<DeviceSpec>,
}

/// Read a `--config` file: `[[device]]` tables.
pub fn read(path: &Path) -> Result<Vec<DeviceSpec>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Read(path.into(), e))?;
    let c: ConfigFile = toml::from_str(&text).map_err(|e| {
        let at = e.span().map(|r| where_in(&text, r.start));
        ConfigError::Parse(path.into(), parse_message(at.as_deref(), e.message()))
    })?;
    // Relative image paths are relative to the config file's directory.
    let base = std::path::absolute(path)
        .map_err(|e| ConfigError::Read(path.into(), e))?
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    check(&c.device).map_err(|e| ConfigError::Parse(path.into(), e))?;
    Ok(c.device
        .into_iter()
        .map(|mut d| {
            if d.image.is_relative() && !d.is_rbd() {
                d.image = base.join(&d.image);
            }
            if let Some(c) = d.ceph_conf.as_mut().filter(|c| c.is_relative()) {
                *c = base.join(&*c);
            }
            d
        })
        .collect())
}

/// A parse error's message after where it is (`line 7, column 1, in the
/// [[device]] table 2 ("c1")`), when that is known.
fn parse_message(at: Option<&str>, msg: &str) -> String {
    let msg = msg.trim();
    match at {
        Some(at) => format!("{at}: {msg}"),
        None => msg.to_owned(),
    }
}

/// Where byte `pos` of a config file is, for a person: its line and column
/// (both from 1, the column in characters) and, inside a `[[device]]`
/// table, which one (from 1) and its name when the file names it.
pub fn where_in(text: &str, pos: usize) -> String {
    let pos = pos.min(text.len());
    let pos = (0..=pos)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    let before = &text[..pos];
    let line = before.matches('\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[start..].chars().count() + 1;
    let mut at = format!("line {line}, column {column}");
    let header = |l: &str| {
        let l: String = l.chars().filter(|c| !c.is_whitespace()).collect();
        l.starts_with("[[device]]")
    };
    // The `[[device]]` headers up to and including the error's line; a
    // header of another table after the last one ends it.
    let (mut count, mut inside) = (0, false);
    for l in text[..text[pos..].find('\n').map_or(text.len(), |i| pos + i)].lines() {
        let t = l.trim_start();
        if header(t) {
            count += 1;
            inside = true;
        } else if t.starts_with('[') {
            inside = false;
        }
    }
    if inside {
        let n = count;
        at.push_str(&format!(", in the [[device]] table {n}"));
        let name = toml::from_str::<toml::Table>(text).ok().and_then(|t| {
            let d = t.get("device")?.as_array()?.get(n - 1)?.as_table()?.clone();
            d.get("name").and_then(|v| v.as_str().map(str::to_owned))
        });
        if let Some(name) = name {
            at.push_str(&format!(" ({})", crate::text::quoted(&name)));
        }
    }
    at
}

/// What can be told wrong with the devices of a file without opening
/// anything: a bad or repeated name, a block size no device has, a `create`
/// size that is not whole blocks.
fn check(devices: &[DeviceSpec]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for d in devices {
        let name = name_of(d);
        let what = |e: String| format!("device {}: {e}", crate::text::quoted(&name));
        check_name(&name).map_err(what)?;
        if !seen.insert(name.clone()) {
            return Err(what("the name is given to two devices".into()));
        }
        if let Some(bs) = d
            .block_size
            .filter(|b| !matches!(b, 512 | 1024 | 2048 | 4096))
        {
            return Err(what(format!(
                "block_size {bs} is not 512, 1024, 2048 or 4096"
            )));
        }
        check_create(d).map_err(what)?;
    }
    Ok(())
}

/// Changes a reload can apply while clients stay connected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LiveChange {
    /// `Some(None)`: the limit was removed.
    pub size_limit: Option<Option<u64>>,
    pub cache: Option<crate::device::CacheMode>,
    pub read_only: Option<bool>,
}

/// Changes a reload applies only while no client is connected.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IdleChange {
    pub offset: Option<u64>,
    pub block_size: Option<u32>,
}

/// What a reload does with one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// New in the file: attach it.
    /// (Boxed: a spec is large beside the other variants.)
    Attach(Box<DeviceSpec>),
    /// The same table as before.
    Unchanged(String),
    /// A changed table: what can be applied now, and the keys that need a
    /// detach and attach.
    Changed {
        name: String,
        live: LiveChange,
        idle: IdleChange,
        reattach: Vec<&'static str>,
    },
    /// Gone from the file: kept attached.
    Removed(String),
}

/// Per device, what reloading `new` over `old` does (in the file's order; then
/// the devices gone from it).
pub fn plan_change(old: &[DeviceSpec], new: &[DeviceSpec]) -> Vec<Change> {
    let find = |name: &str| old.iter().find(|o| name_of(o) == name);
    let mut out = Vec::new();
    for n in new {
        let name = name_of(n);
        let Some(o) = find(&name) else {
            out.push(Change::Attach(Box::new(n.clone())));
            continue;
        };
        if o == n {
            out.push(Change::Unchanged(name));
            continue;
        }
        let mut live = LiveChange::default();
        let mut idle = IdleChange::default();
        let mut reattach = Vec::new();
        if o.size_limit != n.size_limit {
            live.size_limit = Some(n.size_limit);
        }
        if o.cache != n.cache {
            live.cache = Some(n.cache);
        }
        if o.read_only != n.read_only {
            live.read_only = Some(n.read_only);
        }
        if o.offset != n.offset {
            idle.offset = Some(n.offset);
        }
        match (o.block_size, n.block_size) {
            (a, b) if a == b => {}
            (_, Some(b)) => idle.block_size = Some(b),
            (Some(_), None) => reattach.push("block_size"),
            (None, None) => {}
        }
        let others: [(&'static str, bool); 18] = [
            ("image", o.image != n.image),
            (
                "strict_block_size",
                o.strict_block_size != n.strict_block_size,
            ),
            ("autoclear", o.autoclear != n.autoclear),
            ("shared", o.shared != n.shared),
            ("format", o.format != n.format),
            ("blockdev", o.blockdev != n.blockdev),
            ("queues", o.queues != n.queues),
            ("queue_depth", o.queue_depth != n.queue_depth),
            ("no_zero_copy", o.no_zero_copy != n.no_zero_copy),
            ("connections", o.connections != n.connections),
            ("partscan", o.partscan != n.partscan),
            ("ublk_id", o.ublk_id != n.ublk_id),
            ("tls_allow", o.tls_allow != n.tls_allow),
            ("ceph_conf", o.ceph_conf != n.ceph_conf),
            ("ceph_id", o.ceph_id != n.ceph_id),
            ("ceph_timeout", o.ceph_timeout != n.ceph_timeout),
            // Only matters when the image is missing, which it is not.
            ("create", false),
            ("preallocate", false),
        ];
        reattach.extend(others.iter().filter(|(_, d)| *d).map(|(k, _)| *k));
        if live == LiveChange::default() && idle == IdleChange::default() && reattach.is_empty() {
            out.push(Change::Unchanged(name));
            continue;
        }
        out.push(Change::Changed {
            name,
            live,
            idle,
            reattach,
        });
    }
    for o in old {
        let name = name_of(o);
        if !new.iter().any(|n| name_of(n) == name) {
            out.push(Change::Removed(name));
        }
    }
    out
}

/// The fields `live` changes on a device whose table was `old`.
pub fn live_fields(old: &DeviceSpec, live: &LiveChange) -> Vec<FieldChange> {
    let mut out = Vec::new();
    if let Some(l) = live.size_limit {
        out.push(field("size_limit", &old.size_limit, &l));
    }
    if let Some(c) = live.cache {
        out.push(field("cache", &old.cache, &c));
    }
    if let Some(r) = live.read_only {
        out.push(field("read_only", &old.read_only, &r));
    }
    out
}

/// The fields `idle` changes on a device whose table was `old`.
pub fn idle_fields(old: &DeviceSpec, idle: &IdleChange) -> Vec<FieldChange> {
    let mut out = Vec::new();
    if let Some(o) = idle.offset {
        out.push(field("offset", &old.offset, &o));
    }
    if let Some(b) = idle.block_size {
        out.push(field("block_size", &old.block_size, &Some(b)));
    }
    out
}

fn field<T: serde::Serialize>(name: &'static str, from: &T, to: &T) -> FieldChange {
    let v = |x: &T| serde_json::to_value(x).unwrap_or(serde_json::Value::Null);
    FieldChange {
        field: name,
        from: v(from),
        to: v(to),
    }
}

/// The devices the next reload compares the file with, after a reload of `new`
/// over `old`: the devices of `new`, but one whose change did not happen
/// (`pending`) keeps its old table (none if it was not attached), and one gone
/// from the file that is still `attached` keeps its old table too.
pub fn next_loaded(
    old: &[DeviceSpec],
    new: &[DeviceSpec],
    pending: impl Fn(&str) -> bool,
    attached: impl Fn(&str) -> bool,
) -> Vec<DeviceSpec> {
    let old_of = |n: &str| old.iter().find(|o| name_of(o) == n).cloned();
    let mut out: Vec<DeviceSpec> = new
        .iter()
        .filter_map(|s| {
            let n = name_of(s);
            if pending(&n) {
                old_of(&n)
            } else {
                Some(s.clone())
            }
        })
        .collect();
    out.extend(
        old.iter()
            .filter(|o| {
                let n = name_of(o);
                !new.iter().any(|s| name_of(s) == n) && attached(&n)
            })
            .cloned(),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::CacheMode;
    use proptest::prelude::*;

    fn dev(name: &str) -> DeviceSpec {
        DeviceSpec {
            name: Some(name.into()),
            image: PathBuf::from(format!("/img/{name}.img")),
            ..DeviceSpec::default()
        }
    }

    #[test]
    fn changed_fields_say_from_what_to_what() {
        let mut o = dev("a");
        o.size_limit = Some(50 << 20);
        o.cache = CacheMode::Direct;
        let mut n = o.clone();
        n.size_limit = None;
        n.cache = CacheMode::Buffered;
        n.offset = 4096;
        let plan = plan_change(std::slice::from_ref(&o), &[n]);
        let Change::Changed { live, idle, .. } = &plan[0] else {
            panic!("{plan:?}")
        };
        let got: Vec<String> = live_fields(&o, live)
            .into_iter()
            .chain(idle_fields(&o, idle))
            .map(|f| format!("{} {} {}", f.field, f.from, f.to))
            .collect();
        assert_eq!(
            got,
            [
                "size_limit 52428800 null",
                "cache \"direct\" \"buffered\"",
                "offset 0 4096"
            ]
        );
    }

    /// Issue 27: a config error names the line, the column and the
    /// `[[device]]` table (and its name).
    #[test]
    fn config_errors_say_where() {
        let text = "[[device]]\nimage = \"a.img\"\n\n[[device]]\nname = \"c1\"\nimage = \"b.img\"\nsise_limit = 5\n";
        let dir = std::env::temp_dir().join(format!("loopd-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("bad.toml");
        std::fs::write(&f, text).unwrap();
        let e = read(&f).unwrap_err().to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(
            e.contains("bad.toml is not a valid config file: line 7, column 1, in the [[device]] table 2 (\"c1\"): unknown field `sise_limit`"),
            "{e}"
        );
        assert_eq!(where_in("a = 1\n", 4), "line 1, column 5");
        assert_eq!(
            where_in("[[device]]\nx = é1\n", 17),
            "line 2, column 6, in the [[device]] table 1"
        );
    }

    #[test]
    fn a_file_is_refused_whole_for_what_needs_no_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("c.toml");
        let refused = |text: &str, words: &str| {
            std::fs::write(&f, text).expect("write");
            match read(&f) {
                Err(ConfigError::Parse(_, m)) => assert!(m.contains(words), "{m}"),
                other => panic!("{text}: {other:?}"),
            }
        };
        refused(
            "[[device]]\nimage = \"/a.img\"\n[[device]]\nimage = \"/b/a.img\"\n",
            "device \"a\": the name is given to two devices",
        );
        refused(
            "[[device]]\nimage = \"/a.img\"\nblock_size = 1000\n",
            "block_size 1000 is not 512",
        );
        refused(
            "[[device]]\nimage = \"/a.img\"\ncreate = 100\n",
            "not a whole number of 512-byte blocks",
        );
        refused(
            "[[device]]\nimage = \"/a.img\"\nname = \"a/b\"\n",
            "is invalid",
        );
        // A missing image is no error of the file.
        std::fs::write(&f, "[[device]]\nimage = \"/nowhere/a.img\"\n").expect("write");
        assert_eq!(read(&f).expect("parses").len(), 1);
    }

    #[test]
    fn new_unchanged_removed() {
        let old = vec![dev("a"), dev("b")];
        let new = vec![dev("a"), dev("c")];
        assert_eq!(
            plan_change(&old, &new),
            vec![
                Change::Unchanged("a".into()),
                Change::Attach(Box::new(dev("c"))),
                Change::Removed("b".into()),
            ]
        );
    }

    #[test]
    fn changes_are_sorted_by_how_they_apply() {
        let old = vec![dev("a")];
        let mut n = dev("a");
        n.size_limit = Some(1 << 20);
        n.cache = CacheMode::Buffered;
        n.read_only = true;
        n.offset = 4096;
        n.block_size = Some(4096);
        n.image = PathBuf::from("/img/other.img");
        n.shared = true;
        let plan = plan_change(&old, &[n]);
        assert_eq!(
            plan,
            vec![Change::Changed {
                name: "a".into(),
                live: LiveChange {
                    size_limit: Some(Some(1 << 20)),
                    cache: Some(CacheMode::Buffered),
                    read_only: Some(true),
                },
                idle: IdleChange {
                    offset: Some(4096),
                    block_size: Some(4096),
                },
                reattach: vec!["image", "shared"],
            }]
        );
    }

    #[test]
    fn removing_a_limit_is_live() {
        let mut o = dev("a");
        o.size_limit = Some(4096);
        let plan = plan_change(&[o], &[dev("a")]);
        assert!(
            matches!(&plan[0], Change::Changed { live, reattach, .. }
                if live.size_limit == Some(None) && reattach.is_empty()),
            "{plan:?}"
        );
    }

    #[test]
    fn create_alone_changes_nothing() {
        let mut n = dev("a");
        n.create = Some(1 << 20);
        assert_eq!(
            plan_change(&[dev("a")], &[n]),
            vec![Change::Unchanged("a".into())]
        );
    }

    #[test]
    fn reads_relative_paths_and_refuses_unknown_keys() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c.toml");
        std::fs::write(&p, "[[device]]\nimage = \"x.img\"\nsize_limit = \"1M\"\n").unwrap();
        let v = read(&p).unwrap();
        assert_eq!(v[0].image, d.path().join("x.img"));
        assert_eq!(v[0].size_limit, Some(1 << 20));
        std::fs::write(&p, "[[device]]\nimage = \"x.img\"\nbogus = 1\n").unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(e.contains("not a valid config file"), "{e}");
    }

    #[test]
    fn a_device_put_back_while_attached_is_unchanged() {
        let a = dev("a");
        let s = dev("s");
        let attached = |n: &str| n == "a" || n == "s";
        // s is removed from the file but stays attached.
        let loaded = next_loaded(
            &[a.clone(), s.clone()],
            std::slice::from_ref(&a),
            |_| false,
            attached,
        );
        assert_eq!(loaded, vec![a.clone(), s.clone()]);
        assert_eq!(
            plan_change(&loaded, std::slice::from_ref(&a)),
            vec![Change::Unchanged("a".into()), Change::Removed("s".into())]
        );
        // Put back as it was: unchanged; put back changed: a change.
        let back = [a.clone(), s.clone()];
        assert_eq!(
            plan_change(&loaded, &back)[1],
            Change::Unchanged("s".into())
        );
        let mut s2 = s.clone();
        s2.size_limit = Some(4096);
        assert!(matches!(
            &plan_change(&loaded, &[a.clone(), s2])[1],
            Change::Changed { name, .. } if name == "s"
        ));
        // Detached meanwhile: forgotten, so putting it back attaches it.
        let gone = next_loaded(&loaded, std::slice::from_ref(&a), |_| false, |n| n == "a");
        assert_eq!(gone, vec![a]);
    }

    proptest! {
        /// Reloading any sequence of files: a device still attached is never
        /// planned as a new attach (which fails: the name is taken), and after
        /// each reload every device of the file is attached with its size limit.
        #[test]
        fn a_reload_never_attaches_an_attached_device(
            files in proptest::collection::vec(
                proptest::collection::btree_map("[a-d]", proptest::option::of(1u64..3), 0..4),
                1..6),
        ) {
            use std::collections::BTreeMap;
            let mut attached: BTreeMap<String, Option<u64>> = BTreeMap::new();
            let mut loaded: Vec<DeviceSpec> = Vec::new();
            for f in &files {
                let new: Vec<DeviceSpec> = f.iter().map(|(n, l)| DeviceSpec {
                    size_limit: *l, ..dev(n)
                }).collect();
                for c in plan_change(&loaded, &new) {
                    match c {
                        Change::Attach(s) => {
                            let n = name_of(&s);
                            prop_assert!(!attached.contains_key(&n), "{} attached twice", n);
                            attached.insert(n, s.size_limit);
                        }
                        Change::Changed { name, live, .. } => {
                            prop_assert!(attached.contains_key(&name));
                            if let Some(l) = live.size_limit {
                                attached.insert(name, l);
                            }
                        }
                        Change::Unchanged(n) | Change::Removed(n) => {
                            prop_assert!(attached.contains_key(&n));
                        }
                    }
                }
                for s in &new {
                    prop_assert_eq!(attached.get(&name_of(s)), Some(&s.size_limit));
                }
                loaded = next_loaded(&loaded, &new, |_| false, |n| attached.contains_key(n));
            }
        }

        /// Every device of either file appears in the plan exactly once.
        #[test]
        fn every_device_is_planned_once(old in proptest::collection::btree_set("[a-e]", 0..5),
                                        new in proptest::collection::btree_set("[a-e]", 0..5),
                                        limits in proptest::collection::vec(proptest::option::of(0u64..4), 5)) {
            let mk = |names: &std::collections::BTreeSet<String>, salt: usize| -> Vec<DeviceSpec> {
                names.iter().enumerate().map(|(i, n)| {
                    let mut d = dev(n);
                    d.size_limit = limits[(i + salt) % limits.len()];
                    d
                }).collect()
            };
            let (o, n) = (mk(&old, 0), mk(&new, 1));
            let plan = plan_change(&o, &n);
            let names: Vec<String> = plan.iter().map(|c| match c {
                Change::Attach(s) => name_of(s),
                Change::Unchanged(n) | Change::Removed(n) => n.clone(),
                Change::Changed { name, .. } => name.clone(),
            }).collect();
            let mut all: Vec<String> = old.union(&new).cloned().collect();
            let mut got = names.clone();
            all.sort();
            got.sort();
            prop_assert_eq!(got, all);
            for c in &plan {
                match c {
                    Change::Attach(s) => prop_assert!(!old.contains(&name_of(s))),
                    Change::Removed(n) => prop_assert!(!new.contains(n)),
                    _ => {}
                }
            }
        }
    }
}
