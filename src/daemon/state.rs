//! The state file: the device table, so a restarted daemon brings its exports back.
//!
//! An append-only log of JSON lines: a header `{"loopd_state":1}`, then one record
//! per change, `{"put":DeviceSpec}` (attach, set, resize) or `{"del":"name"}`
//! (detach). A change costs one `write(2)` to an `O_APPEND` file, done before the
//! control reply is sent, so a daemon killed (`kill -9`) right after acknowledging
//! a change still finds it on restart: the record is in the page cache. (Power loss
//! is another matter: nothing is fsync-ed; a torn last line is ignored.)
//! On start, and when the log has grown well past the table, it is compacted: the
//! live table is written to a temporary file renamed over the log.

use crate::control::proto::DeviceSpec;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum StateError {
    #[error("cannot write {0}")]
    Write(String, #[source] std::io::Error),
    #[error("cannot read {0}")]
    Read(String, #[source] std::io::Error),
    #[error("{0} is not a loopd state file (no {{\"loopd_state\":1}} header)")]
    NotState(String),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    loopd_state: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Record {
    Put(DeviceSpec),
    Del(String),
}

/// An open state log. See the module documentation.
pub struct StateLog {
    path: PathBuf,
    file: File,
    records: usize,
}

fn name_of(spec: &DeviceSpec) -> String {
    super::name_of(spec)
}

/// Replay the log at `path` into a table (in first-attached order). A missing
/// file is an empty table; an unreadable line (a torn last write) is skipped.
pub fn read(path: &Path) -> Result<Vec<DeviceSpec>, StateError> {
    let shown = path.display().to_string();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(StateError::Read(shown, e)),
    };
    let mut lines = text.lines();
    match lines.next().map(serde_json::from_str::<Header>) {
        Some(Ok(h)) if h.loopd_state == 1 => {}
        None => return Ok(Vec::new()),
        _ => return Err(StateError::NotState(shown)),
    }
    let mut table: Vec<DeviceSpec> = Vec::new();
    for (i, line) in lines.enumerate() {
        match serde_json::from_str::<Record>(line) {
            Ok(Record::Put(spec)) => {
                let name = name_of(&spec);
                match table.iter_mut().find(|s| name_of(s) == name) {
                    Some(slot) => *slot = spec,
                    None => table.push(spec),
                }
            }
            Ok(Record::Del(name)) => table.retain(|s| name_of(s) != name),
            Err(e) => tracing::warn!("{shown}: skipping unreadable record {}: {e}", i + 2),
        }
    }
    Ok(table)
}

fn encode(r: &Record) -> Vec<u8> {
    let mut v = serde_json::to_vec(r).unwrap_or_default();
    v.push(b'\n');
    v
}

impl StateLog {
    /// Write `table` as a fresh log (temporary file + rename) and open it for appends.
    pub fn create(path: &Path, table: &[DeviceSpec]) -> Result<StateLog, StateError> {
        let shown = || path.display().to_string();
        let mut body = serde_json::to_vec(&Header { loopd_state: 1 }).unwrap_or_default();
        body.push(b'\n');
        for spec in table {
            body.extend(encode(&Record::Put(spec.clone())));
        }
        let tmp = path.with_extension("state.tmp");
        std::fs::write(&tmp, &body).map_err(|e| StateError::Write(shown(), e))?;
        std::fs::rename(&tmp, path).map_err(|e| StateError::Write(shown(), e))?;
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| StateError::Write(shown(), e))?;
        Ok(StateLog {
            path: path.to_path_buf(),
            file,
            records: table.len(),
        })
    }

    fn append(&mut self, r: &Record) -> Result<(), StateError> {
        // One write(2) per record: with O_APPEND it lands whole or not at all as
        // far as a killed process is concerned.
        self.file
            .write_all(&encode(r))
            .map_err(|e| StateError::Write(self.path.display().to_string(), e))?;
        self.records += 1;
        Ok(())
    }

    pub fn put(&mut self, spec: &DeviceSpec) -> Result<(), StateError> {
        self.append(&Record::Put(spec.clone()))
    }

    pub fn del(&mut self, name: &str) -> Result<(), StateError> {
        self.append(&Record::Del(name.to_owned()))
    }

    /// Whether the log is worth compacting for a table of `live` devices.
    pub fn bloated(&self, live: usize) -> bool {
        self.records > 2 * live + 256
    }
}
