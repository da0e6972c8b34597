//! The state file: the devices attached over the control socket, so a restarted
//! daemon brings them back.
//!
//! Format: an append-only log of JSON lines, a header `{"loopd_state":1}`, then
//! one record per change, `{"put":DeviceSpec}` (attach, set) or `{"del":"name"}`
//! (detach). Replaying the records in order gives the table.
//!
//! Contract:
//! - One daemon per state file: [`StateLog::open`] takes an exclusive `flock` on
//!   `STATE.lock` (holding the owner's pid) for the life of the log; a second
//!   opener gets [`StateError::Locked`] and must not start. The lock file is
//!   removed when the log is dropped (a `kill -9` leaves it: harmless).
//! - Nothing is written to a path that exists and is not a loopd state file
//!   (not a regular file, or no header): [`StateError::NotState`].
//! - A change is durable before it is acknowledged, and concurrent changes
//!   share the cost (group commit, [`super::group_commit`]): a record is staged
//!   ([`StateLog::stage_put`], [`StateLog::stage_del`]; in the order the caller
//!   means, e.g. under its own lock) and then waited for ([`StateLog::wait`];
//!   [`StateLog::put`] and [`StateLog::del`] do both). The first waiter writes
//!   every record staged so far in one `write(2)` to the `O_APPEND` file and
//!   one `fdatasync`, and wakes the others; records staged meanwhile form the
//!   next batch. If the write or the sync fails, the partial lines are cut off
//!   again and every record of the batch is refused (the in-memory table, which
//!   holds only what is durable, is unchanged). Rewrites (the first record, and
//!   compaction) go to a temporary file (mode 0600, synced) renamed over the
//!   log, then the directory is synced.
//! - Threads: the log is shared (`&self`); its one mutex (inside the group
//!   commit) is never held across a write or sync of a batch, only across the
//!   rare whole-file rewrites of [`StateLog::compact`]; [`StateLog::wait`]
//!   blocks for up to two batches' sync.
//! - Damaged lines (unreadable JSON, a torn last line without its newline from a
//!   crash or power loss) never make the state shrink silently: what parses is
//!   kept, the whole file is first copied to `STATE.damaged-YYYYmmddTHHMMSSZ`
//!   (logged), and the next write rewrites the log from what was read.
//! - The log owns the table it replays and maintains, so compaction never depends
//!   on what the daemon has managed to attach: a device whose image is missing
//!   stays recorded.

use super::group_commit::{GroupCommit, Ticket};
use crate::control::proto::DeviceSpec;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use table::Table;
use thiserror::Error;

/// Mode of the state file and its lock file (whatever the umask).
pub(super) const MODE: u32 = 0o600;

#[derive(Debug, Error)]
pub enum StateError {
    #[error("cannot write the state file {0}")]
    Write(String, #[source] std::io::Error),
    #[error("cannot read the state file {0}")]
    Read(String, #[source] std::io::Error),
    #[error(
        "{0} is not a loopd state file ({1}); refusing to use it (and to overwrite it): give --state a path of its own"
    )]
    NotState(String, &'static str),
    #[error(
        "the state file {path} is in use by another loopd (pid {pid}); give each daemon its own --state"
    )]
    Locked { path: String, pid: String },
    #[error("cannot lock the state file {0}")]
    Lock(String, #[source] std::io::Error),
    #[error("the state file {0} has damaged records, and they cannot be saved aside to {1}")]
    SaveDamaged(String, String, #[source] std::io::Error),
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    loopd_state: u32,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Record {
    Put(Box<DeviceSpec>),
    Del(String),
}

#[cfg(test)]
fn name_of(spec: &DeviceSpec) -> String {
    super::params::name_of(spec)
}

/// What a state file holds: the table, and the lines that could not be read.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    /// The devices, in first-attached order.
    pub table: Vec<DeviceSpec>,
    /// One entry per damaged line: `line N: why`.
    pub damaged: Vec<String>,
}

/// Whether `text` starts with a loopd state header line.
fn has_header(text: &[u8]) -> bool {
    let first = text.split(|&b| b == b'\n').next().unwrap_or_default();
    matches!(serde_json::from_slice::<Header>(first), Ok(h) if h.loopd_state == 1)
}

/// Whether `start` (the first bytes of a file) is a loopd state file: it has the
/// header, or (a damaged header) its first whole line after the first is a
/// record. A disk image or a text file is neither.
fn looks_like_state(start: &[u8]) -> bool {
    if has_header(start) {
        return true;
    }
    let mut lines = start.split(|&b| b == b'\n');
    let first_record = lines.nth(1);
    // Only whole lines: the 4 KiB window may cut the last one.
    lines.next().is_some()
        && first_record.is_some_and(|l| serde_json::from_slice::<Record>(l).is_ok())
}

/// Replay the records of a state file (pure, any bytes). Damaged lines (the
/// header line included) are reported, never fatal.
pub fn parse(text: &[u8]) -> Parsed {
    let mut p = Parsed::default();
    if !has_header(text) {
        p.damaged
            .push("line 1: not the {\"loopd_state\":1} header".into());
    }
    let mut lines: Vec<&[u8]> = text.split(|&b| b == b'\n').collect();
    // The piece after the last newline: empty for a whole file, else torn.
    let tail = lines.pop().unwrap_or_default();
    let mut replay = table::Replay::default();
    for (i, line) in lines.iter().enumerate().skip(1) {
        match serde_json::from_slice::<Record>(line) {
            Ok(Record::Put(spec)) => replay.put(*spec),
            Ok(Record::Del(name)) => replay.del(&name),
            Err(e) => p.damaged.push(format!("line {}: {e}", i + 1)),
        }
    }
    p.table = replay.finish();
    if !tail.is_empty() && !lines.is_empty() {
        p.damaged.push(format!(
            "line {}: torn (no newline at the end of the file)",
            lines.len() + 1
        ));
    }
    p
}

/// Apply one record to the log's table.
fn apply(table: &mut Table, r: Record) {
    match r {
        Record::Put(spec) => table.put(*spec),
        Record::Del(name) => table.del(&name),
    }
}

/// The plain replay of one record (the reference the indexed [`table`] is
/// checked against).
#[cfg(test)]
fn apply_plain(table: &mut Vec<DeviceSpec>, r: Record) {
    match r {
        Record::Put(spec) => {
            let spec = *spec;
            let name = name_of(&spec);
            match table.iter_mut().find(|s| name_of(s) == name) {
                Some(slot) => *slot = spec,
                None => table.push(spec),
            }
        }
        Record::Del(name) => table.retain(|s| name_of(s) != name),
    }
}

/// A put record, serialised from a borrowed spec (a compaction copies no spec).
#[derive(Serialize)]
struct SpecRef<'a> {
    put: &'a DeviceSpec,
}

fn encode(r: &Record) -> Vec<u8> {
    let mut v = serde_json::to_vec(r).unwrap_or_default();
    v.push(b'\n');
    v
}

/// `path` + `suffix` (`nbd.state` → `nbd.state.lock`).
pub(super) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// `YYYYmmddTHHMMSSZ` for a time in seconds since the epoch (UTC).
pub fn utc_stamp(secs: u64) -> String {
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z / 146_097;
    let doe = z % 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + u64::from(m <= 2);
    format!(
        "{y:04}{m:02}{d:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// `fsync` the directory `path` is in (a rename or a new file in it durable).
pub(super) fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Replace the file at `path` with `body`, durably and all at once: a
/// temporary file beside it (mode [`MODE`], data synced), renamed over it,
/// then the directory synced. On error the temporary file is removed and
/// `path` is as it was.
pub(super) fn replace_file(path: &Path, body: &[u8]) -> std::io::Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(MODE)
            .open(&tmp)?;
        f.set_permissions(std::fs::Permissions::from_mode(MODE))?;
        f.write_all(body)?;
        f.sync_data()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// The state log's mutable part, behind its group commit.
struct Log {
    path: PathBuf,
    /// The log, open for appends; `None` until the file exists and is whole (the
    /// next record then rewrites the file from `table`).
    file: Option<File>,
    /// Bytes of whole records in `file` (a failed append is cut back to this).
    len: u64,
    /// The durable table: what the file holds (and amendments for the next
    /// rewrite, [`StateLog::amend`]).
    table: Table,
    records: usize,
    /// The file exists (so a compaction must keep it up to date).
    exists: bool,
    /// `fdatasync`s of appended batches.
    syncs: u64,
}

/// A staged record and its line.
type Staged = (Record, Vec<u8>);

/// A failed batch's error, for each of its records.
#[derive(Clone)]
struct Failure(std::io::ErrorKind, String);

/// A record staged by [`StateLog::stage_put`] or [`StateLog::stage_del`]:
/// acknowledge its change only once [`StateLog::wait`] says it is durable.
#[must_use = "a staged record is acknowledged only once waited for"]
pub struct Pending(Ticket);

/// An open, locked state log. See the module documentation.
pub struct StateLog {
    path: PathBuf,
    log: GroupCommit<Log, Staged, Failure>,
    _lock: File,
}

impl StateLog {
    /// Lock and read the state file at `path` (a missing file is an empty table).
    /// Damaged records are logged and the file is first copied aside.
    pub fn open(path: &Path) -> Result<StateLog, StateError> {
        let shown = path.display().to_string();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if !dir.exists() {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(dir)
                    .map_err(|e| StateError::Write(shown.clone(), e))?;
            }
        }
        // Refuse a foreign file before creating anything beside it.
        precheck(path)?;
        let lock = lock(path)?;
        let log = Log::read(path)?;
        Ok(StateLog {
            path: path.to_path_buf(),
            log: GroupCommit::new(log),
            _lock: lock,
        })
    }

    /// The devices recorded (durably), in first-attached order.
    pub fn table(&self) -> Vec<DeviceSpec> {
        self.log.with(|l| l.table.specs().to_vec())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Record an attach or a change of `spec` (durably, see the module docs).
    pub fn put(&self, spec: &DeviceSpec) -> Result<(), StateError> {
        self.wait(self.stage_put(spec))
    }

    /// Record a detach (durably).
    pub fn del(&self, name: &str) -> Result<(), StateError> {
        self.wait(self.stage_del(name))
    }

    /// Queue the record of an attach or a change of `spec` for the next batch
    /// (records are written in the order they are staged).
    pub fn stage_put(&self, spec: &DeviceSpec) -> Pending {
        self.stage(Record::Put(Box::new(spec.clone())))
    }

    /// Queue the attach records of `specs` together, in order: no other record
    /// comes between them, so they go out in one write.
    pub fn stage_puts(&self, specs: &[&DeviceSpec]) -> Vec<Pending> {
        let staged = specs
            .iter()
            .map(|s| {
                let r = Record::Put(Box::new((*s).clone()));
                let line = encode(&r);
                (r, line)
            })
            .collect();
        self.log
            .stage_all(staged)
            .into_iter()
            .map(Pending)
            .collect()
    }

    /// Queue the record of a detach for the next batch.
    pub fn stage_del(&self, name: &str) -> Pending {
        self.stage(Record::Del(name.to_owned()))
    }

    fn stage(&self, r: Record) -> Pending {
        // Encoded on the caller's thread, outside any commit.
        let line = encode(&r);
        Pending(self.log.stage((r, line)))
    }

    /// Wait until the batch holding `p` is durable (leading it if no write
    /// runs: see [`super::group_commit`]); a failed write or sync fails every
    /// record of its batch, and the file and table are as they were.
    pub fn wait(&self, p: Pending) -> Result<(), StateError> {
        self.log
            .wait(p.0, Log::commit)
            .map_err(|Failure(kind, msg)| {
                StateError::Write(
                    self.path.display().to_string(),
                    std::io::Error::new(kind, msg),
                )
            })
    }

    /// Batches made durable by one `fdatasync` each, since the log was opened.
    pub fn syncs(&self) -> u64 {
        self.log.with(|l| l.syncs)
    }

    /// Drop `name` from the table without a record of its own (it is gone from
    /// the file at the next rewrite, e.g. [`StateLog::compact`]).
    pub fn forget(&self, name: &str) {
        self.log.with(|l| l.table.del(name));
    }

    /// Change `spec`'s device in the table without a record of its own (it is
    /// written at the next rewrite, e.g. [`StateLog::compact`]): only for what
    /// a crash may lose (a restored device's file as found in this boot).
    pub fn amend(&self, spec: &DeviceSpec) {
        self.log.with(|l| l.table.put(spec.clone()));
    }

    /// Rewrite the file from the table (when it exists or has anything to hold).
    /// Records staged and not yet written are written after it.
    pub fn compact(&self) -> Result<(), StateError> {
        self.log.with(|l| {
            if !l.exists && l.table.is_empty() {
                return Ok(());
            }
            let table = std::mem::take(&mut l.table);
            let r = l.rewrite(table.specs());
            l.table = table;
            r.map_err(|e| StateError::Write(l.path.display().to_string(), e))
        })
    }
}

impl Log {
    /// Read the state file at `path` (under its lock).
    fn read(path: &Path) -> Result<Log, StateError> {
        let shown = path.display().to_string();
        let mut log = Log {
            path: path.to_path_buf(),
            file: None,
            len: 0,
            table: Table::default(),
            records: 0,
            exists: false,
            syncs: 0,
        };
        // Now under the lock: the file as it is (checked again, it may have
        // changed since `precheck`).
        let Some((mut f, meta, mut text)) = read_head(path)? else {
            return Ok(log);
        };
        log.exists = true;
        if meta.len() == 0 {
            return Ok(log);
        }
        f.read_to_end(&mut text)
            .map_err(|e| StateError::Read(shown.clone(), e))?;
        let parsed = parse(&text);
        for spec in parsed.table {
            log.table.put(spec);
        }
        log.records = log.table.len();
        if !parsed.damaged.is_empty() {
            let secs = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0);
            let stamp = utc_stamp(secs);
            let mut aside = with_suffix(path, &format!(".damaged-{stamp}"));
            let mut n = 1;
            loop {
                match save_copy(&text, &aside) {
                    Ok(()) => break,
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 100 => {
                        aside = with_suffix(path, &format!(".damaged-{stamp}.{n}"));
                        n += 1;
                    }
                    Err(e) => {
                        let to = aside.display().to_string();
                        return Err(StateError::SaveDamaged(shown, to, e));
                    }
                }
            }
            tracing::error!(
                "state file {shown}: {} damaged record(s) skipped ({}); kept {} device(s); \
                 the file as it was is saved in {}",
                parsed.damaged.len(),
                parsed.damaged.join("; "),
                log.table.len(),
                aside.display()
            );
            return Ok(log);
        }
        let file = OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| StateError::Write(shown, e))?;
        log.len = meta.len();
        log.file = Some(file);
        Ok(log)
    }

    /// Make one batch durable (the group commit's leader, no lock held): one
    /// `write(2)` of all its lines and one `fdatasync`, or a rewrite when the
    /// file is not whole. The table changes only once the batch is durable.
    fn commit(&mut self, batch: Vec<Staged>) -> Result<(), Failure> {
        let fail = |e: std::io::Error| Failure(e.kind(), e.to_string());
        if self.file.is_none() {
            let mut table = self.table.clone();
            for (r, _) in batch {
                apply(&mut table, r);
            }
            self.rewrite(table.specs()).map_err(fail)?;
            self.table = table;
            return Ok(());
        }
        let mut lines = Vec::with_capacity(batch.iter().map(|(_, l)| l.len()).sum());
        for (_, l) in &batch {
            lines.extend_from_slice(l);
        }
        self.append(&lines).map_err(fail)?;
        self.records += batch.len();
        for (r, _) in batch {
            apply(&mut self.table, r);
        }
        if self.records > 2 * self.table.len() + 256 {
            let table = std::mem::take(&mut self.table);
            if let Err(e) = self.rewrite(table.specs()) {
                // The records themselves are durable; the long log stays.
                tracing::warn!(
                    "state file compaction failed: cannot write the state file {}: {e}",
                    self.path.display()
                );
            }
            self.table = table;
        }
        Ok(())
    }

    fn append(&mut self, lines: &[u8]) -> std::io::Result<()> {
        let Some(f) = self.file.as_mut() else {
            return Err(std::io::Error::other("state file not open"));
        };
        // One write(2) per batch (O_APPEND), then fdatasync: durable before
        // the replies. On failure cut the file back so no partial line is left
        // for the next batch to be glued to.
        let r = f.write_all(lines).and_then(|()| f.sync_data());
        self.syncs += 1;
        if let Err(e) = r {
            let len = self.len;
            if f.set_len(len).and_then(|()| f.sync_data()).is_err() {
                // The file may end in a partial line: rewrite it next time.
                self.file = None;
            }
            return Err(e);
        }
        self.len += lines.len() as u64;
        Ok(())
    }

    /// Write `table` as a fresh log: temporary file (0600, synced), rename,
    /// directory sync; then open it for appends.
    fn rewrite(&mut self, table: &[DeviceSpec]) -> std::io::Result<()> {
        let body = log_body(table);
        replace_file(&self.path, &body)?;
        self.exists = true;
        // The old handle names the file replaced: never append to it.
        self.file = None;
        self.file = Some(OpenOptions::new().append(true).open(&self.path)?);
        self.len = body.len() as u64;
        self.records = table.len();
        Ok(())
    }
}

/// A whole log holding `table`: the header, then one put per device.
fn log_body(table: &[DeviceSpec]) -> Vec<u8> {
    let mut body = serde_json::to_vec(&Header { loopd_state: 1 }).unwrap_or_default();
    body.push(b'\n');
    for spec in table {
        let Ok(line) = serde_json::to_vec(&SpecRef { put: spec }) else {
            continue;
        };
        body.extend(line);
        body.push(b'\n');
    }
    body
}

/// Whether `path` may be used as a state file: absent, or a regular file that
/// is empty or starts with the header. Reads at most 4 KiB; writes nothing.
fn precheck(path: &Path) -> Result<(), StateError> {
    read_head(path).map(|_| ())
}

/// Open the state file at `path` and read its first 4 KiB, refusing anything
/// that is not a state file: not a regular file, or a start that is not the
/// header (a mistyped path may name a large disk image, so the rest is not read
/// here). `None`: there is no file.
fn read_head(path: &Path) -> Result<Option<(File, std::fs::Metadata, Vec<u8>)>, StateError> {
    let shown = path.display().to_string();
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(StateError::Read(shown, e)),
    };
    let meta = f
        .metadata()
        .map_err(|e| StateError::Read(shown.clone(), e))?;
    if !meta.is_file() {
        return Err(StateError::NotState(shown, "not a regular file"));
    }
    let mut start = Vec::new();
    (&mut f)
        .take(4096)
        .read_to_end(&mut start)
        .map_err(|e| StateError::Read(shown.clone(), e))?;
    if !start.is_empty() && !looks_like_state(&start) {
        return Err(StateError::NotState(
            shown,
            "its first line is not {\"loopd_state\":1}",
        ));
    }
    Ok(Some((f, meta, start)))
}

/// Take the state file's lock (`STATE.lock`, an exclusive `flock`) and write our
/// pid into it. The lock file is removed when the log is dropped (by its holder),
/// so a lock taken on a file that was meanwhile unlinked is retried.
fn lock(path: &Path) -> Result<File, StateError> {
    let lock_path = with_suffix(path, ".lock");
    let shown = path.display().to_string();
    let lock_err = |e: std::io::Error| StateError::Lock(lock_path.display().to_string(), e);
    let mut tries = 0;
    let mut f = loop {
        tries += 1;
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(MODE)
            .open(&lock_path)
            .map_err(lock_err)?;
        match rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut pid = String::new();
                let _ = f.read_to_string(&mut pid);
                let pid = match pid.trim() {
                    "" => "unknown".to_owned(),
                    p => p.to_owned(),
                };
                return Err(StateError::Locked { path: shown, pid });
            }
            Err(e) => return Err(lock_err(e.into())),
        }
        // Still the file at that path (not one its last holder just removed)?
        let ours = f.metadata().map_err(lock_err)?;
        match std::fs::metadata(&lock_path) {
            Ok(m) if m.dev() == ours.dev() && m.ino() == ours.ino() => break f,
            Ok(_) | Err(_) if tries < 10 => continue,
            Ok(_) => {
                return Err(lock_err(std::io::Error::other(
                    "the lock file keeps changing",
                )));
            }
            Err(e) => return Err(lock_err(e)),
        }
    };
    let pid = format!("{}\n", std::process::id());
    let r = f
        .set_len(0)
        .and_then(|()| f.seek(SeekFrom::Start(0)))
        .and_then(|_| f.write_all(pid.as_bytes()));
    if let Err(e) = r {
        // The lock holds without the pid; only the message of a loser suffers.
        tracing::warn!("cannot write the pid into {}: {e}", lock_path.display());
    }
    Ok(f)
}

impl Drop for StateLog {
    fn drop(&mut self) {
        // Still holding the lock: a waiting opener retries on the new file.
        let _ = std::fs::remove_file(with_suffix(&self.path, ".lock"));
    }
}

/// Copy the damaged file's bytes to `aside` (new file, 0600, synced).
fn save_copy(text: &[u8], aside: &Path) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(MODE)
        .open(aside)?;
    f.write_all(text)?;
    f.sync_data()?;
    sync_dir(aside)
}

mod table;
#[cfg(test)]
mod tests;
