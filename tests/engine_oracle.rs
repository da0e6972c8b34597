//! The io_uring engine against the plain-syscall engine against an in-memory model.
//!
//! Random sequences of requests (reads, writes, trims, write-zeroes, flushes, FUA
//! writes; aligned and unaligned) are planned with `Task::plan` and run
//! (a) through io_uring (`ops::sqe`) on one copy of a file, (b) through
//! `sync::drive` on another copy, and (c) on a `Vec<u8>`. Every read must return the
//! same bytes from all three, and at the end the files must match the model.
//!
//! With the feature `test-backend`, the same sequences also run over the memory
//! backend (`mem:SIZE`): (a) posted to its worker thread, each result taken
//! from the eventfd-signalled completion list a reactor drains, (b) through
//! `sync::drive`, (c) the model.
//!
//! The temporary files live under `$TMPDIR` (or /tmp), which must be a filesystem
//! that supports `O_DIRECT` and hole punching (ext4, xfs, btrfs; not tmpfs) for the
//! direct-I/O cases.

use io_uring::IoUring;
#[cfg(feature = "test-backend")]
use loopd::backing::Completions;
use loopd::device::{CacheMode, Device, DeviceParams};
use loopd::engine::buffer::Pool;
use loopd::engine::task::{Next, Task};
use loopd::engine::{ops, sync};
use loopd::frontend::nbd::proto::{CMD_FLAG_FAST_ZERO, CMD_FLAG_FUA, CMD_FLAG_NO_HOLE};
use loopd::frontend::nbd::wire::{self, Command, NbdErrno};
use proptest::prelude::*;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Largest request length generated.
const MAX_LEN: u64 = 256 << 10;

/// One export configuration to test.
#[derive(Debug, Clone, Copy)]
struct Config {
    cache: CacheMode,
    block_size: u32,
    /// Length of the backing file before the test.
    file_len: u64,
    /// Start of the window in the file.
    offset: u64,
    size_limit: Option<u64>,
    /// Where the files go: `None` for the default temporary directory.
    dir: Option<&'static str>,
}

impl Config {
    /// The export size `Device::open` must compute.
    fn export_size(&self) -> u64 {
        let bs = u64::from(self.block_size);
        self.size_limit
            .unwrap_or_else(|| (self.file_len - self.offset).div_ceil(bs) * bs)
    }
}

/// A request as generated: positions are mapped into the export at run time.
#[derive(Debug, Clone, Copy)]
struct GenOp {
    kind: u8,
    /// 0: aligned to the block size; 1: aligned to 512; 2: anywhere; 3: up to the end.
    placement: u8,
    a: u64,
    b: u64,
    fua: bool,
    no_hole: bool,
    fast_zero: bool,
    /// Fill pattern of a write.
    seed: u64,
    /// Bytes a buffered read finds inline (in the page cache) before going to the ring.
    inline: u64,
}

fn arb_op() -> impl Strategy<Value = GenOp> {
    (
        prop_oneof![8 => Just(0u8), 8 => Just(1u8), 3 => Just(2u8), 3 => Just(3u8), 1 => Just(4u8), 1 => Just(5u8)],
        0u8..4,
        any::<u64>(),
        any::<u64>(),
        prop::bool::weighted(0.2),
        any::<bool>(),
        prop::bool::weighted(0.3),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(|(kind, placement, a, b, fua, no_hole, fast_zero, seed, inline)| GenOp {
            kind,
            placement,
            a,
            b,
            fua,
            no_hole,
            fast_zero,
            seed,
            inline,
        })
}

/// A concrete request against an export of `size` bytes.
#[derive(Debug, Clone, Copy)]
struct Op {
    cmd: Command,
    flags: u16,
    offset: u64,
    len: u32,
    seed: u64,
    inline: u64,
}

fn place(g: &GenOp, size: u64, bs: u64) -> (u64, u64) {
    match g.placement {
        0 | 1 => {
            let unit = if g.placement == 0 { bs } else { 512 };
            let units = size / unit;
            let off = (g.a % units) * unit;
            let max_units = ((size - off) / unit).min(MAX_LEN / unit);
            (off, (1 + g.b % max_units) * unit)
        }
        2 => {
            let off = g.a % size;
            (off, 1 + g.b % (size - off).min(MAX_LEN))
        }
        _ => {
            let len = 1 + g.a % size.min(MAX_LEN);
            (size - len, len)
        }
    }
}

fn concretize(g: &GenOp, size: u64, bs: u64) -> Op {
    let (offset, len) = place(g, size, bs);
    assert!((1..=MAX_LEN).contains(&len) && offset + len <= size);
    let fua = if g.fua { CMD_FLAG_FUA } else { 0 };
    let (cmd, flags) = match g.kind {
        0 => (Command::Read, 0),
        1 => (Command::Write, fua),
        2 => (Command::Trim, fua),
        3 => {
            let no_hole = if g.no_hole { CMD_FLAG_NO_HOLE } else { 0 };
            let fast = if g.fast_zero { CMD_FLAG_FAST_ZERO } else { 0 };
            (Command::WriteZeroes, fua | no_hole | fast)
        }
        4 => (Command::Flush, 0),
        _ => (Command::Cache, 0),
    };
    Op {
        cmd,
        flags,
        offset,
        len: u32::try_from(len).unwrap(),
        seed: g.seed,
        inline: g.inline,
    }
}

/// Deterministic bytes from a seed (xorshift64*).
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed | 1;
    for chunk in buf.chunks_mut(8) {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}

/// How a task's file operations are run.
enum Engine {
    Uring(Box<IoUring>),
    Sync,
    /// Posted to a threaded backend; results from this completion list.
    #[cfg(feature = "test-backend")]
    Posted(std::sync::Arc<Completions>),
}

/// Run a task over a threaded backend the way a reactor does: post each
/// operation, wait on the eventfd, drain the results.
#[cfg(feature = "test-backend")]
fn run_posted(
    done: &std::sync::Arc<Completions>,
    dev: &Device,
    task: &mut Task,
    pool: &mut Pool,
) -> Result<u32, NbdErrno> {
    let mut next = task.start();
    loop {
        match next {
            Next::Done(r) => return r,
            Next::Submit(fop) => {
                assert!(ops::sqe(dev.backend(), fop).is_none(), "memory is posted");
                // SAFETY: `task` stays borrowed here, untouched, until its
                // result has been drained below.
                unsafe { ops::post(dev.backend(), fop, 0x10ad, done) };
                let mut got = None;
                for _ in 0..1000 {
                    let mut b = [0u8; 8];
                    let efd = done.event_fd();
                    let mut pfd = [rustix::event::PollFd::new(
                        &efd,
                        rustix::event::PollFlags::IN,
                    )];
                    let timeout = rustix::event::Timespec {
                        tv_sec: 5,
                        tv_nsec: 0,
                    };
                    rustix::event::poll(&mut pfd, Some(&timeout)).expect("poll the eventfd");
                    if !pfd[0].revents().is_empty() {
                        rustix::io::read(efd, &mut b).expect("read the eventfd");
                    }
                    done.drain(|u, res| {
                        assert_eq!(u, 0x10ad);
                        assert!(got.replace(res).is_none(), "one result per operation");
                    });
                    if got.is_some() {
                        break;
                    }
                }
                next = task.complete(got.expect("the backend answered"), pool);
            }
        }
    }
}

/// Run one planned-and-filled task to completion on `engine`.
fn run_task(
    engine: &mut Engine,
    dev: &Device,
    task: &mut Task,
    pool: &mut Pool,
    op: &Op,
) -> Result<u32, NbdErrno> {
    let ring = match engine {
        Engine::Sync => return sync::drive(dev, task, pool),
        #[cfg(feature = "test-backend")]
        Engine::Posted(done) => return run_posted(done, dev, task, pool),
        Engine::Uring(ring) => ring,
    };
    // Like the reactor: a buffered read first takes what it can synchronously
    // (here: a prefix of a generated length), then goes to the ring for the rest.
    if op.cmd == Command::Read && !dev.direct() {
        let len = task.len() as usize;
        let want = usize::try_from(op.inline % (len as u64 + 1)).unwrap();
        let foff = dev.file_offset(task.offset());
        let file = dev.backend().as_file().expect("a file device");
        let n = file
            .plain()
            .read_at(&mut task.payload_mut()[..want], foff)
            .unwrap();
        if n == len {
            return Ok(task.len());
        }
        task.set_progress(n);
    }
    let mut next = task.start();
    loop {
        match next {
            Next::Done(r) => return r,
            Next::Submit(fop) => {
                let entry = ops::sqe(dev.backend(), fop)
                    .expect("a file runs on the ring")
                    .user_data(0x10ad);
                // SAFETY: the entry points into buffers owned by `task`, which is
                // neither moved nor touched until the completion below is reaped.
                unsafe {
                    ring.submission()
                        .push(&entry)
                        .expect("submission queue full")
                };
                ring.submit_and_wait(1).expect("io_uring_enter");
                let cqe = ring
                    .completion()
                    .next()
                    .expect("a completion after waiting for one");
                assert_eq!(cqe.user_data(), 0x10ad);
                next = task.complete(cqe.result(), pool);
            }
        }
    }
}

/// One device, the engine that drives it and its buffer pool.
struct Side {
    dev: Device,
    engine: Engine,
    pool: Pool,
}

impl Side {
    /// Run `op`; returns the read data for reads. A write-zeroes with `FAST_ZERO`
    /// may fail with `NotSup` (where the filesystem cannot zero a range cheaply).
    fn run(&mut self, op: &Op) -> Result<Vec<u8>, NbdErrno> {
        let block_op = op
            .cmd
            .op()
            .expect("a generated command is a block operation");
        let mut task = Task::plan(
            &self.dev,
            block_op,
            wire::req_flags(op.flags),
            op.offset,
            op.len,
            &mut self.pool,
        );
        if op.cmd == Command::Write {
            fill(task.payload_mut(), op.seed);
        }
        let r = run_task(&mut self.engine, &self.dev, &mut task, &mut self.pool, op);
        let want = if op.cmd == Command::Read { op.len } else { 0 };
        if op.flags & CMD_FLAG_FAST_ZERO != 0 && r == Err(NbdErrno::NotSup) {
            task.recycle(&mut self.pool);
            return Err(NbdErrno::NotSup);
        }
        assert_eq!(r, Ok(want), "{op:?}");
        if let Some(end) = task.grows_to() {
            self.dev.grew_to(end);
        }
        let data = if op.cmd == Command::Read {
            task.read_data().to_vec()
        } else {
            Vec::new()
        };
        task.recycle(&mut self.pool);
        Ok(data)
    }
}

fn open(cfg: &Config, path: &Path) -> Device {
    let p = DeviceParams {
        path: path.to_path_buf(),
        name: String::new(),
        offset: cfg.offset,
        size_limit: cfg.size_limit,
        block_size: Some(cfg.block_size),
        cache: cfg.cache,
        ..DeviceParams::default()
    };
    let dev = Device::open(&p).unwrap_or_else(|e| panic!("open {cfg:?}: {e:#}"));
    assert_eq!(
        dev.direct(),
        cfg.cache == CacheMode::Direct,
        "{}",
        dev.cache_note()
    );
    assert_eq!(dev.size(), cfg.export_size());
    dev
}

/// Apply `op` to the model (indexed by file offset).
fn apply_to_model(model: &mut [u8], window: u64, op: &Op) {
    let start = usize::try_from(window + op.offset).unwrap();
    let range = start..start + op.len as usize;
    match op.cmd {
        Command::Write => fill(&mut model[range], op.seed),
        // loopd punches holes (trim, and write-zeroes without NO_HOLE) or zeroes
        // the range: either way it reads back as zeros.
        Command::Trim | Command::WriteZeroes => model[range].fill(0),
        _ => {}
    }
}

fn check_file_matches_model(path: &Path, model: &[u8], what: &str) -> Vec<u8> {
    let file = std::fs::read(path).unwrap();
    let n = file.len().max(model.len());
    for i in 0..n {
        let f = file.get(i).copied().unwrap_or(0);
        let m = model.get(i).copied().unwrap_or(0);
        assert_eq!(
            f,
            m,
            "{what}: byte {i} differs from the model (file is {} bytes)",
            file.len()
        );
    }
    file
}

fn run_case(cfg: &Config, file_seed: u64, ops: &[GenOp]) {
    let dir = match cfg.dir {
        None => tempfile::tempdir().unwrap(),
        Some(d) => tempfile::tempdir_in(d).unwrap(),
    };
    let (pa, pb) = (dir.path().join("a.img"), dir.path().join("b.img"));
    let mut initial = vec![0u8; usize::try_from(cfg.file_len).unwrap()];
    fill(&mut initial, file_seed);
    std::fs::write(&pa, &initial).unwrap();
    std::fs::write(&pb, &initial).unwrap();

    let mut a = Side {
        dev: open(cfg, &pa),
        engine: Engine::Uring(Box::new(IoUring::new(8).unwrap())),
        pool: Pool::default(),
    };
    let mut b = Side {
        dev: open(cfg, &pb),
        engine: Engine::Sync,
        pool: Pool::default(),
    };
    let size = a.dev.size();
    let mut model = initial;
    model.resize(
        model.len().max(usize::try_from(cfg.offset + size).unwrap()),
        0,
    );

    for (i, g) in ops.iter().enumerate() {
        let op = concretize(g, size, u64::from(cfg.block_size));
        let ra = a.run(&op);
        let rb = b.run(&op);
        assert_eq!(
            ra.is_ok(),
            rb.is_ok(),
            "op {i} {op:?}: the engines disagree: {ra:?} / {rb:?}"
        );
        let (Ok(ra), Ok(rb)) = (ra, rb) else { continue };
        apply_to_model(&mut model, cfg.offset, &op);
        if op.cmd == Command::Read {
            let start = usize::try_from(cfg.offset + op.offset).unwrap();
            let want = &model[start..start + op.len as usize];
            assert!(
                ra == want,
                "op {i} {op:?}: io_uring read differs from the model"
            );
            assert!(
                rb == want,
                "op {i} {op:?}: sync read differs from the model"
            );
        }
    }

    let fa = check_file_matches_model(&pa, &model, "io_uring file");
    let fb = check_file_matches_model(&pb, &model, "sync file");
    assert_eq!(
        fa.len(),
        fb.len(),
        "the two engines left files of different lengths"
    );
    for side in [&a, &b] {
        let published = side.dev.file_size();
        assert!(
            published <= fa.len() as u64,
            "file_size {published} is past the end of the file ({})",
            fa.len()
        );
    }
}

/// The memory backend: one device's operations posted to its worker (the
/// reactor's path), another's run by `sync::drive`, both against the model;
/// at the end each device, read whole through its engine, equals the model.
#[cfg(feature = "test-backend")]
fn run_mem_case(size: u64, block_size: u32, ops: &[GenOp]) {
    let open = |name: &str| {
        let p = DeviceParams {
            path: format!("mem:{size}").into(),
            name: name.into(),
            block_size: Some(block_size),
            ..DeviceParams::default()
        };
        let dev = Device::open(&p).unwrap_or_else(|e| panic!("open mem:{size}: {e:#}"));
        assert!(!dev.direct(), "memory has no direct I/O");
        assert_eq!(dev.size(), size);
        dev
    };
    let done = std::sync::Arc::new(Completions::new().expect("an eventfd"));
    let mut a = Side {
        dev: open("a"),
        engine: Engine::Posted(done),
        pool: Pool::default(),
    };
    let mut b = Side {
        dev: open("b"),
        engine: Engine::Sync,
        pool: Pool::default(),
    };
    let mut model = vec![0u8; usize::try_from(size).unwrap()];
    for (i, g) in ops.iter().enumerate() {
        let op = concretize(g, size, u64::from(block_size));
        let ra = a.run(&op);
        let rb = b.run(&op);
        assert_eq!(ra, rb, "op {i} {op:?}: the engines disagree");
        let Ok(ra) = ra else { continue };
        apply_to_model(&mut model, 0, &op);
        if op.cmd == Command::Read {
            let start = usize::try_from(op.offset).unwrap();
            assert!(
                ra == model[start..start + op.len as usize],
                "op {i} {op:?}: read differs from the model"
            );
        }
    }
    for side in [&mut a, &mut b] {
        let mut at = 0;
        while at < size {
            let len = (size - at).min(MAX_LEN);
            let read = Op {
                cmd: Command::Read,
                flags: 0,
                offset: at,
                len: u32::try_from(len).unwrap(),
                seed: 0,
                inline: 0,
            };
            let got = side.run(&read).expect("a read of the whole device");
            let at_us = usize::try_from(at).unwrap();
            assert!(
                got == model[at_us..at_us + got.len()],
                "bytes at {at} differ from the model at the end"
            );
            at += len;
        }
    }
}

fn cases() -> ProptestConfig {
    ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn ops() -> impl Strategy<Value = Vec<GenOp>> {
    proptest::collection::vec(arb_op(), 1..32)
}

proptest! {
    #![proptest_config(cases())]

    #[test]
    fn buffered_ragged_file_engines_agree_with_model(seed in any::<u64>(), ops in ops()) {
        // 100_000 bytes: the export rounds up to 100_352; the tail reads as zeros.
        let cfg = Config { cache: CacheMode::Buffered, block_size: 512, file_len: 100_000, offset: 0, size_limit: None, dir: None };
        run_case(&cfg, seed, &ops);
    }

    #[test]
    fn buffered_window_past_end_of_file_engines_agree_with_model(seed in any::<u64>(), ops in ops()) {
        // Window [4096, 4096 + 64 KiB) over a 40_000-byte file: writes extend it.
        let cfg = Config {
            cache: CacheMode::Buffered,
            block_size: 4096,
            file_len: 40_000,
            offset: 4096,
            size_limit: Some(64 << 10),
            dir: None,
        };
        run_case(&cfg, seed, &ops);
    }

    #[test]
    fn direct_512_ragged_file_engines_agree_with_model(seed in any::<u64>(), ops in ops()) {
        let cfg = Config { cache: CacheMode::Direct, block_size: 512, file_len: (96 << 10) + 1000, offset: 0, size_limit: None, dir: None };
        run_case(&cfg, seed, &ops);
    }

    #[test]
    fn direct_4096_engines_agree_with_model(seed in any::<u64>(), ops in ops()) {
        let cfg = Config { cache: CacheMode::Direct, block_size: 4096, file_len: 128 << 10, offset: 0, size_limit: None, dir: None };
        run_case(&cfg, seed, &ops);
    }

    #[test]
    fn direct_4096_window_inside_file_engines_agree_with_model(seed in any::<u64>(), ops in ops()) {
        // Bytes outside [4096, 4096 + 64 KiB) must stay as they were.
        let cfg = Config {
            cache: CacheMode::Direct,
            block_size: 4096,
            file_len: 128 << 10,
            offset: 4096,
            size_limit: Some(64 << 10),
            dir: None,
        };
        run_case(&cfg, seed, &ops);
    }

    #[test]
    fn direct_512_window_past_end_of_file_engines_agree_with_model(seed in any::<u64>(), ops in ops()) {
        let cfg = Config {
            cache: CacheMode::Direct,
            block_size: 512,
            file_len: 20_000,
            offset: 4096,
            size_limit: Some(48 << 10),
            dir: None,
        };
        run_case(&cfg, seed, &ops);
    }

    #[test]
    fn buffered_on_tmpfs_zero_fill_fallback_engines_agree_with_model(seed in any::<u64>(), ops in ops()) {
        // tmpfs cannot FALLOC_FL_ZERO_RANGE: write-zeroes with NO_HOLE takes the
        // zero-fill fallback (or fails with NotSup when FAST_ZERO is set).
        if !Path::new("/dev/shm").is_dir() {
            return Ok(());
        }
        let cfg = Config {
            cache: CacheMode::Buffered,
            block_size: 512,
            file_len: 50_000,
            offset: 1024,
            size_limit: Some(60 << 10),
            dir: Some("/dev/shm"),
        };
        run_case(&cfg, seed, &ops);
    }

    #[test]
    #[cfg(feature = "test-backend")]
    fn memory_backend_posted_and_sync_agree_with_model(ops in ops()) {
        run_mem_case(192 << 10, 512, &ops);
    }

    #[test]
    #[cfg(feature = "test-backend")]
    fn memory_backend_4096_posted_and_sync_agree_with_model(ops in ops()) {
        run_mem_case(256 << 10, 4096, &ops);
    }
}
