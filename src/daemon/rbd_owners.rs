//! The RBD lock owners of the devices that are not in the state file — those
//! of `serve rbd:…` and of `--config` — so that a daemon restarted after a
//! `kill -9` takes their locks back from its dead self at once, as it does for
//! the state file's devices (see `crate::backing::rbd::lock`).
//!
//! Where: a sidecar of the state file, `STATE.rbd-owners`. The state file is
//! the daemon's own durable memory, guarded by its lock (`STATE.lock`, held by
//! one daemon at a time): the sidecar is read once that lock is taken, and
//! written only while it is held, so an owner read from it was recorded by a
//! run of this daemon that is dead now. Not a record kind of the state log:
//! that log is the table of devices to restore (an older loopd would read a
//! new record kind as damage), and these devices are never restored from it
//! (they come back from the command line and `--config`).
//!
//! Format: JSON lines, a header `{"loopd_rbd_owners":1}`, then one
//! [`Owner`] per device: its name, its image (`rbd:…`), the Ceph
//! configuration and id it was opened with, and the owner librbd named the
//! lock's holder by (a RADOS client address, never a key). Each line stands
//! alone: the pure [`parse`] keeps what parses and reports the rest; a file
//! without the header is ignored whole.
//!
//! Trust: as much as the state file — the same directory (created 0700),
//! mode 0600, written by the daemon only. Whoever can write it can also write
//! the state file, which names owners the same way; nothing a client sends
//! and nothing in `--config` ever reaches it. A damaged or foreign sidecar is
//! logged and ignored, never fatal: the worst it costs is Ceph's watch
//! timeout (~30 s) before a lock is free. An owner is used only for the
//! device of the same name *and* image, configuration and id, and only as
//! "break the lock if its holder is still exactly this one": a stale owner
//! (its run stopped cleanly, or the image changed hands since) matches no
//! live holder and breaks nothing.
//!
//! Owners of this run are written ([`RbdOwners::set`]) but never offered for
//! a take-back ([`RbdOwners::previous`] gives only those of the previous
//! run): this run's client is alive, and its lock is not to be broken by a
//! second attach of the same name.
//!
//! Writes are atomic: a temporary file (0600, synced), renamed over the
//! sidecar, then the directory synced. They block (`fdatasync`): control
//! threads only, never a reactor.

use super::state::{replace_file, with_suffix};
use crate::control::proto::DeviceSpec;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The sidecar's suffix after the state file's path.
pub const SUFFIX: &str = ".rbd-owners";

/// A sidecar larger than this is not read (it holds a line per device).
const MAX_LEN: u64 = 1 << 20;

#[derive(Debug, Error)]
pub enum OwnersError {
    /// The cause is in the message (the one place it is printed).
    #[error("cannot write the RBD lock owners file {0}: {1}")]
    Write(String, std::io::Error),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    loopd_rbd_owners: u32,
}

/// One device's lock owner, and what it was the owner of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Owner {
    /// The device's name.
    pub name: String,
    /// Its image, as configured (`rbd:POOL/IMAGE`).
    pub image: String,
    /// The Ceph configuration file, as configured (absent: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceph_conf: Option<String>,
    /// The Ceph client id, as configured (absent: the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceph_id: Option<String>,
    /// The lock's holder as librbd names it (`IP:PORT/NONCE`).
    pub owner: String,
}

impl Owner {
    /// Whether this is the owner of the same device: name, image,
    /// configuration and id all the same.
    pub fn same_device(&self, other: &Owner) -> bool {
        self.name == other.name
            && self.image == other.image
            && self.ceph_conf == other.ceph_conf
            && self.ceph_id == other.ceph_id
    }
}

/// What a sidecar holds: the owners by name (the last line of a name wins),
/// and the lines that could not be read.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub owners: BTreeMap<String, Owner>,
    /// One entry per damaged line: `line N: why`.
    pub damaged: Vec<String>,
}

/// Read a sidecar's bytes (pure, any bytes). Without the header line nothing
/// is believed (it is not our file, or its start is damaged); a damaged
/// line, or an owner that is empty, is reported and skipped.
pub fn parse(text: &[u8]) -> Parsed {
    let mut p = Parsed::default();
    let mut lines = text.split(|&b| b == b'\n');
    let first = lines.next().unwrap_or_default();
    if !matches!(serde_json::from_slice::<Header>(first), Ok(h) if h.loopd_rbd_owners == 1) {
        p.damaged
            .push("line 1: not the {\"loopd_rbd_owners\":1} header".into());
        return p;
    }
    for (i, line) in lines.enumerate() {
        let n = i + 2;
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Owner>(line) {
            Ok(o) if o.owner.is_empty() => p.damaged.push(format!("line {n}: an empty owner")),
            Ok(o) => {
                p.owners.insert(o.name.clone(), o);
            }
            Err(e) => p.damaged.push(format!("line {n}: {e}")),
        }
    }
    p
}

/// The sidecar's bytes for `owners` (what [`parse`] reads back).
pub fn encode<'a>(owners: impl IntoIterator<Item = &'a Owner>) -> Vec<u8> {
    let mut v = serde_json::to_vec(&Header {
        loopd_rbd_owners: 1,
    })
    .unwrap_or_default();
    v.push(b'\n');
    for o in owners {
        // Strings only: serialising cannot fail.
        if let Ok(line) = serde_json::to_vec(o) {
            v.extend(line);
            v.push(b'\n');
        }
    }
    v
}

/// What identifies the RBD device `spec` attached as `name` here, with
/// `owner` as its lock's holder; `None`: not an RBD image, or one whose
/// configuration path is not UTF-8 (not recorded: no take-back).
pub fn owner_of(name: &str, spec: &DeviceSpec, owner: String) -> Option<Owner> {
    if !spec.is_rbd() {
        return None;
    }
    let ceph_conf = match &spec.ceph_conf {
        Some(p) => Some(p.to_str()?.to_owned()),
        None => None,
    };
    Some(Owner {
        name: name.to_owned(),
        image: spec.image.to_str()?.to_owned(),
        ceph_conf,
        ceph_id: spec.ceph_id.clone(),
        owner,
    })
}

/// The sidecar of the state file `state`.
pub fn path_for(state: &Path) -> PathBuf {
    with_suffix(state, SUFFIX)
}

/// The owners of the previous run (read at start) and of this one (written
/// as they are taken). Held by the daemon while it holds the state file's
/// lock; see the module documentation.
#[derive(Debug)]
pub struct RbdOwners {
    path: PathBuf,
    /// By name; `true`: taken by this run.
    owners: BTreeMap<String, (Owner, bool)>,
}

impl RbdOwners {
    /// Read the sidecar of the state file `state` (call with the state
    /// file's lock held). Never fails: a missing sidecar is empty, a damaged
    /// or foreign one is logged and what cannot be read is ignored.
    pub fn load(state: &Path) -> RbdOwners {
        let path = path_for(state);
        let shown = path.display().to_string();
        let owners = match read(&path) {
            Ok(None) => BTreeMap::new(),
            Ok(Some(text)) => {
                let p = parse(&text);
                if !p.damaged.is_empty() {
                    tracing::warn!(
                        "{}: {} damaged line(s) ignored ({}); kept {} owner(s). A device whose \
                         owner is lost waits for Ceph's watch timeout (~30 s) if its lock is \
                         still held by this daemon's previous run",
                        crate::text::sanitize_line(&shown),
                        p.damaged.len(),
                        crate::text::sanitize_line(&p.damaged.join("; ")),
                        p.owners.len()
                    );
                }
                p.owners.into_iter().map(|(n, o)| (n, (o, false))).collect()
            }
            Err(why) => {
                tracing::warn!(
                    "{}: ignored ({why}); devices of --config and `serve rbd:…` wait for Ceph's \
                     watch timeout (~30 s) if this daemon's previous run still holds their lock",
                    crate::text::sanitize_line(&shown)
                );
                BTreeMap::new()
            }
        };
        RbdOwners { path, owners }
    }

    /// The owner the previous run recorded for the device `want` describes
    /// (its `owner` field is not compared), if it was the same device.
    pub fn previous(&self, want: &Owner) -> Option<String> {
        match self.owners.get(&want.name) {
            Some((o, false)) if o.same_device(want) => Some(o.owner.clone()),
            _ => None,
        }
    }

    /// Record that this run took `o.name`'s lock as `o.owner` (durably).
    pub fn set(&mut self, o: Owner) -> Result<(), OwnersError> {
        if self
            .owners
            .get(&o.name)
            .is_some_and(|(had, mine)| *mine && *had == o)
        {
            return Ok(());
        }
        self.owners.insert(o.name.clone(), (o, true));
        self.write()
    }

    /// Forget `name`'s owner (detached, or its device took no lock).
    pub fn remove(&mut self, name: &str) -> Result<(), OwnersError> {
        if self.owners.remove(name).is_none() {
            return Ok(());
        }
        self.write()
    }

    /// Forget every owner (a clean stop, which lets the locks go).
    pub fn clear(&mut self) -> Result<(), OwnersError> {
        if self.owners.is_empty() && !self.path.exists() {
            return Ok(());
        }
        self.owners.clear();
        self.write()
    }

    /// Write the sidecar: temporary file (0600, synced), rename, directory
    /// sync.
    fn write(&self) -> Result<(), OwnersError> {
        let body = encode(self.owners.values().map(|(o, _)| o));
        replace_file(&self.path, &body)
            .map_err(|e| OwnersError::Write(self.path.display().to_string(), e))
    }
}

/// The sidecar's bytes (`None`: there is none); refused (the reason) if it
/// is not a regular file or is too large to be one of ours.
fn read(path: &Path) -> Result<Option<Vec<u8>>, String> {
    let mut f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    let meta = f.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        return Err("not a regular file".into());
    }
    if meta.len() > MAX_LEN {
        return Err(format!("larger than {MAX_LEN} bytes"));
    }
    let mut text = Vec::new();
    (&mut f)
        .take(MAX_LEN)
        .read_to_end(&mut text)
        .map_err(|e| e.to_string())?;
    Ok(Some(text))
}

#[cfg(test)]
mod tests;
