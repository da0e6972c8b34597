//! The daemon's core: the table of exports and the control actions on it.
//!
//! Contract: control actions arrive as typed
//! [`Request`](crate::control::proto::Request)s (from the control socket, the
//! config file or the state file) and run here, on the caller's thread. The
//! export table is an `RwLock` held only to look up, insert or remove (never
//! across file I/O or a freeze); an action on one export takes that export's
//! own control lock, so actions on different devices never wait for each
//! other, and reactors never take either lock.
//!
//! An attach validates everything and opens the file *before* it takes the table
//! lock; the export becomes visible to clients in one insertion. A failed attach
//! leaves nothing behind (an image it created is removed again).
//!
//! State file: every change it records (attach, set, detach) is durable in the
//! [`state::StateLog`] *before* it takes effect and before the reply; if it
//! cannot be recorded the request fails and changes nothing. Concurrent
//! requests share one write and one `fdatasync` (group commit): under the
//! log's mutex an attach checks its name, stages its record and claims the
//! name; it waits for its batch to be durable holding no lock; then, under the
//! mutex again, it is inserted into the table and its claim dropped (lock
//! order: log, then `claimed`, then the export table, then `missing`). So no
//! client sees a device the state file lacks, and no two attaches claim one
//! name; a failed batch fails each request in it. A batch request
//! (`attach_batch`) stages all its records in one hold of the mutex, so they
//! share one write (see `record.rs`, `attach.rs`). A recorded device whose image cannot be
//! opened at start stays recorded and is listed as *missing* with the reason; it
//! is retried every [`RETRY_INTERVAL`] and by an attach of the same name. So
//! is a device of `--config` that cannot be attached (at start or by a
//! reload), without a state record: one bad device never stops the start.
//!
//! Which file: a recorded device comes back (restart, retry) only on the file
//! its record names ([`crate::backing::identity`]); an `attach` of a missing
//! device's image brings it back with its record, or is refused when it asks
//! for something else ([`bring_back`]); `set` and `resize` re-open the device's
//! own file, never its path.
//!
//! # Files
//!
//! [`Daemon`] is one type; its work is split by kind, one file per kind, each
//! an `impl Daemon` block that calls only the files listed before it (so the
//! calls between them run one way, as their imports do):
//!
//! 1. `registry.rs`: the [`Daemon`] itself (what it owns, its locks), its
//!    settings (reactors, endpoints, TLS, default export), the lookups
//!    (`export`, `list`, `status`), the kicks, and the exports as NBD clients
//!    see them.
//! 2. `record.rs`: state handling (the state log: open, stage a record and
//!    wait for its batch, compact, close; [`default_state_path`]).
//! 3. `kernel.rs`: the kernel block devices of devices (made, resized,
//!    removed).
//! 4. `detach.rs`: detach ([`FORCE_TIMEOUT`]).
//! 5. `attach.rs`: attach.
//! 6. `set.rs`: `set` and `resize`.
//! 7. `restore.rs`: recorded devices coming back at start and retried while
//!    missing ([`RETRY_INTERVAL`]).
//! 8. `follow.rs`: RBD devices following their image's size (an `rbd
//!    resize` anywhere becomes a `resize`).
//! 9. `janitor.rs`: autoclear.
//! 10. [`reload`]: SIGHUP and the `reload` request.
//! 11. `request.rs`: one control request → its action → one reply line.
//! 12. [`control_socket`]: the control socket's threads.
//!
//! Pure parts, below all of these: `error.rs` ([`CtlError`], its wire code),
//! `endpoints.rs` ([`Endpoints`]), `params.rs` ([`name_of`], [`Tuning`], the
//! checks of a spec), [`set_rules`], [`bring_back`], [`config`], [`audit`],
//! [`reload_report`], [`uri`], [`info`], `pool.rs` (work on a few threads at
//! start); and [`state`] (the state file's
//! format and log), `group_commit.rs` (its group commit: records staged in
//! order, the first waiter writes and syncs the batch), [`rbd_owners`] (its sidecar: the RBD lock owners of the
//! devices it does not hold), [`blockdev`] (making and removing a kernel block device).

mod attach;
pub mod audit;
pub mod blockdev;
mod blockdev_error;
pub mod bring_back;
pub mod config;
pub mod control_socket;
mod detach;
mod endpoints;
mod error;
mod follow;
mod group_commit;
pub mod info;
mod janitor;
mod kernel;
mod nbd_dev;
mod params;
mod pool;
pub mod rbd_owners;
mod record;
mod registry;
pub mod reload;
pub mod reload_report;
mod request;
mod restore;
mod set;
pub mod set_rules;
pub mod state;
pub mod uri;

pub use detach::FORCE_TIMEOUT;
pub use endpoints::Endpoints;
pub use error::CtlError;
pub use params::{Tuning, name_of};
pub use record::{ClosedState, default_state_path};
pub use registry::Daemon;
pub use restore::{RETRY_INTERVAL, reserved_fds};
