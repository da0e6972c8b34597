//! Keeping a connection's reactor on the CPU its client runs on.
//!
//! A client at low queue depth and the reactor serving it hand every request back
//! and forth. When the two run on different CPUs, each hand-over is a cross-CPU
//! wake-up, and every byte of the request, the reply and the socket's bookkeeping
//! changes cache twice. On a saturated 2-vCPU machine that doubled the CPU cost of
//! a buffered 4 KiB write, on both sides (16 clients at depth 1: 16–17 µs of CPU
//! per request across client and server, against 10–11 µs with every client on its
//! reactor's CPU). The kernel steers network flows the same way (RFS: process
//! packets on the CPU where the consuming thread runs).
//!
//! So each reactor notes the CPU it runs on, and every so often it looks where
//! each of its connections' clients last ran; while the machine is busy (at
//! least [`BUSY`] of its CPU time used since the last look), a connection whose
//! client keeps running on the CPU of another reactor moves to that reactor. On a
//! machine with idle CPUs nothing moves: there a hand-over costs a wake-up more
//! than it costs CPU time, and the scheduler is left to place reactors (near the
//! disk's interrupt, say; pinning reactors cost a third of the IOPS of a direct
//! 4 KiB read at depth 1). Reactors are not pinned: under load they stay put on
//! their own, and a reactor that wanders only makes a move pointless, not wrong.
//! Where the client runs is learnt:
//! - for TCP, from `SO_INCOMING_CPU` (the CPU that processed the client's last
//!   segment: the client's own for loopback, the receiving queue's otherwise);
//! - for Unix sockets, from the connecting process (`SO_PEERCRED`): the CPU in
//!   `/proc/PID/stat`, used only if that process is single-threaded (the field is
//!   its main thread's) and used CPU since the last look (a sleeping process says
//!   nothing about where the I/O runs — the kernel's NBD client, say). The pid
//!   may outlive the process and be reused; the answer is only a placement hint.
//!
//! [`Follow`] is the decision, pure: a move needs the client seen on the same other
//! CPU twice running, at most one move per hold period, and a connection that
//! moves straight back (client and reactor chasing each other across CPUs when
//! the scheduler balances an otherwise idle machine) doubles its hold.
//! Nothing here blocks; the probes are a `getsockopt` or a read of a procfs file.

use rustix::net::AddressFamily;
use rustix::net::sockopt::socket_peercred;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

/// How often a reactor looks where its clients run.
pub const LOOK_EVERY: Duration = Duration::from_millis(250);
/// Consecutive looks that must find the client on the same other CPU.
pub const STREAK: u8 = 2;
/// Least time between two moves of one connection.
pub const MIN_HOLD: Duration = Duration::from_secs(1);
/// Longest hold a connection that keeps moving back and forth earns.
pub const MAX_HOLD: Duration = Duration::from_secs(300);

/// Share of the machine's CPU time in use from which connections follow clients.
pub const BUSY: f64 = 0.9;

/// Busy and total CPU time of the machine from the `cpu` line of `/proc/stat`
/// (idle and iowait are not busy; guest time is already in user and nice).
pub fn parse_cpu_line(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    let total = v.iter().take(8).try_fold(0u64, |a, &x| a.checked_add(x))?;
    let idle = v.get(3)?.checked_add(*v.get(4)?)?;
    Some((total.checked_sub(idle)?, total))
}

/// The machine's CPU use between two samples.
#[derive(Debug, Default)]
pub struct CpuLoad {
    prev: Option<(u64, u64)>,
}

impl CpuLoad {
    /// The share of CPU time used since the previous sample (None on the first
    /// sample, or if `/proc/stat` cannot be read or went backwards).
    pub fn sample(&mut self) -> Option<f64> {
        let now = parse_cpu_line(&std::fs::read_to_string("/proc/stat").ok()?)?;
        let (busy0, total0) = self.prev.replace(now)?;
        let total = now.1.checked_sub(total0).filter(|&t| t > 0)?;
        let busy = now.0.checked_sub(busy0)?;
        Some(busy as f64 / total as f64)
    }
}

/// The fields of `/proc/PID/stat` placement needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcStat {
    /// CPU the process (its main thread) last ran on.
    pub cpu: usize,
    /// Threads in the process.
    pub threads: u64,
    /// User plus system CPU time, in clock ticks.
    pub ticks: u64,
}

/// Parse `/proc/PID/stat`. The command name (field 2) may hold spaces and
/// parentheses, so fields are counted from the last `)`.
pub fn parse_stat(s: &str) -> Option<ProcStat> {
    let rest = s.get(s.rfind(')')? + 1..)?;
    // After the name: field 3 (state) is index 0.
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |field: usize| f.get(field - 3)?.parse::<u64>().ok();
    Some(ProcStat {
        ticks: num(14)?.checked_add(num(15)?)?,
        threads: num(20)?,
        cpu: usize::try_from(num(39)?).ok()?,
    })
}

/// How to find where a connection's client runs.
#[derive(Debug)]
pub enum Peer {
    /// `SO_INCOMING_CPU`.
    Tcp,
    /// The connecting process; `ticks` its CPU time at the last look.
    Process {
        pid: u32,
        ticks: Option<u64>,
    },
    Unknown,
}

impl Peer {
    /// Identify the client of an accepted socket of address family `domain`.
    pub fn of(sock: &OwnedFd, domain: Option<AddressFamily>) -> Peer {
        match domain {
            Some(d) if d == AddressFamily::INET || d == AddressFamily::INET6 => Peer::Tcp,
            Some(d) if d == AddressFamily::UNIX => match socket_peercred(sock) {
                Ok(c) => Peer::Process {
                    pid: c.pid.as_raw_nonzero().get().unsigned_abs(),
                    ticks: None,
                },
                Err(_) => Peer::Unknown,
            },
            _ => Peer::Unknown,
        }
    }

    /// The CPU the client ran on lately, if that is known and it has been
    /// running since the last look.
    pub fn cpu(&mut self, sock: impl AsFd) -> Option<usize> {
        match self {
            Peer::Tcp => {
                let c = rustix::net::sockopt::socket_incoming_cpu(sock).ok()?;
                // -1 (nothing received yet) reads as u32::MAX.
                usize::try_from(i32::try_from(c).ok()?).ok()
            }
            Peer::Process { pid, ticks } => {
                let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                let st = parse_stat(&text)?;
                let ran = ticks.is_some_and(|t| st.ticks > t);
                *ticks = Some(st.ticks);
                (ran && st.threads == 1).then_some(st.cpu)
            }
            Peer::Unknown => None,
        }
    }
}

/// One connection's placement decisions (see the module documentation).
#[derive(Debug, Clone)]
pub struct Follow {
    /// The other CPU the client was last seen on, and how many looks in a row.
    seen: Option<(usize, u8)>,
    /// When the connection last moved, and from which CPU.
    moved: Option<(Instant, usize)>,
    hold: Duration,
}

impl Default for Follow {
    fn default() -> Follow {
        Follow {
            seen: None,
            moved: None,
            hold: MIN_HOLD,
        }
    }
}

impl Follow {
    /// A look found the client on `client` (None: unknown or idle) while the
    /// connection lives on `here`. Returns the CPU to move it to, if it should.
    pub fn observe(&mut self, client: Option<usize>, here: usize, now: Instant) -> Option<usize> {
        let Some(cpu) = client.filter(|&c| c != here) else {
            self.seen = None;
            return None;
        };
        let streak = match self.seen {
            Some((c, n)) if c == cpu => n.saturating_add(1),
            _ => 1,
        };
        self.seen = Some((cpu, streak));
        if streak < STREAK {
            return None;
        }
        if let Some((at, from)) = self.moved {
            let since = now.saturating_duration_since(at);
            // Straight back where it came from: the client follows us too.
            let back = from == cpu && since < self.hold * 4;
            let need = if back {
                (self.hold * 2).min(MAX_HOLD)
            } else {
                self.hold
            };
            if since < need {
                return None;
            }
            self.hold = need;
        }
        self.seen = None;
        self.moved = Some((now, here));
        Some(cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const STAT: &str = "4242 (fio (job) 1) S 4200 4200 1 34816 4200 4194560 1068 0 0 0 \
        153 287 0 0 20 0 1 0 123456 1234567 890 18446744073709551615 1 1 0 0 0 0 0 \
        4096 1073 0 0 0 17 1 0 0 0 0 0";

    #[test]
    fn parses_a_stat_line_with_a_tricky_name() {
        assert_eq!(
            parse_stat(STAT),
            Some(ProcStat {
                cpu: 1,
                threads: 1,
                ticks: 440
            })
        );
    }

    #[test]
    fn parses_this_process() {
        let text = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
        let st = parse_stat(&text);
        assert!(st.is_some_and(|s| s.threads >= 1), "{text:?} -> {st:?}");
    }

    #[test]
    fn rejects_truncated_lines() {
        let cut = &STAT[..STAT.find(" 17 1 0").unwrap_or(0)];
        assert_eq!(parse_stat(cut), None);
        assert_eq!(parse_stat("12 no parenthesis"), None);
    }

    proptest! {
        #[test]
        fn never_panics(s in ".{0,400}") {
            let _ = parse_stat(&s);
            let _ = parse_cpu_line(&s);
        }
    }

    #[test]
    fn cpu_line_counts_idle_and_iowait_as_idle() {
        let stat = "cpu  100 5 50 800 40 3 2 0 0 0\ncpu0 50 2 25 400 20 1 1 0 0 0\n";
        assert_eq!(parse_cpu_line(stat), Some((160, 1000)));
        assert_eq!(parse_cpu_line("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(parse_cpu_line("cpu  1 2 x 4 5 6 7 8\n"), None);
    }

    #[test]
    fn samples_this_machine() {
        let mut l = CpuLoad::default();
        assert_eq!(l.sample(), None);
        std::thread::sleep(Duration::from_millis(30));
        let b = l.sample();
        assert!(b.is_some_and(|b| (0.0..=1.0).contains(&b)), "{b:?}");
    }

    #[test]
    fn moves_after_a_streak_on_one_cpu() {
        let t = Instant::now();
        let mut f = Follow::default();
        assert_eq!(f.observe(Some(1), 0, t), None);
        assert_eq!(f.observe(Some(1), 0, t + LOOK_EVERY), Some(1));
        // Now on CPU 1 with its client: nothing to do.
        assert_eq!(f.observe(Some(1), 1, t + LOOK_EVERY * 2), None);
    }

    #[test]
    fn a_client_that_wanders_or_sleeps_breaks_the_streak() {
        let t = Instant::now();
        let mut f = Follow::default();
        assert_eq!(f.observe(Some(1), 0, t), None);
        assert_eq!(f.observe(Some(0), 0, t), None);
        assert_eq!(f.observe(Some(1), 0, t), None);
        assert_eq!(f.observe(None, 0, t), None);
        assert_eq!(f.observe(Some(2), 0, t), None);
        assert_eq!(f.observe(Some(1), 0, t), None);
        assert_eq!(f.observe(Some(1), 0, t), Some(1));
    }

    #[test]
    fn holds_between_moves_and_backs_off_when_chased() {
        let t = Instant::now();
        let mut f = Follow::default();
        f.observe(Some(1), 0, t);
        assert_eq!(f.observe(Some(1), 0, t), Some(1));
        // The client went back to CPU 0 at once: no move within the hold.
        let soon = t + MIN_HOLD / 2;
        f.observe(Some(0), 1, soon);
        assert_eq!(f.observe(Some(0), 1, soon), None);
        // Going straight back needs twice the hold.
        let later = t + MIN_HOLD + LOOK_EVERY;
        assert_eq!(f.observe(Some(0), 1, later), None);
        assert_eq!(f.observe(Some(0), 1, t + MIN_HOLD * 2), Some(0));
        assert_eq!(f.hold, MIN_HOLD * 2);
        // And once more: the hold keeps growing, to its cap.
        let t2 = t + MIN_HOLD * 2;
        let mut now = t2;
        let mut moved = false;
        for _ in 0..2000 {
            now += LOOK_EVERY;
            if f.observe(Some(1), 0, now).is_some() {
                moved = true;
                break;
            }
        }
        assert!(moved);
        assert!(
            now.duration_since(t2) >= MIN_HOLD * 4,
            "{:?}",
            now.duration_since(t2)
        );
        assert!(f.hold <= MAX_HOLD);
    }
}
