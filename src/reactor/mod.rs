//! The reactor: one thread, one io_uring, many sessions (today: NBD
//! connections; see [`session`]).
//!
//! Layout: [`session`] is what a reactor drives (an NBD connection or a ublk
//! queue, known only through its methods); [`handle`] is how other threads
//! reach a reactor (adopt a session, wake or kick it, stop it);
//! [`event_loop`] is the thread itself and [`spawn`] starts it; the ring and
//! what sessions need of it are [`crate::ring`]'s. Nothing here reads inside a
//! session: a connection is built by whoever negotiated it
//! ([`Session::nbd`]) and adopted whole.
//!
//! Contract:
//! - A connection is handed over ([`ReactorHandle::adopt`]) and stays on this
//!   reactor until it closes, or until it moves to the reactor running on the
//!   CPU its client runs on (see [`crate::frontend::nbd::affinity`]): asked
//!   to move ([`Session::move_to`]), it stops reading requests, cancels its
//!   posted receive, and once nothing of it is in flight
//!   ([`Session::move_target`]: no request, receive, send or file operation)
//!   the whole session, unparsed bytes included, goes to the other reactor's
//!   channel to be adopted there. While it lives here its socket I/O and its
//!   requests' file I/O all go through this reactor's ring, and no other
//!   thread touches it. When its place goes to another peer's newcomer (see
//!   [`crate::engine::admit`]), the accept loop tells every reactor; the one
//!   holding it (found by its place's ticket, [`Session::ticket`]) — or the
//!   one it moves to — shuts its socket down and drops it once its
//!   operations in flight complete.
//! - A detach (or any change connections must see at once) kicks every
//!   reactor ([`ReactorHandle::kick`]): on its next wake-up the reactor
//!   services every session, and each looks at its export again. No global
//!   state carries this: the kick is a flag of the reactor's handle.
//! - `user_data` = `tag << 56 | conn << 16 | slot`: the tag says what completed
//!   (wake-up, receive, send, file op, cancel), `conn` indexes `conns`, `slot` the
//!   connection's slot table (a slot that was never made, or was dropped, is
//!   free to it). A connection's index is reused only after every
//!   operation it submitted has completed, so a completion always finds its owner.
//! - Buffers referred to by an SQE belong to the slot (or connection) that
//!   submitted it, which is not freed or reused until the CQE arrives. On exit the
//!   reactor waits for every in-flight operation before dropping anything.
//! - The only lock taken is the device's range lock, and only to decide; a request
//!   that must wait is parked and retried when a release wakes this reactor.
//! - While any request waits for memory budget (the daemon's, or a device's
//!   share), a one-second timer ticks: it cuts off the connections here that
//!   hold budget and have a reply (or a write's payload) older than
//!   `--reply-timeout` in ticks (see [`crate::frontend::nbd::stall`]), and
//!   retries the connections parked here, a backstop to the wake-ups; the
//!   same timer paces the drain on stop, and, while this reactor has receive
//!   buffers lent to connections, each tick lets the connections idle since
//!   the last one give them (and their slots) back (see
//!   `frontend::nbd::idle`): a look at every session, once a second.
//! - Large buffered reads are spliced (see [`crate::engine::splice`]): their file → pipe
//!   and pipe → socket operations run on the kernel's io_uring workers, which may
//!   block there, never this thread.
//! - What the thread may block on: the ring (waiting for completions), and
//!   nothing else that a backing file can hold up. Every file operation goes
//!   through the ring (whose workers may block, never this thread; up to
//!   `IOWQ_BOUNDED` of them per ring, so a few hung operations do not hold up
//!   other devices' syncs and large writes); the calls the
//!   ring has no opcode for (`SEEK_DATA`/`SEEK_HOLE`, `fstat` of BLOCK_STATUS) run
//!   on [`crate::engine::offload`]'s workers. The inline page-cache paths of buffered mode
//!   use `RWF_NOWAIT` (reads always; writes where the filesystem takes it), with
//!   one exception: on a local disk filesystem without NOWAIT buffered writes
//!   (ext4, tmpfs) a small whole-page write is copied inline and may wait for the
//!   journal or dirty-page throttling of that disk. A file on FUSE, NFS or any
//!   other filesystem whose server may not answer is never touched here — no
//!   inline path, and its ring operations carry `IOSQE_ASYNC`, since even a
//!   NOWAIT issue from `io_uring_enter` blocked in FUSE readahead — so a hung
//!   backing store stalls its own clients only.
//! - Memory: request buffers are reserved against the daemon's
//!   [`crate::engine::budget`] before a request is read; a refused connection is parked
//!   and the reactor is woken when any reactor releases budget (or, refused by
//!   its device's share, when that device's requests give some back). Its pool
//!   frees its idle buffers when some reactor is refused the daemon's budget.
//! - `user_data` tag `TAG_POLL`: a connection's poll for a hang-up while it
//!   reads nothing (see [`crate::frontend::nbd::conn`]); cancelled before the
//!   connection is dropped or moves, like its receive.
//! - Heartbeat: the thread publishes when it started its current turn (zero while
//!   it waits on the ring), so [`ReactorHandle::making_progress`] can tell a
//!   stuck reactor from an idle one.
//! - Before sleeping it may busy-poll (see [`poll`]) for up to `--poll-us`,
//!   never while file I/O is in flight and never after a large batch.

mod event_loop;
pub mod handle;
pub mod poll;
pub mod session;

pub use event_loop::spawn;
pub use handle::{ReactorError, ReactorHandle, STUCK_AFTER_MS};
pub use session::Session;
