//! Aligned buffers and the per-reactor pool they come from.
//!
//! Every buffer is 4096-byte aligned (enough for `O_DIRECT` on every filesystem
//! loopd meets; the probed memory alignment is checked against it at start) and
//! zero-initialised when first allocated. A buffer is owned by exactly one request
//! slot at a time; while an SQE refers to it, the slot keeps it (see the reactor's
//! contract). The pool is per reactor, so it needs no lock.
//!
//! Memory: every buffer is charged to the daemon's [`super::budget`] while it
//! exists, idle in a pool or not. Buffers of [`MMAP_MIN`] bytes or more are mapped
//! directly, so freeing one gives its memory back to the system at once (the
//! allocator could keep it); a pool keeps at most [`POOL_KEEP_BYTES`] (and a
//! quarter of the budget) idle, and frees what comes back while a reactor waits
//! for budget.
//!
//! [`Lender`] keeps a reactor's spare receive buffers: an NBD connection
//! borrows one while it has requests in flight and gives it back once idle,
//! so an idle connection holds none. They are outside the budget, like the
//! receive buffers they replace (bounded by the busy connections, not by
//! what clients send).

use super::budget;
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Alignment of every buffer.
pub const BUF_ALIGN: usize = 4096;
const MIN_CLASS_SHIFT: usize = 12; // 4 KiB
const CLASSES: usize = 15; // 4 KiB ..= 64 MiB
/// Bytes of idle buffers a pool keeps for reuse; past this they are freed.
const POOL_KEEP_BYTES: usize = 96 << 20;
/// Buffers this large are mapped, not taken from the allocator.
pub const MMAP_MIN: usize = 256 << 10;

/// A heap buffer aligned to [`BUF_ALIGN`].
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    /// Charged to the memory budget (released on drop).
    charged: bool,
    /// A mapping of its own (unmapped on drop), not the allocator's.
    mapped: bool,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like Box<[u8]>); nothing else
// holds the pointer except SQEs whose lifetime the owning slot outlives.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocate `cap` bytes (rounded up to the alignment), zeroed, charged to the
    /// budget whatever its limit.
    pub fn new(cap: usize) -> AlignedBuf {
        let cap = Self::rounded(cap);
        budget::global().charge(cap);
        Self::new_charged(cap)
    }

    /// Allocate `cap` bytes outside the memory budget: for buffers whose number
    /// and size are fixed by configuration, not by clients (a ublk queue's
    /// per-tag buffers, which the kernel bounds by queue depth × I/O size).
    /// Large ones are mapped lazily, so untouched pages cost nothing.
    pub fn unbudgeted(cap: usize) -> AlignedBuf {
        let mut b = Self::new_charged(Self::rounded(cap));
        b.charged = false;
        b
    }

    fn rounded(cap: usize) -> usize {
        cap.max(BUF_ALIGN).next_multiple_of(BUF_ALIGN)
    }

    /// Allocate `cap` bytes (a multiple of the alignment) already charged.
    fn new_charged(cap: usize) -> AlignedBuf {
        if cap >= MMAP_MIN {
            return Self::map(cap)
                .unwrap_or_else(|| std::alloc::handle_alloc_error(Self::layout(cap)));
        }
        Self::heap(cap)
    }

    /// `cap` bytes (a multiple of the alignment, not zero) mapped on their
    /// own: zero-filled, page aligned, each page taking memory only once
    /// touched, and all of it given back to the system when dropped. None if
    /// the system refuses the mapping.
    fn map(cap: usize) -> Option<AlignedBuf> {
        // SAFETY: an anonymous private mapping of a non-zero length at an
        // address of the kernel's choosing; it aliases nothing.
        let raw = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if raw == libc::MAP_FAILED {
            return None;
        }
        // Mappings are page aligned (>= BUF_ALIGN) and zero-filled.
        NonNull::new(raw.cast::<u8>()).map(|ptr| AlignedBuf {
            ptr,
            cap,
            charged: true,
            mapped: true,
        })
    }

    /// `cap` bytes (a multiple of the alignment, not zero) from the
    /// allocator, zeroed.
    fn heap(cap: usize) -> AlignedBuf {
        let layout = Self::layout(cap);
        // SAFETY: layout has non-zero size (cap >= BUF_ALIGN) and a valid alignment.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        AlignedBuf {
            ptr,
            cap,
            charged: true,
            mapped: false,
        }
    }

    /// `cap` bytes outside the budget, mapped on their own where the system
    /// allows (see [`AlignedBuf::map`]: untouched pages cost nothing, and
    /// freeing it gives its memory back at once, which the allocator may
    /// not), else from the allocator: for a connection's lent receive
    /// buffer, of which a client sending only headers touches one page.
    pub fn lazy(cap: usize) -> AlignedBuf {
        let cap = Self::rounded(cap);
        let mut b = Self::map(cap).unwrap_or_else(|| Self::heap(cap));
        b.charged = false;
        b
    }

    fn layout(cap: usize) -> Layout {
        match Layout::from_size_align(cap, BUF_ALIGN) {
            Ok(l) => l,
            // cap is a multiple of BUF_ALIGN below isize::MAX for every size we use.
            Err(_) => std::alloc::handle_alloc_error(Layout::new::<[u8; BUF_ALIGN]>()),
        }
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap initialised bytes (zeroed at allocation) and
        // uniquely owned; the shared borrow of self prevents mutation meanwhile.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, and the exclusive borrow of self makes this the
        // only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.mapped {
            // SAFETY: ptr/cap is the mapping made in `map`, unmapped once.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.cap) };
        } else {
            // SAFETY: ptr was allocated by alloc_zeroed with exactly this
            // layout (`heap`).
            unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
        }
        if self.charged {
            budget::global().release(self.cap);
        }
    }
}

fn class_of(len: usize) -> Option<usize> {
    let size = len.max(1).next_power_of_two().max(1 << MIN_CLASS_SHIFT);
    let idx = size.trailing_zeros() as usize - MIN_CLASS_SHIFT;
    (idx < CLASSES).then_some(idx)
}

/// Capacity of the buffer [`Pool::get`] hands out for `len` bytes: what the
/// request holding it is charged.
pub fn capacity_for(len: usize) -> usize {
    match class_of(len) {
        Some(c) => 1 << (c + MIN_CLASS_SHIFT),
        None => AlignedBuf::rounded(len),
    }
}

/// A pool of aligned buffers in power-of-two size classes.
#[derive(Default)]
pub struct Pool {
    free: [Vec<AlignedBuf>; CLASSES],
    kept: usize,
}

impl Pool {
    /// A buffer of at least `len` bytes. Contents are whatever the last user left.
    pub fn get(&mut self, len: usize) -> AlignedBuf {
        match class_of(len) {
            Some(c) => match self.free[c].pop() {
                Some(b) => {
                    self.kept -= b.cap;
                    b
                }
                None => AlignedBuf::new(1 << (c + MIN_CLASS_SHIFT)),
            },
            None => AlignedBuf::new(len),
        }
    }

    /// Make sure the next [`Pool::get`] of `len` bytes is within the budget: an
    /// idle buffer of its class is there, or one is allocated now if the budget
    /// has room below `upto` (after freeing this pool's idle buffers if need
    /// be; see [`super::budget::Budget::try_charge_upto`]). False: the budget
    /// is spent; the caller waits for a release.
    pub fn reserve(&mut self, len: usize, upto: usize) -> bool {
        let Some(c) = class_of(len) else {
            return true; // larger than any request: not reached
        };
        if !self.free[c].is_empty() {
            return true;
        }
        let cap = 1 << (c + MIN_CLASS_SHIFT);
        let b = budget::global();
        if !b.try_charge_upto(cap, upto) {
            self.trim();
            if !b.try_charge_upto(cap, upto) {
                return false;
            }
        }
        self.kept += cap;
        self.free[c].push(AlignedBuf::new_charged(cap));
        true
    }

    /// Free every idle buffer.
    pub fn trim(&mut self) {
        for f in &mut self.free {
            f.clear();
        }
        self.kept = 0;
    }

    /// Bytes of idle buffers held.
    pub fn idle_bytes(&self) -> usize {
        self.kept
    }

    /// Return a buffer for reuse (or free it if the pool is full, or a reactor
    /// waits for budget).
    pub fn put(&mut self, buf: AlignedBuf) {
        let b = budget::global();
        let keep = POOL_KEEP_BYTES.min(b.limit() / 4);
        if let Some(c) = class_of(buf.cap) {
            if buf.cap == 1 << (c + MIN_CLASS_SHIFT)
                && self.kept + buf.cap <= keep
                && !b.anyone_starved()
            {
                self.kept += buf.cap;
                self.free[c].push(buf);
            }
        }
    }
}

/// Bytes of a busy connection's receive buffer ([`Lender`]).
pub const RECV_BUF: usize = 64 << 10;
/// Spare receive buffers a reactor keeps for reuse; past this they are freed.
const LENDER_KEEP: usize = 16;

/// A reactor's spare receive buffers of [`RECV_BUF`] bytes, lent to busy
/// connections (see the module documentation), and how many are out.
#[derive(Default)]
pub struct Lender {
    idle: Vec<AlignedBuf>,
    /// Buffers lent by this reactor and not given back (a hint for when to
    /// look for idle borrowers: a connection that moves to another reactor
    /// takes its buffer along, so the reactor recounts at each look).
    pub out: usize,
}

impl Lender {
    /// A receive buffer: a spare one, or a new one (zeroed, outside the
    /// budget, mapped on its own: [`AlignedBuf::lazy`]).
    pub fn lend(&mut self) -> AlignedBuf {
        self.out += 1;
        self.idle
            .pop()
            .unwrap_or_else(|| AlignedBuf::lazy(RECV_BUF))
    }

    /// A buffer comes back: kept for the next borrower, or freed when enough
    /// are kept.
    pub fn give_back(&mut self, buf: AlignedBuf) {
        self.out = self.out.saturating_sub(1);
        if self.idle.len() < LENDER_KEEP && buf.capacity() == RECV_BUF {
            self.idle.push(buf);
        }
    }

    /// Buffers kept for reuse.
    pub fn spare(&self) -> usize {
        self.idle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lent_buffers_are_counted_reused_and_kept_up_to_a_bound() {
        let mut l = Lender::default();
        let mut b = l.lend();
        assert_eq!(b.capacity(), RECV_BUF);
        assert_eq!(l.out, 1);
        b.as_mut_slice()[0] = 7;
        let at = b.as_ptr();
        l.give_back(b);
        assert_eq!((l.out, l.spare()), (0, 1));
        let b = l.lend();
        assert_eq!(b.as_ptr(), at, "a spare one is lent again");
        let many: Vec<_> = (0..LENDER_KEEP + 4).map(|_| l.lend()).collect();
        assert_eq!(l.out, LENDER_KEEP + 5);
        for x in many {
            l.give_back(x);
        }
        l.give_back(b);
        assert_eq!(l.out, 0);
        assert_eq!(l.spare(), LENDER_KEEP, "the rest are freed");
        // A buffer of another size is not kept.
        l.give_back(AlignedBuf::unbudgeted(4096));
        assert_eq!(l.spare(), LENDER_KEEP);
    }

    #[test]
    fn a_lazy_buffer_is_zeroed_and_outside_the_budget() {
        let b = AlignedBuf::lazy(RECV_BUF);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        assert_eq!(b.as_ptr() as usize % BUF_ALIGN, 0);
        assert!(!b.charged, "not charged to the budget");
        assert!(b.mapped, "a mapping of its own on this system");
    }
}
