//! Reloading (SIGHUP, the `reload` request): the TLS certificates and the
//! `--config` file.
//!
//! Contract: [`Daemon::reload`] re-reads the certificates (when TLS is on) and
//! the config file the daemon started with, applies [`config::plan_change`]'s
//! plan, and returns a [`ReloadReport`]; one summary line is logged at info and
//! each change not applied at warn. A config file that does not read or parse
//! changes nothing (the error is logged and returned). Devices are never
//! detached by a reload; one that cannot be attached is reported `failed` and
//! kept missing ([`Daemon::attach_config`]), as at start; one gone from the
//! file stays attached until the server stops, and the reload says so.

use super::audit;
use super::config::{self, Change};
use super::error::CtlError;
use super::params::name_of;
use super::registry::Daemon;
pub use super::reload_report::{DeviceChanges, Problem, ReloadReport};
use crate::control::proto::SetSpec;
use crate::device::spec::DeviceSpec;
use crate::text::quoted;
use std::path::Path;

const REATTACH: &str = "detach and attach it to apply";

/// What becomes of a device gone from the config file but still attached:
/// the config file was its only record (it is not in the state file).
const KEPT_UNTIL: &str = "until the server stops: it is not attached again at the next start";

impl Daemon {
    /// Remember the config file and the devices read from it at start.
    pub fn set_config(&self, path: &Path, specs: Vec<DeviceSpec>) {
        if let Ok(mut g) = self.config.lock() {
            let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
            *g = Some((path, specs));
        }
    }

    /// [`Daemon::reload`], then its audit line: `by` names who asked (SIGHUP's
    /// sender; a control client's reload is audited by the control socket).
    pub fn reload_audited(&self, by: &str) -> Result<ReloadReport, CtlError> {
        let r = self.reload();
        tracing::info!("{}", audit::reload_line(by, r.as_ref()));
        r
    }

    /// Re-read the certificates and the config file (see the module doc).
    pub fn reload(&self) -> Result<ReloadReport, CtlError> {
        let tls = match self.reload_tls() {
            Ok(()) => "reloaded".to_owned(),
            Err(CtlError::TlsOff) => "off".to_owned(),
            // Logged by reload_tls.
            Err(e) => crate::text::error_chain(&e),
        };
        let path = self
            .config
            .lock()
            .ok()
            .and_then(|g| g.as_ref().map(|(p, _)| p.clone()));
        let mut report = match path {
            None => ReloadReport::default(),
            Some(p) => {
                let specs = config::read(&p).map_err(|e| {
                    let e = CtlError::Config(e);
                    tracing::error!("reload: {}", crate::text::error_chain(&e));
                    e
                })?;
                let mut r = self.reload_config(specs);
                r.config = Some(p);
                r
            }
        };
        report.tls = tls;
        tracing::info!("{}", report.summary());
        Ok(report)
    }

    /// Apply the devices `specs` of the config file over those last loaded.
    pub fn reload_config(&self, specs: Vec<DeviceSpec>) -> ReloadReport {
        // One reload at a time: the plan is made against the last one.
        let mut guard = match self.config.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let old = guard.as_ref().map(|(_, s)| s.clone()).unwrap_or_default();
        let mut r = ReloadReport::default();
        for change in config::plan_change(&old, &specs) {
            self.apply_change(change, &old, &specs, &mut r);
        }
        // People read the names; they count `new2` before `new10`.
        for v in [
            &mut r.attached,
            &mut r.changed,
            &mut r.unchanged,
            &mut r.kept,
        ] {
            v.sort_by(|a, b| crate::text::natural_cmp(a, b));
        }
        r.changes
            .sort_by(|a, b| crate::text::natural_cmp(&a.name, &b.name));
        for v in [&mut r.not_applied, &mut r.failed] {
            v.sort_by(|a, b| crate::text::natural_cmp(&a.name, &b.name));
        }
        for p in &r.not_applied {
            tracing::warn!("reload: device {}: {}", quoted(&p.name), p.message);
        }
        for p in &r.failed {
            tracing::error!("reload: device {}: {}", quoted(&p.name), p.message);
        }
        for n in &r.kept {
            tracing::warn!(
                "reload: device {} is no longer in the config file; it stays attached \
                 {KEPT_UNTIL} (detach it now with `loopd detach {}`, or put it back in the \
                 file to keep it)",
                quoted(n),
                quoted(n)
            );
        }
        // What did not happen is planned again by the next reload: the old
        // table stays recorded for it (none, for a device not attached); a
        // device gone from the file but still attached keeps its table, so
        // putting it back is no new attach.
        let pending = |n: &str| r.not_applied.iter().chain(&r.failed).any(|p| p.name == n);
        let attached = |n: &str| self.export(n).is_some_and(|e| !e.persistent);
        let loaded = config::next_loaded(&old, &specs, pending, attached);
        if let Some((_, s)) = guard.as_mut() {
            *s = loaded;
        }
        r
    }

    fn apply_change(
        &self,
        change: Change,
        old: &[DeviceSpec],
        specs: &[DeviceSpec],
        r: &mut ReloadReport,
    ) {
        // The message with its causes (an errno among them), each once.
        let fail = |name: &str, e: CtlError| Problem {
            name: name.to_owned(),
            message: crate::text::error_chain(&e),
        };
        match change {
            Change::Attach(spec) => {
                let name = name_of(&spec);
                match self.attach_config(*spec) {
                    Ok(_) => r.attached.push(name),
                    Err(e) => r.failed.push(fail(&name, e)),
                }
            }
            // Still attached (a device detached meanwhile is just forgotten).
            Change::Removed(name) => {
                if self.export(&name).is_some() {
                    r.kept.push(name);
                } else if self.missing_config(&name) {
                    // Failed to attach, now gone from the file: forgotten.
                    if let Ok(mut m) = self.missing.lock() {
                        m.remove(&name);
                    }
                }
            }
            Change::Unchanged(name) => {
                // Detached meanwhile: the file still wants it.
                if self.export(&name).is_none() {
                    self.reattach(&name, specs, r);
                } else {
                    r.unchanged.push(name);
                }
            }
            Change::Changed {
                name,
                live,
                idle,
                reattach,
            } => {
                if self.export(&name).is_none() {
                    self.reattach(&name, specs, r);
                    return;
                }
                let was = old.iter().find(|o| name_of(o) == name);
                let mut fields = Vec::new();
                let mut done = false;
                let mut failed = false;
                if live != config::LiveChange::default() {
                    let s = SetSpec {
                        name: name.clone(),
                        size_limit: live.size_limit,
                        cache: live.cache,
                        read_only: live.read_only,
                        ..SetSpec::default()
                    };
                    match self.set(s) {
                        Ok(_) => {
                            done = true;
                            fields.extend(
                                was.map(|o| config::live_fields(o, &live))
                                    .into_iter()
                                    .flatten(),
                            );
                        }
                        // A smaller size or read-only on with clients connected:
                        // `set` wants --force, which a reload never gives.
                        Err(CtlError::Busy(why)) => r.not_applied.push(Problem {
                            name: name.clone(),
                            message: format!("{why} (a reload never forces; reload again later)"),
                        }),
                        Err(e) => {
                            failed = true;
                            r.failed.push(fail(&name, e));
                        }
                    }
                }
                if idle != config::IdleChange::default() {
                    let s = SetSpec {
                        name: name.clone(),
                        offset: idle.offset,
                        block_size: idle.block_size,
                        ..SetSpec::default()
                    };
                    match self.set(s) {
                        Ok(_) => {
                            done = true;
                            fields.extend(
                                was.map(|o| config::idle_fields(o, &idle))
                                    .into_iter()
                                    .flatten(),
                            );
                        }
                        Err(CtlError::Busy(_)) => {
                            let clients = self.export(&name).map_or(0, |e| e.clients());
                            r.not_applied.push(Problem {
                                name: name.clone(),
                                message: format!(
                                    "offset or block_size changed but {clients} client(s) are \
                                     connected; disconnect them and reload, or {REATTACH}"
                                ),
                            });
                        }
                        Err(e) => {
                            failed = true;
                            r.failed.push(fail(&name, e));
                        }
                    }
                }
                if !reattach.is_empty() {
                    r.not_applied.push(Problem {
                        name: name.clone(),
                        message: format!("{} changed: {REATTACH}", reattach.join(", ")),
                    });
                }
                if done && !failed {
                    r.changes.push(DeviceChanges {
                        name: name.clone(),
                        fields,
                    });
                    r.changed.push(name);
                }
            }
        }
    }

    /// Attach again a device of the file that was detached meanwhile.
    fn reattach(&self, name: &str, specs: &[DeviceSpec], r: &mut ReloadReport) {
        let Some(spec) = specs.iter().find(|s| name_of(s) == name) else {
            return;
        };
        match self.attach_config(spec.clone()) {
            Ok(_) => r.attached.push(name.to_owned()),
            Err(e) => r.failed.push(Problem {
                name: name.to_owned(),
                message: crate::text::error_chain(&e),
            }),
        }
    }
}
