//! `/dev/nbdN`: the kernel's NBD client connected to a device in one step
//! (see [`super::blockdev`], which makes and removes block devices of either
//! kind). Socket pairs, one end handed to a reactor as an already negotiated
//! connection (no handshake round trip), the other to the kernel over netlink
//! (NBD_CMD_CONNECT) with the export's size, block size and transmission
//! flags and a backend identifier; a dead-connection timeout keeps I/O
//! waiting when the daemon dies, and a restarted daemon finds the device by
//! its identifier and hands it new connections (NBD_CMD_RECONFIGURE), checking
//! that the kernel kept each ([`reconnect_nbd`]). Removal: NBD_CMD_DISCONNECT.
//! Runs on control threads and may block (netlink calls, bounded by
//! `--kernel-timeout`); the reactors never wait for it.

use super::blockdev_error::BlockdevError;
use crate::device::export::Export;
use crate::device::spec::DeviceSpec;
use crate::engine::admit::Admission;
use crate::frontend::nbd::affinity::Peer;
use crate::frontend::nbd::conn::{Conn, NewConn};
use crate::frontend::nbd::handshake::transmission_flags;
use crate::kernel_nbd::{ConnectParams, KernelNbd, ReconfigureParams};
use crate::reactor::{ReactorHandle, Session};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a removal waits for the kernel's connections to end.
const WAIT: Duration = Duration::from_secs(10);

/// Per-request timeout the kernel NBD client applies (a request in flight when
/// a connection dies is sent again after it).
const NBD_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the kernel NBD client keeps I/O waiting for a restarted daemon.
const NBD_DEAD_CONN_TIMEOUT: Duration = Duration::from_secs(300);

/// A device's kernel NBD client (`/dev/nbdN`) connected to its export.
pub struct NbdDevice {
    pub index: u32,
    kn: Mutex<KernelNbd>,
    export: Arc<Export>,
    /// Connections handed to the kernel.
    pub(super) conns: u32,
}

impl NbdDevice {
    pub fn path(&self) -> PathBuf {
        crate::kernel_nbd::device_path(self.index)
    }

    /// Disconnect the kernel client (the device goes back to size 0) and wait
    /// until its connections are gone from the reactors.
    pub fn remove(&self) -> Result<(), BlockdevError> {
        let goal = self.export.clients().saturating_sub(self.conns);
        let mut kn = self.kn.lock().unwrap_or_else(|p| p.into_inner());
        if kn.is_stuck() {
            // An earlier call of this handle is still in the kernel.
            *kn = KernelNbd::open()?;
        }
        kn.disconnect(self.index)?;
        let deadline = Instant::now() + WAIT;
        // The kernel shuts its sockets; their reactor connections see EOF.
        while self.export.clients() > goal && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }
}

/// The identifier the kernel keeps in `/sys/block/nbdN/backend`, by which a
/// restarted daemon finds its device again.
fn nbd_backend(export: &Export) -> String {
    format!("loopd:{}", export.name)
}

/// Connect the kernel's NBD client to `export` over `n` socket pairs, the
/// loopd ends served by `reactors` as negotiated connections; or, where a
/// device with this export's backend identifier waits for its dead connections
/// (the daemon died), hand it new ones.
pub fn start_nbd(
    export: &Arc<Export>,
    spec: &DeviceSpec,
    reactors: &[Arc<ReactorHandle>],
) -> Result<NbdDevice, BlockdevError> {
    if reactors.is_empty() {
        return Err(BlockdevError::NoReactors);
    }
    let n = spec.connections.unwrap_or(1);
    if !(1..=64).contains(&n) {
        return Err(BlockdevError::Connections(n));
    }
    let mut kn = KernelNbd::open()?;
    let backend = nbd_backend(export);
    let existing = kn.find_backend(&backend)?;
    let (dev, _) = export.current();
    let index = match existing {
        Some(index) => {
            reconnect_nbd(&mut kn, export, reactors, index, n, &backend)?;
            tracing::info!(
                "device {:?}: reconnected /dev/nbd{index} left by the previous server",
                export.name
            );
            index
        }
        None => {
            let (kernel_ends, _) = nbd_pairs(export, reactors, n)?;
            let fds: Vec<_> = kernel_ends.iter().map(|f| f.as_fd()).collect();
            // The kernel holds its own references to the sockets once this returns.
            kn.connect(
                &ConnectParams {
                    index: None,
                    size_bytes: dev.size - dev.size % u64::from(dev.block_size),
                    block_size: dev.block_size,
                    server_flags: transmission_flags(&dev, false),
                    timeout: Some(NBD_TIMEOUT),
                    dead_conn_timeout: Some(NBD_DEAD_CONN_TIMEOUT),
                    destroy_on_disconnect: false,
                    backend: Some(backend),
                },
                &fds,
            )?
        }
    };
    Ok(NbdDevice {
        index,
        kn: Mutex::new(kn),
        export: Arc::clone(export),
        conns: u32::from(n),
    })
}

/// `n` socket pairs: each loopd end adopted by a reactor as a negotiated
/// connection. Returns the kernel ends, and a duplicate of each loopd end by
/// which to see whether the kernel kept its end ([`hung_up`]).
fn nbd_pairs(
    export: &Arc<Export>,
    reactors: &[Arc<ReactorHandle>],
    n: u16,
) -> Result<(Vec<OwnedFd>, Vec<OwnedFd>), BlockdevError> {
    let mut kernel_ends = Vec::new();
    let mut watch = Vec::new();
    // Kernel connections are the daemon's own: outside --max-connections.
    let admission = Admission::new(usize::MAX);
    for i in 0..usize::from(n) {
        let (k, u) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| BlockdevError::SocketPair(e.into()))?;
        watch.push(u.try_clone().map_err(BlockdevError::SocketPair)?);
        let (Some(client), Some(permit)) = (export.join(), admission.try_admit()) else {
            return Err(BlockdevError::NoReactors);
        };
        reactors[i % reactors.len()].adopt(Session::nbd(Conn::new(NewConn {
            sock: u,
            client,
            permit,
            structured: false,
            extended: false,
            meta_context: false,
            peer: Peer::Unknown,
            tls: None,
            encrypted: false,
        })));
        kernel_ends.push(k);
    }
    Ok((kernel_ends, watch))
}

/// Whether the other end of the socket `fd` is closed: after a netlink call
/// returned and loopd closed its copy of the kernel end, the kernel did not
/// keep it.
fn hung_up(fd: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut p = [PollFd::new(fd, PollFlags::RDHUP)];
    let now = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    matches!(poll(&mut p, Some(&now)), Ok(1))
        && p[0].revents().intersects(PollFlags::HUP | PollFlags::RDHUP)
}

/// How often a reconnect retries sockets the kernel dropped.
const RECONNECT_RETRY: Duration = Duration::from_millis(50);

/// Hand device `index` (found by its backend identifier: the previous server
/// died) `n` new connections. The kernel replaces only connections it has
/// marked dead and silently drops a socket given while none is (nbd.c turns
/// `ENOSPC` into success): a daemon restarted before the kernel saw the old
/// one's EOF, or a second daemon with a device of the same name while the
/// first one lives, would be told "reconnected" while the device stayed with
/// the old connections. So each socket's loopd end is watched: a socket the
/// kernel dropped is given again (a new pair) every [`RECONNECT_RETRY`] until
/// all are taken, for at most the kernel deadline (`--kernel-timeout`); then
/// the attach fails, naming the device.
fn reconnect_nbd(
    kn: &mut KernelNbd,
    export: &Arc<Export>,
    reactors: &[Arc<ReactorHandle>],
    index: u32,
    n: u16,
    backend: &str,
) -> Result<(), BlockdevError> {
    let start = Instant::now();
    let limit = crate::kernel_nbd::socket::reply_timeout();
    let mut left = n;
    loop {
        let (kernel_ends, watch) = nbd_pairs(export, reactors, left)?;
        let fds: Vec<_> = kernel_ends.iter().map(|f| f.as_fd()).collect();
        kn.reconfigure(
            index,
            &ReconfigureParams {
                timeout: Some(NBD_TIMEOUT),
                dead_conn_timeout: Some(NBD_DEAD_CONN_TIMEOUT),
                backend: Some(backend.to_owned()),
            },
            &fds,
        )?;
        drop(fds);
        drop(kernel_ends);
        let dropped = watch.iter().filter(|w| hung_up(w)).count();
        if dropped == 0 {
            return Ok(());
        }
        left = u16::try_from(dropped).unwrap_or(n);
        if start.elapsed() >= limit {
            return Err(BlockdevError::NbdLive {
                index,
                backend: backend.to_owned(),
                taken: n - left,
                n,
                waited: limit,
            });
        }
        tracing::debug!(
            "/dev/nbd{index}: the kernel dropped {dropped} new connection(s); retrying"
        );
        std::thread::sleep(RECONNECT_RETRY);
    }
}
