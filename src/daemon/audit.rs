//! Audit lines: one info line per control request that changes something
//! (attach, detach, set, resize, reload), naming who asked (the control client's
//! uid and pid, from `SO_PEERCRED`) and the outcome; one per SIGHUP reload,
//! naming the signal's sender ([`reload_line`]); and one per size change of an
//! RBD image that a device followed, or could not ([`image_resize_line`]). A reload's outcome is its
//! summary (what was attached, changed, not applied, kept, failed; TLS).
//! Untrusted strings (names, image paths) are quoted with [`crate::text`].
//! Pure formatting; the control socket and the signal thread log what
//! [`line`] and [`reload_line`] return.

use super::error::CtlError;
use super::reload_report::ReloadReport;
use crate::control::proto::{DeviceSpec, Request};
use crate::text::{quoted, quoted_path};
use serde_json::Value;

/// The control client, as the kernel vouches for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    pub uid: Option<u32>,
    pub pid: Option<i32>,
}

impl std::fmt::Display for Caller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.uid, self.pid) {
            (Some(u), Some(p)) => write!(f, "uid={u} pid={p}"),
            _ => f.write_str("uid=? pid=?"),
        }
    }
}

/// The audit line for `req` answered by `reply` (a reply line), or `None` for
/// requests that change nothing. `old_size`: the device's size before a resize.
pub fn line(req: &Request, caller: Caller, old_size: Option<u64>, reply: &str) -> Option<String> {
    let v: Value = serde_json::from_str(reply).unwrap_or(Value::Null);
    let r = &v["result"];
    let outcome = if v["ok"].as_bool() == Some(true) {
        match req {
            Request::Reload => reload_outcome(r),
            _ => "ok".to_string(),
        }
    } else {
        refused(&v)
    };
    let what = match req {
        Request::Attach(s) => attach_what(s, r),
        Request::Detach { name, force } => {
            format!(
                "detach {}{}",
                quoted(name),
                if *force { " force" } else { "" }
            )
        }
        Request::Set(s) => {
            let mut asked = Vec::new();
            match s.size_limit {
                Some(Some(x)) => asked.push(format!("size_limit={x}")),
                Some(None) => asked.push("size_limit=none".into()),
                None => {}
            }
            if let Some(x) = s.offset {
                asked.push(format!("offset={x}"));
            }
            if let Some(x) = s.block_size {
                asked.push(format!("block_size={x}"));
            }
            if let Some(x) = s.cache {
                let c = serde_json::to_value(x).unwrap_or(Value::Null);
                asked.push(format!("cache={}", c.as_str().unwrap_or("?")));
            }
            if let Some(x) = s.read_only {
                asked.push(format!("read_only={x}"));
            }
            if s.force {
                asked.push("force".into());
            }
            let changed = match r["changed"].as_bool() {
                Some(true) => format!(" (changed; size now {})", r["size"]),
                Some(false) => " (nothing changed)".into(),
                None => String::new(),
            };
            format!("set {} {}{changed}", quoted(&s.name), asked.join(" "))
        }
        Request::Resize { name } => {
            let old = old_size.map_or_else(|| "?".into(), |n| n.to_string());
            let new = r["size"]
                .as_u64()
                .map_or_else(|| "?".into(), |n| n.to_string());
            format!("resize {} {old} -> {new} bytes", quoted(name))
        }
        Request::AttachBatch { devices } => {
            format!("attach-batch of {} device(s)", devices.len())
        }
        Request::Reload => "reload".into(),
        Request::ReloadTls => "reload-tls".into(),
        Request::List | Request::Status { .. } | Request::Version => return None,
    };
    Some(format!("audit: {what} by {caller}: {outcome}"))
}

/// The audit lines for `req` answered by `reply`: [`line`], and for an
/// `attach_batch` one line per device (as if each were its own `attach`).
pub fn lines(req: &Request, caller: Caller, old_size: Option<u64>, reply: &str) -> Vec<String> {
    let Request::AttachBatch { devices } = req else {
        return line(req, caller, old_size, reply).into_iter().collect();
    };
    let v: Value = serde_json::from_str(reply).unwrap_or(Value::Null);
    let items = v["result"]["devices"].as_array();
    if items.is_none_or(|i| i.len() != devices.len()) {
        // Refused as a whole.
        return line(req, caller, old_size, reply).into_iter().collect();
    }
    // Each item as if it were the reply to its own `attach`.
    devices
        .iter()
        .zip(items.into_iter().flatten())
        .map(|(d, item)| {
            let outcome = if item["ok"].as_bool() == Some(true) {
                "ok".to_string()
            } else {
                refused(item)
            };
            format!(
                "audit: {} by {caller}: {outcome}",
                attach_what(d, &item["result"])
            )
        })
        .collect()
}

/// What an attach of `spec` did, its reply's result being `r`.
fn attach_what(spec: &DeviceSpec, r: &Value) -> String {
    let name = r["name"]
        .as_str()
        .unwrap_or_else(|| spec.name.as_deref().unwrap_or_default());
    format!("attach {} image={}", quoted(name), quoted_path(&spec.image))
}

/// A refusal's outcome from a reply (or batch item) `v`.
fn refused(v: &Value) -> String {
    format!(
        "refused: {} ({})",
        v["error"]["message"].as_str().unwrap_or("?"),
        v["error"]["code"].as_str().unwrap_or("?")
    )
}

/// A reload's outcome from its report (a reply's `result`, or the report as
/// JSON): `ok` (or `partly failed`), then the summary.
fn reload_outcome(r: &Value) -> String {
    let n = |k: &str| r[k].as_array().map_or(0, Vec::len);
    let config = r["config"].as_str().map_or_else(
        || "no --config".to_owned(),
        |c| format!("config {}", quoted(c)),
    );
    format!(
        "{}: {config}: {} attached, {} changed, {} unchanged, {} not applied, {} kept, \
         {} failed; TLS {}",
        if n("failed") > 0 {
            "partly failed"
        } else {
            "ok"
        },
        n("attached"),
        n("changed"),
        n("unchanged"),
        n("not_applied"),
        n("kept"),
        n("failed"),
        r["tls"].as_str().unwrap_or("?")
    )
}

/// The audit line of a resize an RBD image's size change brought (see
/// `super::follow`): device `name` on image `image`, whose size went from
/// `image.0` to `image.1`; the device was `dev_was` bytes, and `outcome` is
/// its size now or why it was refused (then it kept `dev_was`).
pub fn image_resize_line(
    name: &str,
    image: &str,
    sizes: (u64, u64),
    dev_was: u64,
    outcome: Result<u64, String>,
) -> String {
    let (from, to) = sizes;
    let how = if to > from { "grew" } else { "shrank" };
    let (dev_now, outcome) = match outcome {
        Ok(n) if n == dev_was => (
            n.to_string(),
            "ok (the device's window, --offset/--size-limit, is unchanged)".to_owned(),
        ),
        Ok(n) => (n.to_string(), "ok".to_owned()),
        Err(why) => (
            "?".to_owned(),
            format!(
                "refused: {}; the device keeps its size, {dev_was} bytes",
                crate::text::sanitize_line(&why)
            ),
        ),
    };
    format!(
        "audit: resize {} {dev_was} -> {dev_now} bytes by the RBD image {} (it {how} from \
         {from} to {to} bytes): {outcome}",
        quoted(name),
        quoted(image)
    )
}

/// The audit line of a reload that did not come over the control socket
/// (SIGHUP); `by` says who asked (e.g. `signal SIGHUP from pid=1 uid=0`).
pub fn reload_line(by: &str, report: Result<&ReloadReport, &CtlError>) -> String {
    let outcome = match report {
        Ok(r) => reload_outcome(&serde_json::to_value(r).unwrap_or(Value::Null)),
        Err(e) => format!("failed: {}", crate::text::error_chain(e)),
    };
    format!("audit: reload by {by}: {outcome}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::proto::SetSpec;

    const WHO: Caller = Caller {
        uid: Some(1000),
        pid: Some(42),
    };

    #[test]
    fn a_batch_gives_one_line_per_device() {
        let dev = |image: &str| crate::control::proto::DeviceSpec {
            image: image.into(),
            ..Default::default()
        };
        let req = Request::AttachBatch {
            devices: vec![dev("/i/a.img"), dev("/i/b.img")],
        };
        let reply = r#"{"v":1,"ok":true,"result":{"devices":[{"ok":true,"result":{"name":"a"}},{"ok":false,"error":{"code":"io","message":"cannot open"}}]}}"#;
        let l = lines(&req, WHO, None, reply);
        assert_eq!(l.len(), 2, "{l:?}");
        assert!(
            l[0].contains(r#"attach "a" image="/i/a.img""#) && l[0].ends_with(": ok"),
            "{l:?}"
        );
        assert!(
            l[1].contains("/i/b.img") && l[1].contains("refused: cannot open (io)"),
            "{l:?}"
        );
        // Refused as a whole: one line.
        let whole = r#"{"v":1,"ok":false,"error":{"code":"shutting_down","message":"stopping"}}"#;
        assert_eq!(lines(&req, WHO, None, whole).len(), 1);
    }

    #[test]
    fn changes_are_audited_with_who_asked() {
        let set = Request::Set(SetSpec {
            name: "a".into(),
            size_limit: Some(Some(4096)),
            read_only: Some(true),
            ..SetSpec::default()
        });
        let reply = r#"{"v":1,"ok":true,"result":{"name":"a","size":4096,"changed":true}}"#;
        assert_eq!(
            line(&set, WHO, None, reply).as_deref(),
            Some(
                "audit: set \"a\" size_limit=4096 read_only=true (changed; size now 4096) \
                 by uid=1000 pid=42: ok"
            )
        );
        let rs = Request::Resize { name: "a".into() };
        let reply = r#"{"v":1,"ok":true,"result":{"name":"a","size":8192,"changed":true}}"#;
        assert_eq!(
            line(&rs, WHO, Some(4096), reply).as_deref(),
            Some("audit: resize \"a\" 4096 -> 8192 bytes by uid=1000 pid=42: ok")
        );
        let d = Request::Detach {
            name: "b".into(),
            force: false,
        };
        let reply = r#"{"v":1,"ok":false,"error":{"code":"not_found","message":"no device b"}}"#;
        assert_eq!(
            line(&d, WHO, None, reply).as_deref(),
            Some("audit: detach \"b\" by uid=1000 pid=42: refused: no device b (not_found)")
        );
        assert_eq!(line(&Request::List, WHO, None, "{}"), None);
    }

    #[test]
    fn reloads_are_audited_with_their_summary() {
        let reply = r#"{"v":1,"ok":true,"result":{"tls":"off","config":"/etc/d.toml",
            "attached":["a"],"changed":[],"unchanged":["b","c"],"kept":[],
            "not_applied":[],"failed":[]}}"#;
        assert_eq!(
            line(&Request::Reload, WHO, None, reply).as_deref(),
            Some(
                "audit: reload by uid=1000 pid=42: ok: config \"/etc/d.toml\": 1 attached, \
                 0 changed, 2 unchanged, 0 not applied, 0 kept, 0 failed; TLS off"
            )
        );
        let report = ReloadReport {
            tls: "reloaded".into(),
            failed: vec![super::super::reload_report::Problem {
                name: "x".into(),
                message: "no".into(),
            }],
            ..ReloadReport::default()
        };
        assert_eq!(
            reload_line("signal SIGHUP from pid=7 uid=0", Ok(&report)),
            "audit: reload by signal SIGHUP from pid=7 uid=0: partly failed: no --config: \
             0 attached, 0 changed, 0 unchanged, 0 not applied, 0 kept, 1 failed; TLS reloaded"
        );
        let e = CtlError::Invalid("bad.toml: not a valid config file; nothing changed".into());
        assert!(
            reload_line("signal SIGHUP (sender unknown)", Err(&e))
                .starts_with("audit: reload by signal SIGHUP (sender unknown): failed: ")
        );
    }

    #[test]
    fn an_rbd_image_resize_says_both_sizes_and_the_outcome() {
        assert_eq!(
            image_resize_line("a", "rbd/vm1", (4096, 8192), 4096, Ok(8192)),
            "audit: resize \"a\" 4096 -> 8192 bytes by the RBD image \"rbd/vm1\" (it grew \
             from 4096 to 8192 bytes): ok"
        );
        assert_eq!(
            image_resize_line("a", "rbd/vm1", (8192, 6144), 1024, Ok(1024)),
            "audit: resize \"a\" 1024 -> 1024 bytes by the RBD image \"rbd/vm1\" (it shrank \
             from 8192 to 6144 bytes): ok (the device's window, --offset/--size-limit, is \
             unchanged)"
        );
        let l = image_resize_line(
            "a",
            "rbd/vm1",
            (8192, 2048),
            4096,
            Err("cannot resize \"a\": the window reaches past the end\nof the image".into()),
        );
        assert_eq!(
            l,
            "audit: resize \"a\" 4096 -> ? bytes by the RBD image \"rbd/vm1\" (it shrank \
             from 8192 to 2048 bytes): refused: cannot resize \"a\": the window reaches past \
             the end\\nof the image; the device keeps its size, 4096 bytes"
        );
    }

    #[test]
    fn forged_names_stay_inside_their_quotes() {
        let d = Request::Detach {
            name: "x\naudit: detach \"prod\" by uid=1000 pid=4242: ok\u{202e}".into(),
            force: false,
        };
        let reply = r#"{"v":1,"ok":false,"error":{"code":"not_found","message":"no"}}"#;
        let l = line(&d, WHO, None, reply).unwrap_or_default();
        assert!(!l.contains(['\n', '\u{202e}']), "{l}");
        assert!(
            l.starts_with(r#"audit: detach "x\naudit: detach \"prod\" by"#),
            "{l}"
        );
    }
}
