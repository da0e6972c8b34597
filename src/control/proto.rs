//! The control protocol: one JSON request per line, one JSON reply per line.
//!
//! Pure types and parsing (fuzzable, no I/O). Every request carries the protocol
//! version `"v"`; a reply is either `{"v":1,"ok":true,"result":…}` or
//! `{"v":1,"ok":false,"error":{"code":…,"message":…}}`. `docs/control.md` is the
//! user-facing description; keep the two in step.

use crate::device::CacheMode;
pub use crate::device::spec::DeviceSpec;
use serde::{Deserialize, Serialize};

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;
/// Longest request line accepted.
pub const MAX_LINE: usize = 1 << 20;

/// Live changes to a device; absent fields stay as they are.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetSpec {
    pub name: String,
    /// Absent: unchanged; `null`: remove the limit; a number: the new limit.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub size_limit: Option<Option<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<CacheMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
    /// Apply changes connected clients cannot follow (offset, block size).
    #[serde(default)]
    pub force: bool,
}

/// A field that is present (even as `null`): `Some` of its value.
fn present<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    T::deserialize(d).map(Some)
}

/// What a client asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// Boxed: a device spec is far larger than every other request.
    Attach(Box<DeviceSpec>),
    /// Attach many devices with one durable write of the state file; each
    /// succeeds or fails on its own (the reply lists each outcome in order).
    AttachBatch {
        devices: Vec<DeviceSpec>,
    },
    Detach {
        name: String,
        #[serde(default)]
        force: bool,
    },
    List,
    /// One device's status; without a name, every device's.
    Status {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    Set(SetSpec),
    Resize {
        name: String,
    },
    Version,
    /// Re-read the TLS certificates (as SIGHUP does); new connections use them.
    ReloadTls,
    /// Re-read the TLS certificates and the `--config` file (as SIGHUP does).
    Reload,
}

/// Machine-readable error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// Not JSON, not an object, unknown op or field, wrong type.
    BadRequest,
    /// `"v"` missing or not one this daemon speaks.
    UnsupportedVersion,
    /// No device with that name.
    NotFound,
    /// A device with that name exists.
    NameTaken,
    /// Clients are connected and the request needs `force`.
    Busy,
    /// A value is out of range (block size, offset, size).
    Invalid,
    /// The image could not be created, opened or probed.
    Io,
    /// The filesystem refuses direct I/O for `cache: direct`.
    DirectRefused,
    /// The daemon is stopping.
    ShuttingDown,
    /// The kernel lacks what is needed (a module, a permission, a device
    /// limit); the message says what to do.
    Unavailable,
    Internal,
}

/// An error reply's body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
}

/// Parse one request line (without its newline).
pub fn parse_request(line: &[u8]) -> Result<Request, ErrorBody> {
    let bad = |message: String| ErrorBody {
        code: ErrorCode::BadRequest,
        message,
    };
    if line.len() > MAX_LINE {
        return Err(bad(format!("request longer than {MAX_LINE} bytes")));
    }
    let mut v: serde_json::Value =
        serde_json::from_slice(line).map_err(|e| bad(format!("not JSON: {e}")))?;
    let obj = v
        .as_object_mut()
        .ok_or_else(|| bad("request is not a JSON object".into()))?;
    match obj.remove("v").and_then(|v| v.as_u64()) {
        Some(n) if n == u64::from(VERSION) => {}
        Some(n) => {
            return Err(ErrorBody {
                code: ErrorCode::UnsupportedVersion,
                message: format!(
                    "protocol version {n} is not supported; this daemon speaks {VERSION}"
                ),
            });
        }
        None => {
            return Err(ErrorBody {
                code: ErrorCode::UnsupportedVersion,
                message: format!(
                    "request has no numeric \"v\" (protocol version; this daemon speaks {VERSION})"
                ),
            });
        }
    }
    // Requests without fields: serde accepts anything beside "op" for them, the
    // document does not.
    if let Some(op @ ("list" | "version" | "reload_tls" | "reload")) =
        obj.get("op").and_then(|o| o.as_str())
    {
        if let Some(k) = obj.keys().find(|k| *k != "op") {
            return Err(bad(format!(
                "bad request: unknown field `{k}`: op {op} takes no fields"
            )));
        }
    }
    serde_json::from_value(v).map_err(|e| bad(format!("bad request: {e}")))
}

/// Encode a request as one line (no newline), with the version.
pub fn encode_request(r: &Request) -> String {
    let mut v = serde_json::to_value(r).unwrap_or(serde_json::Value::Null);
    if let Some(o) = v.as_object_mut() {
        o.insert("v".into(), VERSION.into());
    }
    v.to_string()
}

/// Encode a successful reply as one line.
pub fn ok_reply<T: Serialize>(result: &T) -> String {
    serde_json::json!({ "v": VERSION, "ok": true, "result": result }).to_string()
}

/// As [`ok_reply`], for a result that is already a JSON value: moved into
/// the reply, not copied.
pub fn ok_reply_value(result: serde_json::Value) -> String {
    let mut m = serde_json::Map::new();
    m.insert("v".into(), VERSION.into());
    m.insert("ok".into(), true.into());
    m.insert("result".into(), result);
    serde_json::Value::Object(m).to_string()
}

/// As [`ok_reply`], written straight from `result` (no JSON tree in
/// between). Replies keep their keys in sorted order (as [`ok_reply`]'s JSON
/// tree does), so `T` must serialize its fields in sorted order
/// (`DeviceInfo` and [`BatchItem`] do; their tests check).
pub fn sorted_reply<T: Serialize>(result: &T) -> String {
    // Keys in sorted order.
    #[derive(Serialize)]
    struct Reply<'a, R> {
        ok: bool,
        result: &'a R,
        v: u32,
    }
    let r = Reply {
        ok: true,
        result,
        v: VERSION,
    };
    serde_json::to_string(&r).unwrap_or_else(|e| {
        err_reply(&ErrorBody {
            code: ErrorCode::Internal,
            message: format!("cannot encode the reply: {e}"),
        })
    })
}

/// A [`sorted_reply`] whose result is `{"devices":[…]}` (a list or a batch
/// of thousands of devices).
pub fn devices_reply<T: Serialize>(devices: &[T]) -> String {
    #[derive(Serialize)]
    struct Devices<'a, T> {
        devices: &'a [T],
    }
    sorted_reply(&Devices { devices })
}

/// One device's outcome in an `attach_batch` reply: `{"ok":true,"result":…}`
/// or `{"error":{"code":…,"message":…},"ok":false}` (keys in sorted order).
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum BatchItem<T> {
    Done { ok: bool, result: T },
    Refused { error: ErrorBody, ok: bool },
}

/// The [`BatchItem`] of one device's outcome.
pub fn batch_item<T: Serialize>(r: Result<T, ErrorBody>) -> BatchItem<T> {
    match r {
        Ok(result) => BatchItem::Done { ok: true, result },
        Err(error) => BatchItem::Refused { error, ok: false },
    }
}

/// Encode an error reply as one line.
pub fn err_reply(e: &ErrorBody) -> String {
    serde_json::json!({ "v": VERSION, "ok": false, "error": e }).to_string()
}

/// A decoded reply: the result value or the error.
pub fn parse_reply(line: &[u8]) -> Result<Result<serde_json::Value, ErrorBody>, String> {
    #[derive(Deserialize)]
    struct Reply {
        #[allow(dead_code)]
        v: u32,
        ok: bool,
        #[serde(default)]
        result: serde_json::Value,
        error: Option<ErrorBody>,
    }
    let r: Reply =
        serde_json::from_slice(line).map_err(|e| format!("malformed reply from daemon: {e}"))?;
    match (r.ok, r.error) {
        (true, _) => Ok(Ok(r.result)),
        (false, Some(e)) => Ok(Err(e)),
        (false, None) => Err("error reply without an error body".into()),
    }
}

#[cfg(test)]
mod tests;
