//! Shared helpers for the loopd end-to-end tests.
//!
//! Every test gets its own temporary directory, its own socket and (when TCP
//! is used) its own port, so tests can run in parallel threads.  Every process
//! started here is stopped by PID when its owner is dropped.
//!
//! External tools (qemu-io, nbdinfo, fio, ...) are *required*: a missing tool
//! fails the test with a message pointing at `scripts/install-test-deps.sh`.
//!
//! The helpers are split by what they serve; a test file takes them all with
//! `use common::*` (re-exported here) or a module by name:
//!
//! | module | what |
//! |---|---|
//! | `builder`, `server` | `loopd serve` as a test starts, drives and stops it |
//! | `control` | client commands and raw connections to the control socket |
//! | `raw_client` | a hand-rolled NBD client for malformed traffic |
//! | `nbd_tools` | qemu-io, nbdsh and nbdinfo wrappers |
//! | `completion` | a user's `<TAB>` in bash against a completion script |
//! | `tools` | external tools, running a process under a time limit, temp dirs and mounts |
//! | `json` | JSON output parsed with `serde_json` |
//! | `image` | image files: patterns, reads, writes, byte comparisons |
//! | `matrix` | the cache × block-size matrix and `matrix_tests!` |
//! | `kernel_loop` | kernel loop devices from `loopd kernel attach` |
//! | `flood`, `gpt`, `pki`, `tls` | connection floods, partition tables, certificates, a TLS client |
//! | `kernel` | ublk, kernel NBD and VM-only helpers (feature `vm-tests`) |
//! | `rbd_writes` | RBD fault tests: a writer killed mid-way and its acknowledged rounds checked, waiting to serve, an image's watchers |
//! | `ceph` | the throwaway Ceph cluster of the RBD tests ([`ceph()`]): images through the `rbd` CLI, a paused OSD, a stopped monitor |

#![allow(dead_code)]

mod builder;
mod ceph;
mod completion;
mod control;
mod image;
mod json;
mod kernel_loop;
mod matrix;
mod nbd_tools;
mod raw_client;
mod rbd_writes;
mod server;
mod tools;

pub mod flood;
pub mod gpt;
#[cfg(feature = "vm-tests")]
pub mod kernel;
pub mod pki;
pub mod tls;

// Each test binary uses a different part of the helpers.
#[allow(unused_imports)]
pub use self::{
    builder::*, ceph::*, completion::*, control::*, image::*, json::*, kernel_loop::*, matrix::*,
    nbd_tools::*, raw_client::*, rbd_writes::*, server::*, tools::*,
};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;
