//! The state file: the device table, so a restarted daemon brings its exports back.
//!
//! JSON `{"v":1,"devices":[DeviceSpec…]}`, written to a temporary file in the same
//! directory and renamed over the old one, so a reader (or a daemon restarted
//! after `kill -9`) sees either the old table or the new one, never a torn file.
//! The rename is not followed by an fsync: the state survives the daemon being
//! killed (the page cache keeps it), and the next change rewrites it anyway.

use crate::control::proto::DeviceSpec;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StateError {
    #[error("cannot write {0}")]
    Write(String, #[source] std::io::Error),
    #[error("cannot read {0}")]
    Read(String, #[source] std::io::Error),
    #[error("{0} is not a loopd state file")]
    Parse(String, #[source] serde_json::Error),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    v: u32,
    devices: Vec<DeviceSpec>,
}

pub fn write(path: &Path, devices: &[DeviceSpec]) -> Result<(), StateError> {
    let shown = path.display().to_string();
    let body = serde_json::to_vec_pretty(&StateFile {
        v: 1,
        devices: devices.to_vec(),
    })
    .map_err(|e| StateError::Write(shown.clone(), e.into()))?;
    let tmp = path.with_extension("state.tmp");
    let mut f = std::fs::File::create(&tmp).map_err(|e| StateError::Write(shown.clone(), e))?;
    f.write_all(&body)
        .map_err(|e| StateError::Write(shown.clone(), e))?;
    drop(f);
    std::fs::rename(&tmp, path).map_err(|e| StateError::Write(shown, e))
}

/// Read the table; a missing file is an empty table.
pub fn read(path: &Path) -> Result<Vec<DeviceSpec>, StateError> {
    let shown = path.display().to_string();
    let body = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StateError::Read(shown, e)),
    };
    let s: StateFile = serde_json::from_slice(&body).map_err(|e| StateError::Parse(shown, e))?;
    Ok(s.devices)
}
