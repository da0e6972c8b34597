//! `loopd detach NAME...`: one name is one `detach` request, as always;
//! several are one `detach` request each, in the order given (the control
//! protocol keeps its single-device request: a detach waits for its own
//! clients, and with --force for their I/O, so there is nothing for one
//! durable write to share as `attach_batch` does). Each name succeeds or
//! fails on its own: a success prints `detached NAME`, a failure one
//! `loopd: error: NAME: …` line; the exit status is that of the first
//! failure (0 if none). Under `--json` several names print one array, an
//! object per name. A daemon that cannot be reached ends the command there.

use super::exit::{BatchFailed, DaemonError, print_item_error};
use super::print::print_done;
use anyhow::Result;
use loopd::control::client;
use loopd::control::proto::{ErrorBody, Request};
use serde_json::{Value, json};
use std::path::Path;

/// Run `loopd detach`.
pub fn run(ctl: &Path, names: &[String], force: bool, json: bool) -> Result<()> {
    let req = |name: &str| Request::Detach {
        name: name.to_owned(),
        force,
    };
    if let [name] = names {
        let v = client::call(ctl, &req(name))?.map_err(DaemonError)?;
        return print_done(&v, json, &format!("detached {name}"));
    }
    let mut first: Option<ErrorBody> = None;
    let mut failed = 0;
    let mut out = Vec::new();
    for name in names {
        match client::call(ctl, &req(name))? {
            Ok(v) => {
                if !json {
                    print_done(&v, false, &format!("detached {name}"))?;
                }
                out.push(json!({ "name": name, "ok": true, "result": v }));
            }
            Err(e) => {
                failed += 1;
                print_item_error(&loopd::text::escape(name), &e);
                out.push(json!({ "name": name, "ok": false, "error": e.clone() }));
                first.get_or_insert(e);
            }
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&Value::from(out))?);
    }
    match first {
        None => Ok(()),
        Some(e) => Err(BatchFailed {
            failed,
            total: names.len(),
            what: "device(s) not detached",
            code: e.code,
        }
        .into()),
    }
}
