//! The execution step every frontend shares: from a planned [`Task`] to its
//! first file operation (or its result), and back to a settled request.
//!
//! A frontend owns its requests' slots; each slot embeds a [`Request`]. For
//! each request it: plans a [`Task`] (buffer from the reactor's pool), calls
//! [`Request::admit`] (the range lock; `false` = parked until a release wakes
//! the reactor), then [`start`] (the inline page-cache paths of buffered mode,
//! else the task's first [`super::task::FileOp`]), feeds completions to
//! [`Task::complete`], calls [`conclude`] on the result, and finally
//! [`Request::settle`] / [`Request::release`]. Nothing here calls back up into a
//! frontend or the reactor. A trim, write-zeroes or cache is clipped at the end
//! of the backing file when it starts ([`super::clip`]).
//!
//! What may block: [`start`] runs only non-blocking calls (`RWF_NOWAIT`), except
//! an inline buffered write on a local-disk filesystem without NOWAIT writes,
//! which may wait for that disk's journal or dirty-page throttling (see the
//! reactor's contract). Files on FUSE or network filesystems never take an
//! inline path.

use super::buffer::Pool;
use super::sync;
use super::task::{Next, Nowait, Task};
use crate::block::{Errno, Op};
use crate::device::Device;
use crate::device::export::Export;
use crate::device::range_lock::{Place, Ticket, Wake};
use crate::device::stats::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

/// A request from its arrival to its release, as the engine tracks it.
#[derive(Default)]
pub struct Request {
    pub task: Option<Task>,
    /// The range held, once [`Request::admit`] got it.
    pub ticket: Option<Ticket>,
    /// Its place in line for the range while parked.
    pub place: Place,
    /// Counted in the export's in-flight requests (see [`Export::enter`]).
    pub entered: bool,
    /// When it arrived (for the latency histogram).
    pub started: Option<Instant>,
}

impl Request {
    /// A request that has entered its export now.
    pub fn arrived(&mut self, task: Option<Task>) {
        self.task = task;
        self.entered = true;
        self.started = Some(Instant::now());
    }

    /// Take the task's range if it needs one and count the operation. `false`:
    /// the range is busy; the request keeps its place in line and `waker` is
    /// woken when a release may let it in (call again then).
    pub fn admit(&mut self, dev: &Device, waker: &Arc<dyn Wake>) -> bool {
        let Some(task) = self.task.as_ref() else {
            return true;
        };
        if task.needs_lock() && self.ticket.is_none() {
            let (start, end, mode) = task.lock_range();
            let got = dev.lock.try_lock(start, end, mode, &mut self.place, waker);
            match got {
                Some(t) => self.ticket = Some(t),
                None => return false,
            }
        }
        dev.stats.op(task.op(), u64::from(task.len()));
        if task.needs_lock() && !is_aligned(dev, task) {
            dev.stats.unaligned();
        }
        true
    }

    /// Done with the file: release the range, leave the export's in-flight
    /// count, record the latency. Idempotent.
    pub fn settle(&mut self, dev: &Device, export: &Export) {
        if let Some(t) = self.ticket.take() {
            dev.lock.unlock(t);
        }
        if std::mem::take(&mut self.entered) {
            export.leave();
        }
        if let Some(t) = self.started.take() {
            let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
            dev.stats.latency.record(ns);
        }
    }

    /// Free the request: settle it, give up its place in line, return its
    /// buffers to `pool`. Returns the task it had, emptied of buffers.
    pub fn release(&mut self, dev: &Device, export: &Export, pool: &mut Pool) -> Option<Task> {
        self.settle(dev, export);
        dev.lock.abandon(&mut self.place);
        let mut t = self.task.take()?;
        t.recycle(pool);
        Some(t)
    }
}

/// Whether a request's offset and length are multiples of the block size (a
/// power of two, so one test of both).
fn is_aligned(dev: &Device, task: &Task) -> bool {
    let bs = u64::from(dev.block_size.max(1));
    (task.offset() | u64::from(task.len())) % bs == 0
}

/// Run an admitted task's inline paths, else yield its first file operation.
///
/// Buffered reads are tried from the page cache with `RWF_NOWAIT` (seed 004);
/// small whole-page buffered writes are copied in inline. Either counts its
/// [`Path`]; otherwise the task's own path is counted.
pub fn start(dev: &Device, task: &mut Task, pool: &mut Pool) -> Next {
    if matches!(task.op(), Op::Trim | Op::WriteZeroes | Op::Cache) {
        // Under the range lock: a write that grew the file into this range
        // has published its growth (see `conclude`).
        let size = dev.file_size.load(Ordering::Relaxed);
        task.clip_to_file(size);
        if task.op() == Op::WriteZeroes && task.passes(size) {
            // Zeroing past the end loopd knows of: another writer
            // (`--shared`) may have grown the file. Ask the file first, through
            // the engine (a network filesystem may take its time to answer).
            return task.start_sized(pool);
        }
        return task.start();
    }
    if task.op().has_data() {
        if task.op() == Op::Read
            && task.path() == Path::Buffered
            && dev.inline_reads
            && dev.local_fs
        {
            // Not on FUSE or network files: even a NOWAIT read can block there
            // (FUSE readahead waits for room in the server's queue).
            let len32 = task.len();
            let len = len32 as usize;
            let foff = dev.file_offset(task.offset());
            let buf = &mut task.payload_mut()[..len];
            match dev.backend.read_cached(buf, foff) {
                Some(n) if n == len => {
                    dev.stats.path(Path::InlineCached);
                    return Next::Done(Ok(len32));
                }
                Some(n) => task.set_progress(n),
                None => {}
            }
        }
        if dev.inline_writes && task.inline_write_ok() {
            // A page-cache copy of microseconds: inline, it saves the ring's
            // hand-over to a worker thread (two wake-ups). With RWF_NOWAIT it
            // cannot block. A filesystem without NOWAIT buffered writes (ext4)
            // gets a blocking copy only if it is on a local disk; a FUSE or
            // network file's write always goes through the ring, since its
            // server may never answer.
            let nowait = dev.nowait_writes.load(Ordering::Relaxed);
            let tried = if nowait {
                task.write_nowait(&dev.backend)
            } else {
                Nowait::Unsupported
            };
            let done = match tried {
                Nowait::Done => Some(Ok(0)),
                Nowait::Unsupported if dev.local_fs => Some(sync::drive(dev, task, pool)),
                Nowait::Unsupported | Nowait::Again => None,
            };
            if nowait && tried == Nowait::Unsupported {
                dev.nowait_writes.store(false, Ordering::Relaxed);
            }
            if let Some(r) = done {
                dev.stats.path(Path::InlineWritten);
                return Next::Done(r);
            }
        }
        dev.stats.path(task.path());
    }
    task.start()
}

/// A task finished with `r`: publish a write that grew the file, count an
/// error and log the first backing-file error of each kind (later ones are only
/// counted, so a failing disk cannot flood the log).
pub fn conclude(dev: &Device, task: Option<&Task>, r: &Result<u32, Errno>) {
    if let Some(size) = task.and_then(Task::size_seen) {
        dev.grew_to(size);
    }
    match (r, task.and_then(Task::grows_to)) {
        (Ok(_), Some(end)) => dev.grew_to(end),
        (Err(e), _) => log_backing_error(dev, *e, task),
        _ => {}
    }
}

fn log_backing_error(dev: &Device, e: Errno, task: Option<&Task>) {
    let bit = 1u64 << e.index();
    if dev.stats.logged_errors.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
        let what = task.map_or(String::new(), |t| {
            format!(" {:?} at offset {} length {}:", t.op(), t.offset(), t.len())
        });
        tracing::warn!(
            "device {:?} ({}):{what} backing file error {}; further {} errors are counted, not logged",
            dev.name,
            crate::text::quoted_path(&dev.path),
            e.name(),
            e.name(),
        );
    }
}
