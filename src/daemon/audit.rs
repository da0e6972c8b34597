//! Audit lines: one info line per control request that changes something
//! (attach, detach, set, resize, reload), naming who asked (the control client's
//! uid and pid, from `SO_PEERCRED`) and the outcome. Pure formatting; the
//! control socket logs what [`line`] returns.

use crate::control::proto::Request;
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
        "ok".to_string()
    } else {
        format!(
            "refused: {} ({})",
            v["error"]["message"].as_str().unwrap_or("?"),
            v["error"]["code"].as_str().unwrap_or("?")
        )
    };
    let what = match req {
        Request::Attach(s) => {
            let name = r["name"]
                .as_str()
                .map_or_else(|| s.name.clone().unwrap_or_default(), str::to_owned);
            format!("attach {name:?} image={:?}", s.image)
        }
        Request::Detach { name, force } => {
            format!("detach {name:?}{}", if *force { " force" } else { "" })
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
            format!("set {:?} {}{changed}", s.name, asked.join(" "))
        }
        Request::Resize { name } => {
            let old = old_size.map_or_else(|| "?".into(), |n| n.to_string());
            let new = r["size"]
                .as_u64()
                .map_or_else(|| "?".into(), |n| n.to_string());
            format!("resize {name:?} {old} -> {new} bytes")
        }
        Request::Reload => "reload".into(),
        Request::ReloadTls => "reload-tls".into(),
        Request::List | Request::Status { .. } | Request::Version => return None,
    };
    Some(format!("audit: {what} by {caller}: {outcome}"))
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
}
