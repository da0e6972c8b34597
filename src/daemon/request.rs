//! One control request in, one reply line out: [`Daemon::handle`] runs the
//! action a typed [`Request`] names on the caller's thread and encodes its
//! result or error ([`super::error::CtlError::body`]).

use super::registry::Daemon;
use crate::control::proto::{
    Request, batch_item, devices_reply, err_reply, ok_reply, ok_reply_value, sorted_reply,
};

impl Daemon {
    /// Run one control request and encode its reply line.
    pub fn handle(&self, req: Request) -> String {
        let r = match req {
            Request::Attach(spec) => self.attach(*spec, true).map(|i| sorted_reply(&i)),
            Request::AttachBatch { devices } => {
                let items: Vec<_> = self
                    .attach_batch(devices)
                    .into_iter()
                    .map(|r| batch_item(r.map_err(|e| e.body())))
                    .collect();
                Ok(devices_reply(&items))
            }
            Request::Detach { name, force } => self
                .detach(&name, force)
                .map(|()| ok_reply(&serde_json::json!({ "name": name }))),
            Request::List => Ok(devices_reply(&self.list())),
            Request::Status { name: Some(name) } => self.status(&name).map(|s| ok_reply(&s)),
            Request::Status { name: None } => Ok(ok_reply_value(
                serde_json::json!({ "devices": self.status_all() }),
            )),
            Request::Set(s) => self.set(s).map(|r| ok_reply(&r)),
            Request::Resize { name } => self.resize(&name).map(|r| ok_reply(&r)),
            Request::Reload => self.reload().map(|r| ok_reply(&r)),
            Request::ReloadTls => self
                .reload_tls()
                .map(|()| ok_reply(&serde_json::json!({ "reloaded": "tls" }))),
            Request::Version => Ok(ok_reply(&serde_json::json!({
                "version": env!("CARGO_PKG_VERSION"),
                "protocol": crate::control::proto::VERSION,
            }))),
        };
        r.unwrap_or_else(|e| err_reply(&e.body()))
    }
}
