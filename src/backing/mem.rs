//! A test-only backend (cargo feature `test-backend`): a device's bytes in
//! memory, served by a thread of its own that delivers every result through
//! the reactor's [`Completions`] — the eventfd path a library with its own
//! I/O threads (librbd) takes. It exists to prove the backend seam: the
//! engine oracle and the end-to-end NBD and ublk suites run over it.
//!
//! Selected, in a binary built with the feature (release builds users get do
//! not have it):
//! - by an image whose file name is `mem:SIZE` (K/M/G suffixes, powers of
//!   1024): `SIZE` bytes of zeros, no file at all;
//! - for every image, by the environment variable `LOOPD_TEST_BACKEND=mem`
//!   (how the end-to-end suites run over it): the memory is seeded from the
//!   image file's data at open (a missing file with `--create`: zeros), and
//!   the file becomes a *mirror*: every write, trim and write-zeroes is
//!   applied to the memory and then written through to the file by the
//!   worker (a failure there fails the request), so a suite that checks the
//!   file after writing through loopd still can. Reads are served from the
//!   memory only, never from the file.
//!
//! Like a file, the data grows when written past its end (up to
//! [`MAX_SIZE`]) and reads past it come back short (the engine zero-fills).
//! What has no meaning here: direct I/O (no cache to avoid; requests are
//! never bounced), inline page-cache paths and splice, an allocation map
//! (everything is data), image locks and file identity, a kernel loop device
//! (the kernel needs a file), page-cache metrics. A reconfiguration keeps the
//! same memory; a restart of the daemon starts from the file again.
//!
//! Ownership: the store is shared (`Arc`) by the device's configurations and
//! the worker; an operation posted to the worker carries raw pointers into
//! the request's buffers, which the request keeps until the result is in the
//! reactor's [`Completions`] (the [`Storage::post`] contract). The
//! store's lock is held for one operation (its copy and its write-through).

use super::storage::{Caps, Completions, IoOp, Storage};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Mutex, MutexGuard};

/// Its capabilities: none beyond running operations.
pub const CAPS: Caps = Caps {
    direct: false,
    inline_cached: false,
    splice: false,
    allocation_map: false,
};

/// The file name prefix that selects this backend.
pub const PREFIX: &str = "mem:";

/// The environment variable that serves every image from memory.
pub const ENV: &str = "LOOPD_TEST_BACKEND";

/// Largest memory device (zero pages are allocated lazily).
pub const MAX_SIZE: u64 = 64 << 30;

/// The bytes, and the file they are written through to (if any).
struct Store {
    bytes: Mutex<Vec<u8>>,
    mirror: Option<File>,
}

/// A memory device's bytes and its worker. Cloning shares both.
#[derive(Clone)]
pub struct MemBackend {
    store: Arc<Store>,
    tx: Sender<Job>,
}

impl std::fmt::Debug for MemBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Not the bytes: they may be gigabytes.
        f.debug_struct("MemBackend")
            .field("len", &self.len())
            .field("mirrored", &self.store.mirror.is_some())
            .finish()
    }
}

/// An operation on its way to the worker.
struct Job {
    op: IoOp,
    user_data: u64,
    done: Arc<Completions>,
}

// SAFETY: a job's pointers name memory of a request that keeps it, untouched,
// until the worker has delivered the result (the `post` contract); the worker
// is the only thread that uses them meanwhile.
unsafe impl Send for Job {}

/// The memory backend an image asks for, if it asks for one (see the module
/// documentation). `create`: the size of a missing image.
pub fn select(path: &Path, create: Option<u64>) -> Option<Result<MemBackend, String>> {
    if let Some(s) = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix(PREFIX))
    {
        return Some(match crate::size::parse_size(s) {
            Ok(n) if n > 0 && n <= MAX_SIZE => {
                MemBackend::new(vec_of(n), None).map_err(|e| e.to_string())
            }
            Ok(n) => Err(format!("a memory device of {n} bytes (1 to {MAX_SIZE})")),
            Err(e) => Err(format!("{s:?}: {e}")),
        });
    }
    if std::env::var_os(ENV).is_none_or(|v| v != "mem") {
        return None;
    }
    Some(mirrored(path, create))
}

/// `n` bytes of zeros (allocated lazily by the system).
fn vec_of(n: u64) -> Vec<u8> {
    vec![0u8; as_index(n)]
}

/// An offset inside the store (at most [`MAX_SIZE`], which fits in `usize`).
fn as_index(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Memory holding the image file's data, the file its mirror (a missing
/// file is created, of `create` bytes). Only the file's data extents are
/// read, so a sparse image costs memory only where it holds data.
fn mirrored(path: &Path, create: Option<u64>) -> Result<MemBackend, String> {
    let why = |e: std::io::Error| format!("{ENV}=mem: {}: {e}", path.display());
    if let (Some(n), false) = (create, path.exists()) {
        let f = File::create_new(path).map_err(why)?;
        f.set_len(n).map_err(why)?;
    }
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
    {
        Ok(f) => f,
        // Write-protected (a read-only mount, mode 0444): no mirroring.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EROFS | libc::EACCES | libc::EPERM)
            ) =>
        {
            File::open(path).map_err(why)?
        }
        Err(e) => return Err(why(e)),
    };
    let len = file.metadata().map_err(why)?.len();
    if len > MAX_SIZE {
        return Err(format!(
            "{ENV}=mem: {}: {len} bytes (at most {MAX_SIZE})",
            path.display()
        ));
    }
    let mut bytes = vec_of(len);
    let mut pos = 0u64;
    // Bounded: every round moves `pos` forward, to at most `len`.
    while pos < len {
        let data = match rustix::fs::seek(&file, rustix::fs::SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(e) if e == rustix::io::Errno::NXIO => break,
            Err(e) => return Err(why(e.into())),
        };
        let hole = rustix::fs::seek(&file, rustix::fs::SeekFrom::Hole(data))
            .map_err(|e| why(e.into()))?
            .min(len);
        if data >= hole {
            break;
        }
        file.read_exact_at(&mut bytes[as_index(data)..as_index(hole)], data)
            .map_err(why)?;
        pos = hole;
    }
    MemBackend::new(bytes, Some(file)).map_err(why)
}

impl MemBackend {
    /// `bytes`, written through to `mirror`, and a worker thread that serves
    /// them.
    fn new(bytes: Vec<u8>, mirror: Option<File>) -> std::io::Result<MemBackend> {
        let store = Arc::new(Store {
            bytes: Mutex::new(bytes),
            mirror,
        });
        let (tx, rx) = channel::<Job>();
        // Weak: the store (and the mirror's descriptor) goes with the last
        // backend, at once, not when this thread next wakes.
        let mine = Arc::downgrade(&store);
        std::thread::Builder::new()
            .name("loopd-mem".into())
            .spawn(move || {
                // Ends when every sender (every clone of the backend) is gone.
                while let Ok(j) = rx.recv() {
                    let res = match mine.upgrade() {
                        // SAFETY: the job's pointers are valid until
                        // delivered (the `post` contract, carried by `Job`).
                        Some(store) => unsafe { store.run(j.op) },
                        None => -libc::EIO,
                    };
                    j.done.complete(j.user_data, res);
                }
            })?;
        Ok(MemBackend { store, tx })
    }

    /// Bytes held now.
    pub fn len(&self) -> u64 {
        self.store.lock().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Storage for MemBackend {
    fn caps(&self) -> Caps {
        CAPS
    }

    /// Queue `op` for the worker.
    ///
    /// # Safety
    /// As [`Storage::post`].
    unsafe fn post(&self, op: IoOp, user_data: u64, done: &Arc<Completions>) {
        let job = Job {
            op,
            user_data,
            done: Arc::clone(done),
        };
        if let Err(e) = self.tx.send(job) {
            // The worker is gone (it cannot be while a sender lives): the op
            // never ran; say so.
            e.0.done.complete(user_data, -libc::EIO);
        }
    }

    /// Run `op` on the calling thread.
    ///
    /// # Safety
    /// As [`Storage::run`].
    unsafe fn run(&self, op: IoOp) -> i32 {
        // SAFETY: by this function's contract.
        unsafe { self.store.run(op) }
    }

    fn current_len(&self) -> u64 {
        self.len()
    }

    fn sync_data(&self) -> std::io::Result<()> {
        match &self.store.mirror {
            Some(f) => f.sync_data(),
            None => Ok(()),
        }
    }
}

/// An io_uring-style result of a byte count.
fn res_of(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

impl Store {
    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        match self.bytes.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Write `bytes[a..b]` through to the mirror, if there is one.
    fn mirror(&self, bytes: &[u8], a: usize, b: usize) -> i32 {
        match &self.mirror {
            Some(f) => match f.write_all_at(&bytes[a..b], a as u64) {
                Ok(()) => 0,
                Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
            },
            None => 0,
        }
    }

    /// Apply a punch or zero of `bytes[a..b]` to the mirror the way a file
    /// backend would (`fallocate` with the same mode), else by writing the
    /// zeros.
    fn mirror_allocate(&self, bytes: &[u8], mode: i32, a: usize, b: usize) -> i32 {
        let Some(f) = &self.mirror else {
            return 0;
        };
        if a == b {
            return 0;
        }
        let flags = rustix::fs::FallocateFlags::from_bits_retain(mode as u32);
        match rustix::fs::fallocate(f, flags, a as u64, (b - a) as u64) {
            Ok(()) => 0,
            Err(e) if e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::INVAL => {
                self.mirror(bytes, a, b)
            }
            Err(e) => -e.raw_os_error(),
        }
    }

    /// # Safety
    /// As [`Storage::run`].
    unsafe fn run(&self, op: IoOp) -> i32 {
        let mut bytes = self.lock();
        match op {
            IoOp::Read { buf, len, off } => {
                let a = as_index(off.min(bytes.len() as u64));
                let n = (bytes.len() - a).min(len as usize);
                // SAFETY: the op's buffer holds `len` >= n bytes, ours to write
                // (the caller's contract); the store's range is in bounds.
                let dst = unsafe { std::slice::from_raw_parts_mut(buf, n) };
                dst.copy_from_slice(&bytes[a..a + n]);
                res_of(n)
            }
            IoOp::Write { buf, len, off, .. } => {
                let Some(end) = off.checked_add(u64::from(len)).filter(|&e| e <= MAX_SIZE) else {
                    return -libc::ENOSPC;
                };
                let (a, b) = (as_index(off), as_index(end));
                if b > bytes.len() {
                    bytes.resize(b, 0);
                }
                // SAFETY: the op's buffer holds `len` = b - a bytes, only read.
                let src = unsafe { std::slice::from_raw_parts(buf, b - a) };
                bytes[a..b].copy_from_slice(src);
                match self.mirror(&bytes, a, b) {
                    0 => res_of(b - a),
                    e => e,
                }
            }
            IoOp::Allocate { mode, off, len } => {
                // Punch or zero: either way the range reads as zeros, and
                // (KEEP_SIZE) the data does not grow.
                let a = as_index(off.min(bytes.len() as u64));
                let b = as_index(off.saturating_add(len).min(bytes.len() as u64));
                bytes[a..b].fill(0);
                self.mirror_allocate(&bytes, mode, a, b)
            }
            IoOp::Flush => match &self.mirror {
                Some(f) => match f.sync_data() {
                    Ok(()) => 0,
                    Err(e) => -e.raw_os_error().unwrap_or(libc::EIO),
                },
                None => 0,
            },
            IoOp::WillNeed { .. } => 0,
            // A ring's registered buffers: not memory this backend can reach.
            IoOp::ReadFixed { .. } | IoOp::WriteFixed { .. } | IoOp::ZeroFixed { .. } => {
                -libc::EOPNOTSUPP
            }
            IoOp::Size { buf } => {
                // SAFETY: `buf` points at a `libc::statx` the caller owns (its
                // contract); only two plain integer fields are written.
                unsafe {
                    (*buf).stx_size = bytes.len() as u64;
                    (*buf).stx_mask |= libc::STATX_SIZE;
                }
                0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(m: &MemBackend, data: &[u8], off: u64) -> i32 {
        let op = IoOp::Write {
            buf: data.as_ptr(),
            len: u32::try_from(data.len()).unwrap_or(0),
            off,
            dsync: false,
            plain: false,
        };
        // SAFETY: `data` outlives the call and is only read.
        unsafe { m.run(op) }
    }

    fn read(m: &MemBackend, len: usize, off: u64) -> (i32, Vec<u8>) {
        let mut buf = vec![0xeeu8; len];
        let op = IoOp::Read {
            buf: buf.as_mut_ptr(),
            len: u32::try_from(len).unwrap_or(0),
            off,
        };
        // SAFETY: `buf` outlives the call; nothing else touches it.
        let n = unsafe { m.run(op) };
        (n, buf)
    }

    #[test]
    fn a_posted_operation_completes_through_the_eventfd_list() {
        let m = MemBackend::new(vec_of(8192), None).unwrap();
        let done = Arc::new(Completions::new().unwrap());
        let data = [7u8; 512];
        let op = IoOp::Write {
            buf: data.as_ptr(),
            len: 512,
            off: 4096,
            dsync: false,
            plain: false,
        };
        // SAFETY: `data` lives until the result is drained below.
        unsafe { m.post(op, 42, &done) };
        let mut got = Vec::new();
        for _ in 0..500 {
            let mut b = [0u8; 8];
            // A blocking read: returns once the worker has written the eventfd.
            rustix::io::read(done.event_fd(), &mut b).unwrap();
            done.drain(|u, r| got.push((u, r)));
            if !got.is_empty() {
                break;
            }
        }
        assert_eq!(got, vec![(42, 512)]);
        assert_eq!(read(&m, 512, 4096), (512, vec![7u8; 512]));
    }

    #[test]
    fn reads_past_the_end_are_short_and_writes_there_grow_it() {
        let m = MemBackend::new(vec_of(1000), None).unwrap();
        assert_eq!(read(&m, 100, 950).0, 50);
        assert_eq!(read(&m, 100, 5000).0, 0);
        assert_eq!(write(&m, &[1u8; 100], 2000), 100);
        assert_eq!(m.len(), 2100);
        let (n, got) = read(&m, 200, 1950);
        assert_eq!(n, 150);
        assert_eq!(&got[..50], &[0u8; 50]);
        assert_eq!(&got[50..150], &[1u8; 100]);
        assert_eq!(write(&m, &[1u8; 1], MAX_SIZE), -libc::ENOSPC);
    }

    #[test]
    fn a_mirrored_image_is_seeded_from_the_file_and_written_through() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let mut seed = vec![0u8; 3 << 20];
        seed[..4096].fill(9);
        seed[(2 << 20)..(2 << 20) + 10].fill(5);
        std::fs::write(&path, &seed).unwrap();
        let m = mirrored(&path, None).unwrap();
        assert_eq!(m.len(), 3 << 20);
        assert_eq!(read(&m, 4096, 0).1, vec![9u8; 4096]);
        assert_eq!(read(&m, 10, 2 << 20).1, vec![5u8; 10]);
        assert_eq!(write(&m, &[3u8; 4], 100), 4);
        let trim = IoOp::Allocate {
            mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off: 2 << 20,
            len: 1 << 30,
        };
        // SAFETY: an allocation names no memory.
        assert_eq!(unsafe { m.run(trim) }, 0);
        let file = std::fs::read(&path).unwrap();
        assert_eq!(file.len(), 3 << 20, "a trim keeps the size");
        assert_eq!(&file[100..104], &[3u8; 4]);
        assert_eq!(&file[(2 << 20)..(2 << 20) + 10], &[0u8; 10]);
        assert_eq!(read(&m, 10, 2 << 20).1, vec![0u8; 10]);
    }
}
