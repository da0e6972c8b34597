//! [`ReloadReport`]: what a reload did, device by device, and its one-line
//! summary. Pure data: [`super::reload`] fills it, [`super::audit`] and the
//! CLI print it.

use serde::Serialize;
use std::path::PathBuf;

/// What a reload did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReloadReport {
    /// `reloaded`, `off` (no TLS), or why the certificates were not reloaded.
    pub tls: String,
    /// The config file re-read; `None`: the daemon runs without --config.
    pub config: Option<PathBuf>,
    /// Devices new in the file, now attached.
    pub attached: Vec<String>,
    /// Devices whose changes were applied.
    pub changed: Vec<String>,
    /// What changed on each of `changed`, field by field.
    pub changes: Vec<DeviceChanges>,
    pub unchanged: Vec<String>,
    /// Devices no longer in the file, still attached.
    pub kept: Vec<String>,
    /// Changes not applied, with what to do.
    pub not_applied: Vec<Problem>,
    /// Devices that could not be attached or changed.
    pub failed: Vec<Problem>,
}

/// The fields a reload changed on one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceChanges {
    pub name: String,
    pub fields: Vec<FieldChange>,
}

/// One field a reload changed: its config key, and its value in the file
/// before and now (sizes in bytes, `null` for none: no size limit, the
/// default block size).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldChange {
    pub field: &'static str,
    pub from: serde_json::Value,
    pub to: serde_json::Value,
}

/// One device's change that did not happen.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    pub name: String,
    pub message: String,
}

impl ReloadReport {
    /// The one line logged at info.
    pub fn summary(&self) -> String {
        let Some(c) = &self.config else {
            return format!("reload: TLS {}; no --config", self.tls);
        };
        format!(
            "reload of {}: {} attached, {} changed, {} unchanged, {} not applied, \
             {} kept though gone from the file, {} failed; TLS {}",
            c.display(),
            self.attached.len(),
            self.changed.len(),
            self.unchanged.len(),
            self.not_applied.len(),
            self.kept.len(),
            self.failed.len(),
            self.tls
        )
    }
}
