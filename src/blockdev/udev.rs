//! Closing a writer of a whole disk without udev re-reading its partition
//! table afterwards.
//!
//! udev watches block devices with inotify; when a descriptor opened for
//! writing is closed (`IN_CLOSE_WRITE`), systemd-udevd tries `flock(LOCK_EX |
//! LOCK_NB)` on the disk and, if it gets the lock, issues `BLKRRPART`, which
//! drops every partition and adds them again. If it cannot get the lock it
//! writes `change` to the disk's `uevent` file instead (a *synthetic* uevent:
//! the kernel tags it `SYNTH_UUID=`), which is harmless. So a writer that
//! holds an exclusive `flock` while it closes, and keeps it until udev has
//! answered with that synthetic `change`, leaves no re-read behind.
//!
//! [`UeventListener`] listens to the kernel's uevents (netlink group 1, sender
//! checked to be the kernel); open it before the close, then
//! [`UeventListener::wait_synthetic_change`]. Waiting blocks the calling
//! thread, bounded by its timeout; when udev does not run or does not watch
//! the device no answer comes and the wait simply times out.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

/// Whether systemd-udevd (or a compatible daemon) is running here.
pub fn running() -> bool {
    Path::new("/run/udev/control").exists()
}

/// One kernel uevent, as far as this module needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelUevent {
    pub action: String,
    pub devpath: String,
    /// Raised by a write to a `uevent` file (`SYNTH_UUID=` present).
    pub synthetic: bool,
}

/// Parses a kernel uevent datagram: `ACTION@DEVPATH\0KEY=VALUE\0…`. `None` for
/// anything else (udev's own `libudev` messages, truncated or non-UTF-8 data).
pub fn parse_kernel_uevent(msg: &[u8]) -> Option<KernelUevent> {
    let mut parts = msg.split(|&b| b == 0);
    let head = std::str::from_utf8(parts.next()?).ok()?;
    let (action, devpath) = head.split_once('@')?;
    if action.is_empty() || !devpath.starts_with('/') {
        return None;
    }
    let synthetic = parts.any(|kv| kv.starts_with(b"SYNTH_UUID="));
    Some(KernelUevent {
        action: action.to_owned(),
        devpath: devpath.to_owned(),
        synthetic,
    })
}

/// A `NETLINK_KOBJECT_UEVENT` socket subscribed to the kernel's uevents.
pub struct UeventListener {
    sock: OwnedFd,
}

impl UeventListener {
    pub fn open() -> io::Result<UeventListener> {
        // SAFETY: socket(2) with constant arguments; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_KOBJECT_UEVENT,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor that nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: all-zero bytes are a valid `sockaddr_nl`.
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::sa_family_t::try_from(libc::AF_NETLINK)
            .map_err(|_| io::Error::from_raw_os_error(libc::EAFNOSUPPORT))?;
        addr.nl_groups = 1;
        // SAFETY: `addr` is a valid `sockaddr_nl` and the length is its size.
        let r = unsafe {
            libc::bind(
                sock.as_raw_fd(),
                (&addr as *const libc::sockaddr_nl).cast(),
                socklen::<libc::sockaddr_nl>(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(UeventListener { sock })
    }

    /// Waits until the kernel reports a synthetic `change` of the device
    /// whose devpath ends with `/block/NAME` (or `timeout` passes): `true`
    /// if it came.
    pub fn wait_synthetic_change(&self, name: &str, timeout: Duration) -> io::Result<bool> {
        let want = format!("/block/{name}");
        let start = Instant::now();
        let mut buf = vec![0u8; 8192];
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Ok(false);
            }
            let mut pfd = libc::pollfd {
                fd: self.sock.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = libc::c_int::try_from(left.as_millis().max(1)).unwrap_or(libc::c_int::MAX);
            // SAFETY: one valid `pollfd`, count 1.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            // Drain what is there.
            loop {
                // SAFETY: all-zero bytes are a valid `sockaddr_nl`.
                let mut from: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
                let mut len = socklen::<libc::sockaddr_nl>();
                // SAFETY: `buf` is writable for its length; `from`/`len`
                // describe a writable `sockaddr_nl`.
                let n = unsafe {
                    libc::recvfrom(
                        self.sock.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                        (&mut from as *mut libc::sockaddr_nl).cast(),
                        &mut len,
                    )
                };
                let Ok(n) = usize::try_from(n) else {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::WouldBlock => break,
                        io::ErrorKind::Interrupted => continue,
                        // ENOBUFS: we lost some; keep listening.
                        _ if e.raw_os_error() == Some(libc::ENOBUFS) => continue,
                        _ => return Err(e),
                    }
                };
                if from.nl_pid != 0 {
                    continue; // not from the kernel
                }
                let Some(ev) = parse_kernel_uevent(&buf[..n]) else {
                    continue;
                };
                if ev.synthetic && ev.action == "change" && ev.devpath.ends_with(&want) {
                    return Ok(true);
                }
            }
        }
    }
}

fn socklen<T>() -> libc::socklen_t {
    libc::socklen_t::try_from(std::mem::size_of::<T>()).unwrap_or(libc::socklen_t::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn synthetic_change_from_a_uevent_write() {
        let m = b"change@/devices/virtual/block/loop3\0ACTION=change\0DEVPATH=/devices/virtual/block/loop3\0SUBSYSTEM=block\0SYNTH_UUID=0\0SEQNUM=812\0";
        assert_eq!(
            parse_kernel_uevent(m),
            Some(KernelUevent {
                action: "change".into(),
                devpath: "/devices/virtual/block/loop3".into(),
                synthetic: true,
            })
        );
    }

    #[test]
    fn kernel_change_is_not_synthetic() {
        let m = b"change@/devices/virtual/block/loop3\0ACTION=change\0SEQNUM=811\0";
        assert!(!parse_kernel_uevent(m).unwrap().synthetic);
    }

    #[test]
    fn udev_messages_and_garbage_are_ignored() {
        assert_eq!(parse_kernel_uevent(b"libudev\0\xfe\xed\xca\xfe"), None);
        assert_eq!(parse_kernel_uevent(b""), None);
        assert_eq!(parse_kernel_uevent(b"@/devices/x\0"), None);
        assert_eq!(parse_kernel_uevent(b"add@relative\0"), None);
        assert_eq!(parse_kernel_uevent(b"add@/x\xff\0"), None);
    }

    proptest! {
        #[test]
        fn never_panics(msg in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = parse_kernel_uevent(&msg);
        }
    }
}
