//! The control socket: accepts clients and runs their requests against the daemon.
//!
//! One thread accepts; each client is served by a thread of its own for as
//! long as it stays connected: the thread reads a request line, runs it
//! ([`Daemon::handle`]) and writes the reply line, so a slow client or a long
//! action (a forced detach) holds up nobody else. The threads are pooled: one
//! whose client left waits (up to [`SPARE_WORKERS`] of them) for the next
//! client instead of exiting, so a `loopd attach` from the shell does not pay
//! for a new thread (clone, stack mapping, signal stack, ...) on the daemon's
//! side; with none waiting, a new thread is started as before. The server
//! binds the socket mode 0600 (owner only) with `server::listen::bind_unix`,
//! which gives it its mode before renaming it into place, so it is never
//! reachable with looser permissions.
//!
//! Limits: at most [`MAX_CLIENTS`] clients at once (one more gets a `busy` error
//! line and is closed), and a client that sends no request (or takes no reply)
//! for [`IDLE_TIMEOUT`] (`--control-idle-timeout`) is closed. NBD clients cannot
//! use up the descriptors the control plane needs (the accept loop keeps them below the open-file limit);
//! should accepting fail anyway, the thread pauses instead of spinning.
//!
//! Locking: one mutex ([`Pool`]) over the client count, the waiting threads'
//! count and the clients handed to them; held only to count and hand over,
//! never while serving.

use super::audit;
use super::registry::Daemon;
use crate::control::proto::{self, ErrorBody, ErrorCode, MAX_LINE, err_reply};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ControlError {
    #[error("cannot start the control thread")]
    Spawn(#[source] std::io::Error),
}

/// Control clients served at once.
pub const MAX_CLIENTS: usize = 32;
/// How long a control client may stay silent (or leave a reply unread), by
/// default.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Pause after a failed accept (out of descriptors, say).
const ACCEPT_ERROR_PAUSE: Duration = Duration::from_millis(100);

/// Threads kept waiting for the next client once theirs has left.
pub const SPARE_WORKERS: usize = 4;

/// The client threads' shared state.
struct Pool {
    state: Mutex<PoolState>,
    /// Signalled when a client is handed to a waiting thread.
    handed: Condvar,
}

#[derive(Default)]
struct PoolState {
    /// Clients admitted and not yet finished (at most [`MAX_CLIENTS`]).
    clients: usize,
    /// Threads waiting for a client (at most [`SPARE_WORKERS`]).
    waiting: usize,
    /// Clients handed over and not yet taken: always fewer than `waiting`
    /// was when each was pushed, so each has a waiting thread of its own.
    handoff: VecDeque<UnixStream>,
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        // The state is counts and streams, consistent after any panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Serve control clients on `listener` for the life of the process.
pub fn spawn(
    listener: UnixListener,
    daemon: Arc<Daemon>,
    idle: Duration,
) -> Result<(), ControlError> {
    std::thread::Builder::new()
        .name("loopd-control".into())
        .spawn(move || {
            let pool = Arc::new(Pool {
                state: Mutex::new(PoolState::default()),
                handed: Condvar::new(),
            });
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => admit(s, &daemon, &pool, idle),
                    Err(e) => {
                        tracing::warn!("control accept failed: {e}");
                        std::thread::sleep(ACCEPT_ERROR_PAUSE);
                    }
                }
            }
        })
        .map(|_| ())
        .map_err(ControlError::Spawn)
}

/// Serve one control client on a thread of its own (a waiting one, else a
/// new one), within [`MAX_CLIENTS`].
fn admit(s: UnixStream, daemon: &Arc<Daemon>, pool: &Arc<Pool>, idle: Duration) {
    let mut st = pool.lock();
    if st.clients >= MAX_CLIENTS {
        drop(st);
        let e = ErrorBody {
            code: ErrorCode::Busy,
            message: format!("too many control clients (at most {MAX_CLIENTS} at once); try again"),
        };
        let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = (&s).write_all(format!("{}\n", err_reply(&e)).as_bytes());
        return;
    }
    st.clients += 1;
    if st.waiting > st.handoff.len() {
        st.handoff.push_back(s);
        drop(st);
        pool.handed.notify_one();
        return;
    }
    drop(st);
    let d = Arc::clone(daemon);
    let p = Arc::clone(pool);
    let r = std::thread::Builder::new()
        .name("loopd-control-client".into())
        .spawn(move || worker(s, &d, &p, idle));
    if let Err(e) = r {
        pool.lock().clients -= 1;
        tracing::warn!("cannot start a control client thread: {e}");
    }
}

/// A client thread: serve `first`, then each client handed over while this
/// thread waits, until [`SPARE_WORKERS`] others already wait.
fn worker(first: UnixStream, daemon: &Daemon, pool: &Pool, idle: Duration) {
    let mut next = first;
    loop {
        if let Err(e) = serve_client(next, daemon, idle) {
            tracing::debug!("control client: {e}");
        }
        let mut st = pool.lock();
        st.clients -= 1;
        if st.waiting >= SPARE_WORKERS {
            return;
        }
        st.waiting += 1;
        let s = loop {
            if let Some(s) = st.handoff.pop_front() {
                break s;
            }
            st = pool.handed.wait(st).unwrap_or_else(PoisonError::into_inner);
        };
        st.waiting -= 1;
        next = s;
    }
}

fn serve_client(s: UnixStream, daemon: &Daemon, idle: Duration) -> std::io::Result<()> {
    s.set_read_timeout(Some(idle))?;
    s.set_write_timeout(Some(idle))?;
    let cred = rustix::net::sockopt::socket_peercred(&s).ok();
    let caller = audit::Caller {
        uid: cred.map(|c| c.uid.as_raw()),
        pid: cred.map(|c| c.pid.as_raw_nonzero().get()),
    };
    // Read and written through `&UnixStream`: no second descriptor.
    let mut w = &s;
    let mut r = BufReader::new(&s);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        let n = (&mut r)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') && n > MAX_LINE {
            let e = ErrorBody {
                code: ErrorCode::BadRequest,
                message: format!("request longer than {MAX_LINE} bytes"),
            };
            w.write_all(format!("{}\n", err_reply(&e)).as_bytes())?;
            return Ok(());
        }
        while line.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            line.pop();
        }
        if line.is_empty() {
            continue;
        }
        let reply = match proto::parse_request(&line) {
            Ok(req) => {
                let old_size = match &req {
                    proto::Request::Resize { name } => {
                        daemon.export(name).map(|e| e.current().0.size)
                    }
                    _ => None,
                };
                let reply = daemon.handle(req.clone());
                for l in audit::lines(&req, caller, old_size, &reply) {
                    tracing::info!("{l}");
                }
                reply
            }
            Err(e) => err_reply(&e),
        };
        // The line and its end in one write: the client wakes once.
        let mut out = reply.into_bytes();
        out.push(b'\n');
        w.write_all(&out)?;
    }
}
