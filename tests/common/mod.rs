//! Shared helpers for the loopd end-to-end tests.
//!
//! Every test gets its own temporary directory, its own socket and (when TCP
//! is used) its own port, so tests can run in parallel threads.  Every process
//! started here is stopped by PID when its owner is dropped.
//!
//! External tools (qemu-io, nbdinfo, fio, ...) are *required*: a missing tool
//! fails the test with a message pointing at `scripts/install-test-deps.sh`.

#![allow(dead_code)]

pub mod flood;
pub mod gpt;
#[cfg(feature = "vm-tests")]
pub mod kernel;
pub mod pki;
pub mod tls;

use std::ffi::{OsStr, OsString};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

/// How long a server may take to print its "ready" lines.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Default time limit for one external tool invocation.
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);

// ---------------------------------------------------------------------------
// Parameter matrix
// ---------------------------------------------------------------------------

/// One (cache mode, logical block size) combination of the data-path matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Combo {
    pub cache: &'static str,
    pub block_size: u32,
}

impl Combo {
    pub const DIRECT_512: Combo = Combo {
        cache: "direct",
        block_size: 512,
    };
    pub const DIRECT_4096: Combo = Combo {
        cache: "direct",
        block_size: 4096,
    };
    pub const BUFFERED_512: Combo = Combo {
        cache: "buffered",
        block_size: 512,
    };
    pub const BUFFERED_4096: Combo = Combo {
        cache: "buffered",
        block_size: 4096,
    };
    pub const ALL: [Combo; 4] = [
        Combo::DIRECT_512,
        Combo::DIRECT_4096,
        Combo::BUFFERED_512,
        Combo::BUFFERED_4096,
    ];

    /// The `loopd serve` arguments selecting this combination.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--cache".to_string(),
            self.cache.to_string(),
            "--block-size".to_string(),
            self.block_size.to_string(),
        ]
    }

    pub fn bs(&self) -> u64 {
        u64::from(self.block_size)
    }
}

impl fmt::Display for Combo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cache={},block-size={}", self.cache, self.block_size)
    }
}

/// Generates, for each listed function `fn name(combo: Combo)`, a module
/// `name` with four tests: `direct_512`, `direct_4096`, `buffered_512`,
/// `buffered_4096`.  A failure is therefore reported as e.g.
/// `pattern_write_read::direct_4096`.
#[macro_export]
macro_rules! matrix_tests {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                use $crate::common::Combo;
                #[test]
                fn direct_512() {
                    super::$name(Combo::DIRECT_512)
                }
                #[test]
                fn direct_4096() {
                    super::$name(Combo::DIRECT_4096)
                }
                #[test]
                fn buffered_512() {
                    super::$name(Combo::BUFFERED_512)
                }
                #[test]
                fn buffered_4096() {
                    super::$name(Combo::BUFFERED_4096)
                }
            }
        )*
    };
}

// ---------------------------------------------------------------------------
// External tools
// ---------------------------------------------------------------------------

/// PATH for external tools: /usr/bin first, so that `nbdsh` (a wrapper that
/// runs `python3`) finds the system Python that has the `nbd` module rather
/// than e.g. a pyenv Python.
pub fn tool_path_env() -> OsString {
    let mut p = OsString::from("/usr/bin:/usr/sbin:/bin:/sbin");
    if let Some(old) = std::env::var_os("PATH") {
        p.push(":");
        p.push(old);
    }
    p
}

/// Looks a tool up on [`tool_path_env`].
pub fn which(name: &str) -> Option<PathBuf> {
    let path = tool_path_env();
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| {
            fs::metadata(p)
                .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
                .unwrap_or(false)
        })
}

/// Panics with a clear message if `name` is not installed.
pub fn require_tool(name: &str) -> PathBuf {
    which(name).unwrap_or_else(|| {
        panic!(
            "{name} not found: run scripts/install-test-deps.sh (as root) to install the test tools"
        )
    })
}

/// A `Command` for an external tool, with the tool PATH and no stdin.
pub fn tool(name: &str) -> Command {
    let path = require_tool(name);
    let mut c = Command::new(path);
    c.env("PATH", tool_path_env()).stdin(Stdio::null());
    c
}

/// Output of a finished process.
pub struct Out {
    pub desc: String,
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Panics (showing stdout and stderr) unless the process exited 0.
    pub fn assert_success(self) -> Out {
        if !self.status.success() {
            panic!(
                "command failed ({}): {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                self.status, self.desc, self.stdout, self.stderr
            );
        }
        self
    }
}

impl fmt::Display for Out {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} -> {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.desc, self.status, self.stdout, self.stderr
        )
    }
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        let a = a.to_string_lossy();
        if a.contains(|c: char| c.is_whitespace() || c == '\'' || c == '"') || a.is_empty() {
            s.push('\'');
            s.push_str(&a.replace('\'', "'\\''"));
            s.push('\'');
        } else {
            s.push_str(&a);
        }
    }
    s
}

fn drain<R: Read + Send + 'static>(mut r: R) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        v
    })
}

/// Runs `cmd` to completion (killing it after `timeout`), capturing output.
/// Does not look at the exit status.
pub fn run_cmd_timeout(mut cmd: Command, timeout: Duration) -> Out {
    use std::os::unix::process::CommandExt;
    let desc = describe(&cmd);
    // Its own process group, so a timeout kills the children too (fio's jobs),
    // which would otherwise hold the output pipes open.
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {desc}: {e}"));
    let out_h = drain(child.stdout.take().expect("stdout"));
    let err_h = drain(child.stderr.take().expect("stderr"));
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            break st;
        }
        if start.elapsed() > timeout {
            if let Ok(pid) = libc::pid_t::try_from(child.id()) {
                // SAFETY: kill(2) has no memory-safety preconditions; -pid names
                // the process group this child leads.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
            }
            let _ = child.kill();
            let _ = child.wait();
            // Not joined: a descendant in a session of its own (fio's jobs call
            // setsid) may hold the pipes open for as long as the server does.
            drop((out_h, err_h));
            panic!("command timed out after {timeout:?}: {desc}");
        }
        thread::sleep(Duration::from_millis(10));
    };
    let stdout = String::from_utf8_lossy(&out_h.join().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&err_h.join().unwrap_or_default()).into_owned();
    Out {
        desc,
        status,
        stdout,
        stderr,
    }
}

/// Runs a tool and returns its output whatever the exit status.
pub fn run_status<I, S>(name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run_status_timeout(TOOL_TIMEOUT, name, args)
}

/// Runs a tool (killed after `timeout`) and returns its output whatever the
/// exit status.
pub fn run_status_timeout<I, S>(timeout: Duration, name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = tool(name);
    c.args(args);
    run_cmd_timeout(c, timeout)
}

/// Runs a tool and panics (showing its stderr) on a non-zero exit.
pub fn run<I, S>(name: &str, args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    run_status(name, args).assert_success()
}

/// Runs qemu-io on a raw NBD URI with the given `-c` commands; panics unless
/// every command succeeded (exit status 0 and no verification failure).
pub fn qemu_io(uri: &str, cmds: &[&str]) -> Out {
    let out = qemu_io_status(uri, cmds);
    let all = format!("{}\n{}", out.stdout, out.stderr);
    if !out.success()
        || all.contains("Pattern verification failed")
        || all.contains("failed:")
        || all.contains("qemu-io:")
    {
        panic!("qemu-io reported a failure:\n{out}");
    }
    out
}

/// Like [`qemu_io`] but does not check the result.
pub fn qemu_io_status(uri: &str, cmds: &[&str]) -> Out {
    let mut args: Vec<String> = vec!["-f".into(), "raw".into(), uri.into()];
    for c in cmds {
        args.push("-c".into());
        args.push((*c).into());
    }
    run_status("qemu-io", &args)
}

/// Quotes a string as a Python string literal.
pub fn py_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c if c.is_ascii() && !c.is_ascii_control() => o.push(c),
            c => o.push_str(&format!("\\U{:08x}", u32::from(c))),
        }
    }
    o.push('"');
    o
}

/// Python helpers prepended to every nbdsh script.
pub const NBDSH_PRELUDE: &str = r#"
import errno, sys

def expect_err(what, fn, allowed):
    try:
        fn()
    except nbd.Error as e:
        if e.errnum not in allowed:
            raise AssertionError("%s: expected errno in %s, got %s (%s)" % (
                what, [errno.errorcode[a] for a in allowed], e.errno, e.string))
        print("%s: got expected %s" % (what, e.errno))
        return e.errnum
    raise AssertionError("%s: expected an error, but the command succeeded" % what)

def connect(uri, strict=None):
    g = nbd.NBD()
    if strict is not None:
        g.set_strict_mode(strict)
    g.add_meta_context("base:allocation")
    g.connect_uri(uri)
    return g
"#;

/// Runs a Python script under `nbdsh -c` (the handle `h` is created but not
/// connected; scripts connect themselves, e.g. with `connect(uri)` from
/// [`NBDSH_PRELUDE`]).  Panics with the script output unless it exited 0.
pub fn nbdsh(script: &str) -> Out {
    let code = format!("{NBDSH_PRELUDE}\n{script}\n");
    let out = run_status("nbdsh", ["-c", code.as_str()]);
    if out.stderr.contains("No module named nbd") || out.stderr.contains("No module named 'nbd'") {
        panic!(
            "the Python nbd module (python3-libnbd) is not available to nbdsh: \
             run scripts/install-test-deps.sh\n{out}"
        );
    }
    if !out.success() {
        panic!("nbdsh script failed:\n{out}\n--- script ---\n{script}");
    }
    out
}

// ---------------------------------------------------------------------------
// Minimal JSON parser (for nbdinfo/qemu-img/fio output; avoids extra deps)
// ---------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    /// Numbers keep their text so large integers stay exact.
    Num(String),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    pub fn parse(text: &str) -> Json {
        let mut p = JsonParser {
            s: text.as_bytes(),
            i: 0,
        };
        p.ws();
        let v = p
            .value()
            .unwrap_or_else(|e| panic!("invalid JSON ({e}) in:\n{text}"));
        p.ws();
        assert!(p.i == p.s.len(), "trailing data after JSON in:\n{text}");
        v
    }

    /// Parses the first JSON object in `text` (skipping any preamble lines).
    pub fn parse_first_object(text: &str) -> Json {
        let start = text
            .find("\n{")
            .map(|i| i + 1)
            .or_else(|| text.starts_with('{').then_some(0))
            .unwrap_or_else(|| panic!("no JSON object in:\n{text}"));
        Json::parse(&text[start..])
    }

    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(m) => m.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// `self[key]`, panicking with the document if it is missing.
    pub fn at(&self, key: &str) -> &Json {
        self.get(key)
            .unwrap_or_else(|| panic!("JSON key {key:?} missing in {self:?}"))
    }

    pub fn u64(&self) -> u64 {
        match self {
            Json::Num(n) => n
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("not an unsigned integer: {n}")),
            other => panic!("not a number: {other:?}"),
        }
    }

    pub fn i64(&self) -> i64 {
        match self {
            Json::Num(n) => n
                .parse::<i64>()
                .unwrap_or_else(|_| panic!("not an integer: {n}")),
            other => panic!("not a number: {other:?}"),
        }
    }

    pub fn bool(&self) -> bool {
        match self {
            Json::Bool(b) => *b,
            other => panic!("not a bool: {other:?}"),
        }
    }

    pub fn str(&self) -> &str {
        match self {
            Json::Str(s) => s,
            other => panic!("not a string: {other:?}"),
        }
    }

    pub fn arr(&self) -> &[Json] {
        match self {
            Json::Arr(a) => a,
            other => panic!("not an array: {other:?}"),
        }
    }
}

struct JsonParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl JsonParser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn lit(&mut self, word: &str, v: Json) -> Result<Json, String> {
        if self.s[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            Ok(v)
        } else {
            Err(format!("bad literal at {}", self.i))
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        match self.peek() {
            Some(b'{') => {
                self.i += 1;
                let mut m = Vec::new();
                self.ws();
                if self.peek() == Some(b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(m));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.ws();
                    if self.peek() != Some(b':') {
                        return Err(format!("expected ':' at {}", self.i));
                    }
                    self.i += 1;
                    self.ws();
                    let v = self.value()?;
                    m.push((k, v));
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(m));
                        }
                        _ => return Err(format!("expected ',' or '}}' at {}", self.i)),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.peek() == Some(b']') {
                    self.i += 1;
                    return Ok(Json::Arr(a));
                }
                loop {
                    self.ws();
                    a.push(self.value()?);
                    self.ws();
                    match self.peek() {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(a));
                        }
                        _ => return Err(format!("expected ',' or ']' at {}", self.i)),
                    }
                }
            }
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') => self.lit("true", Json::Bool(true)),
            Some(b'f') => self.lit("false", Json::Bool(false)),
            Some(b'n') => self.lit("null", Json::Null),
            Some(c) if c == b'-' || c.is_ascii_digit() => {
                let st = self.i;
                while self.i < self.s.len()
                    && matches!(
                        self.s[self.i],
                        b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
                    )
                {
                    self.i += 1;
                }
                Ok(Json::Num(
                    String::from_utf8_lossy(&self.s[st..self.i]).into_owned(),
                ))
            }
            _ => Err(format!("unexpected input at {}", self.i)),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        if self.peek() != Some(b'"') {
            return Err(format!("expected string at {}", self.i));
        }
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let c = self.peek().ok_or("unterminated string")?;
            self.i += 1;
            match c {
                b'"' => return Ok(String::from_utf8_lossy(&out).into_owned()),
                b'\\' => {
                    let e = self.peek().ok_or("bad escape")?;
                    self.i += 1;
                    match e {
                        b'n' => out.push(b'\n'),
                        b't' => out.push(b'\t'),
                        b'r' => out.push(b'\r'),
                        b'b' => out.push(8),
                        b'f' => out.push(12),
                        b'u' => {
                            let hex = self.s.get(self.i..self.i + 4).ok_or("bad \\u escape")?;
                            let cp = u32::from_str_radix(&String::from_utf8_lossy(hex), 16)
                                .map_err(|e| e.to_string())?;
                            self.i += 4;
                            let ch = char::from_u32(cp).unwrap_or('\u{fffd}');
                            let mut b = [0u8; 4];
                            out.extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                        }
                        other => out.push(other),
                    }
                }
                other => out.push(other),
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Images
// ---------------------------------------------------------------------------

/// Deterministic pseudo-random byte for file offset `off` (distinct per
/// `seed`); misplaced data (wrong offset) is detected.
pub fn pattern_byte(seed: u8, off: u64) -> u8 {
    let x = off
        .wrapping_add(u64::from(seed) << 40)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x.to_be_bytes()[0] ^ x.to_be_bytes()[3]
}

pub fn pattern_bytes(seed: u8, off: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| pattern_byte(seed, off + i))
        .collect()
}

/// Creates (or truncates) a sparse image of `size` bytes.
pub fn create_sparse_image(path: &Path, size: u64) {
    let f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(size).expect("set_len");
}

/// Creates an image of `size` bytes filled with [`pattern_byte`]`(seed, _)`.
pub fn create_pattern_image(path: &Path, size: u64, seed: u8) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let chunk = MIB;
    let mut off = 0;
    while off < size {
        let n = chunk.min(size - off);
        f.write_all(&pattern_bytes(seed, off, usize::try_from(n).unwrap()))
            .expect("write image");
        off += n;
    }
    f.sync_all().expect("sync");
}

/// Creates an image of `size` bytes where every byte is `byte`.
pub fn create_filled_image(path: &Path, size: u64, byte: u8) {
    let mut f = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    let buf = vec![byte; usize::try_from(MIB).unwrap()];
    let mut off = 0;
    while off < size {
        let n = MIB.min(size - off);
        f.write_all(&buf[..usize::try_from(n).unwrap()])
            .expect("write image");
        off += n;
    }
    f.sync_all().expect("sync");
}

/// Writes `data` at `off` into an existing file.
pub fn write_at(path: &Path, off: u64, data: &[u8]) {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all_at(data, off).expect("write_all_at");
    f.sync_all().expect("sync");
}

pub fn read_file(path: &Path) -> Vec<u8> {
    fs::read(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

pub fn read_range(path: &Path, off: u64, len: u64) -> Vec<u8> {
    let f = File::open(path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    let mut buf = vec![0u8; usize::try_from(len).unwrap()];
    f.read_exact_at(&mut buf, off)
        .unwrap_or_else(|e| panic!("read {} at {off}+{len}: {e}", path.display()));
    buf
}

pub fn file_len(path: &Path) -> u64 {
    fs::metadata(path)
        .unwrap_or_else(|e| panic!("stat {}: {e}", path.display()))
        .len()
}

/// Asserts two byte slices are equal, reporting the first differing offset
/// (relative to `base`) instead of dumping megabytes.
#[track_caller]
pub fn assert_bytes_eq(actual: &[u8], expected: &[u8], base: u64, ctx: &str) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{ctx}: length differs (actual {} vs expected {})",
        actual.len(),
        expected.len()
    );
    if let Some(i) = actual.iter().zip(expected).position(|(a, b)| a != b) {
        let end = (i + 16).min(actual.len());
        panic!(
            "{ctx}: bytes differ at offset {} (0x{:x}): actual {:02x?} expected {:02x?}",
            base + i as u64,
            base + i as u64,
            &actual[i..end],
            &expected[i..end]
        );
    }
}

/// Asserts every byte of `file[off..off+len]` equals `byte`.
#[track_caller]
pub fn assert_file_filled(path: &Path, off: u64, len: u64, byte: u8, ctx: &str) {
    let got = read_range(path, off, len);
    let want = vec![byte; got.len()];
    assert_bytes_eq(&got, &want, off, ctx);
}

/// Asserts `file[off..off+len]` equals the pattern `seed` at the same offsets.
#[track_caller]
pub fn assert_file_pattern(path: &Path, off: u64, len: u64, seed: u8, ctx: &str) {
    let got = read_range(path, off, len);
    let want = pattern_bytes(seed, off, got.len());
    assert_bytes_eq(&got, &want, off, ctx);
}

// ---------------------------------------------------------------------------
// Networking helpers
// ---------------------------------------------------------------------------

/// A free TCP port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local_addr").port()
}

// ---------------------------------------------------------------------------
// The loopd server
// ---------------------------------------------------------------------------

/// Path of the loopd binary under test.
pub fn loopd_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_loopd"))
}

/// Builder for a `loopd serve` process.
pub struct ServerBuilder {
    /// `None`: `loopd serve` without an image (a daemon with no default device).
    image: Option<PathBuf>,
    /// Ready when the `control: PATH` line is printed (instead of the URI line).
    ready_on_control: bool,
    args: Vec<OsString>,
    unix: bool,
    tcp: bool,
    name: Option<String>,
    socket_path: Option<PathBuf>,
    /// Process limits and umask for the server (set in the child before exec).
    limits: ChildLimits,
    /// Leave out the `--state` the harness adds (test the default path).
    default_state: bool,
    /// Extra environment for the server (e.g. `LOOPD_LOG`).
    envs: Vec<(OsString, OsString)>,
}

/// What a server process starts with, set between fork and exec.
#[derive(Clone, Copy, Default)]
pub struct ChildLimits {
    /// RLIMIT_NOFILE, soft and hard.
    pub nofile: Option<u64>,
    pub umask: Option<u32>,
}

impl ChildLimits {
    /// Apply to `cmd` (in the child, before exec).
    pub fn apply(self, cmd: &mut Command) {
        use std::os::unix::process::CommandExt;
        if self.nofile.is_none() && self.umask.is_none() {
            return;
        }
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls (setrlimit, umask).
        unsafe {
            cmd.pre_exec(move || {
                if let Some(n) = self.nofile {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some(m) = self.umask {
                    libc::umask(m);
                }
                Ok(())
            });
        }
    }
}

impl ServerBuilder {
    /// Start the server with this open-file limit (soft and hard).
    pub fn nofile(mut self, n: u64) -> Self {
        self.limits.nofile = Some(n);
        self
    }

    /// Start the server with this umask.
    pub fn umask(mut self, m: u32) -> Self {
        self.limits.umask = Some(m);
        self
    }

    /// Do not pass `--state` (by default the harness passes the control
    /// socket's path with extension `.state`, so parallel servers never share
    /// the persistent default state file).
    pub fn default_state(mut self) -> Self {
        self.default_state = true;
        self
    }

    /// Use this Unix socket path instead of a fresh one in a private tempdir.
    pub fn socket_path(mut self, p: &Path) -> Self {
        self.socket_path = Some(p.to_path_buf());
        self.unix = true;
        self
    }

    /// Extra arguments passed to `loopd serve` after the image.
    pub fn arg(mut self, a: impl AsRef<OsStr>) -> Self {
        self.args.push(a.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for a in args {
            self.args.push(a.as_ref().to_owned());
        }
        self
    }

    /// Adds `--cache X --block-size Y`.
    pub fn combo(self, c: Combo) -> Self {
        self.args(c.args())
    }

    /// Also wait for the `control: PATH` line (printed after the URI lines), so
    /// that [`Server::ctl`] works on a server started with an image.
    pub fn with_control(mut self) -> Self {
        self.ready_on_control = true;
        self
    }

    /// Sets `--name` (the empty string is allowed).
    pub fn name(mut self, n: &str) -> Self {
        self.name = Some(n.to_string());
        self
    }

    /// Also listen on TCP 127.0.0.1 (free port).
    pub fn tcp(mut self) -> Self {
        self.tcp = true;
        self
    }

    /// Set an environment variable for the server (e.g. `LOOPD_LOG=debug`).
    pub fn env(mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((key.as_ref().to_os_string(), value.as_ref().to_os_string()));
        self
    }

    /// Listen on TCP only (no --socket).
    pub fn tcp_only(mut self) -> Self {
        self.tcp = true;
        self.unix = false;
        self
    }

    /// Spawns the server and waits until it printed its ready line(s).
    pub fn start(self) -> Server {
        // A port from `free_port` is free when chosen, not necessarily when
        // loopd binds it (another test's client may take it as its ephemeral
        // port in between): try again with another port.
        for attempt in 1.. {
            match self.start_once() {
                Ok(s) => return s,
                Err(e) if self.tcp && attempt < 4 && e.contains("Address already in use") => {
                    eprintln!("retrying with another port: {e}");
                }
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the loop returns or panics")
    }

    /// One try of [`ServerBuilder::start`]: the server, or why it exited before
    /// it was ready.
    fn start_once(&self) -> Result<Server, String> {
        let dir = tempfile::Builder::new()
            .prefix("loopd-sock")
            .tempdir()
            .expect("tempdir");
        let export_name = self.name.clone().unwrap_or_else(|| {
            self.image
                .as_deref()
                .and_then(Path::file_stem)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        let socket = self.unix.then(|| {
            self.socket_path
                .clone()
                .unwrap_or_else(|| dir.path().join("nbd.sock"))
        });
        let port = self.tcp.then(free_port);

        let mut cmd = Command::new(loopd_bin());
        cmd.arg("serve");
        if let Some(img) = &self.image {
            cmd.arg(img);
        }
        if let Some(s) = &socket {
            cmd.arg("--socket").arg(s);
        }
        if let Some(p) = port {
            cmd.arg("--listen").arg(format!("127.0.0.1:{p}"));
        }
        if let Some(n) = &self.name {
            cmd.arg("--name").arg(n);
        }
        cmd.args(&self.args);
        self.limits.apply(&mut cmd);
        let has = |flag: &str| {
            self.args.iter().any(|a| {
                let a = a.to_string_lossy();
                a == flag || a.starts_with(&format!("{flag}="))
            })
        };
        if !self.default_state && !has("--state") {
            let ctl = self
                .args
                .iter()
                .position(|a| a == "--control")
                .and_then(|i| self.args.get(i + 1))
                .map(PathBuf::from)
                .or_else(|| socket.as_ref().map(|s| s.with_extension("ctl")))
                .unwrap_or_else(|| dir.path().join("nbd.ctl"));
            cmd.arg("--state").arg(ctl.with_extension("state"));
        }
        cmd.envs(self.envs.iter().map(|(k, v)| (k, v)));
        cmd.env("PATH", tool_path_env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let desc = describe(&cmd);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {desc}: {e}"));
        let pid = child.id();

        let stderr_buf = Arc::new(Mutex::new(Vec::new()));
        {
            let buf = Arc::clone(&stderr_buf);
            let mut err = child.stderr.take().expect("stderr");
            thread::spawn(move || {
                let mut chunk = [0u8; 4096];
                loop {
                    match err.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.lock().unwrap().extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
        let stdout_lines = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel::<String>();
        {
            let lines = Arc::clone(&stdout_lines);
            let out = child.stdout.take().expect("stdout");
            thread::spawn(move || {
                for line in BufReader::new(out).lines() {
                    let Ok(line) = line else { break };
                    lines.lock().unwrap().push(line.clone());
                    let _ = tx.send(line);
                }
            });
        }

        let mut server = Server {
            child: Some(child),
            pid,
            desc,
            name: export_name,
            socket,
            port,
            stderr: stderr_buf,
            stdout_lines,
            control: None,
            _dir: dir,
        };

        let (want_unix, want_tcp) = if self.ready_on_control {
            // The control line is printed last, after every URI line.
            (Some("control: ".to_string()), None)
        } else {
            (
                server.socket.as_ref().map(|_| server.uri()),
                server.port.map(|_| server.tcp_uri()),
            )
        };
        let mut seen_unix = want_unix.is_none();
        let mut seen_tcp = want_tcp.is_none();
        let deadline = Instant::now() + READY_TIMEOUT;
        while !(seen_unix && seen_tcp) {
            if let Some(st) = server.try_wait() {
                return Err(format!(
                    "loopd exited ({st}) before it was ready: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                    server.desc,
                    server.stdout_lines.lock().unwrap().join("\n"),
                    server.stderr_text()
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                panic!(
                    "loopd not ready after {READY_TIMEOUT:?} (expected stdout lines containing {:?} {:?}): {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                    want_unix,
                    want_tcp,
                    server.desc,
                    server.stdout_lines.lock().unwrap().join("\n"),
                    server.stderr_text()
                );
            }
            match rx.recv_timeout((deadline - now).min(Duration::from_millis(50))) {
                Ok(line) => {
                    if let Some(u) = &want_unix {
                        seen_unix |= line.contains(u.as_str());
                    }
                    if let Some(u) = &want_tcp {
                        seen_tcp |= line.contains(u.as_str());
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // stdout closed; the exit check above reports it.
                    thread::sleep(Duration::from_millis(20));
                }
            }
        }
        if self.ready_on_control {
            let line = server
                .stdout_lines
                .lock()
                .unwrap()
                .iter()
                .find_map(|l| l.strip_prefix("control: ").map(PathBuf::from));
            server.control = line;
        }
        Ok(server)
    }
}

/// A running `loopd serve`.  Dropping it stops the process (SIGTERM, then
/// SIGKILL after a timeout) by PID and reaps it.
pub struct Server {
    child: Option<Child>,
    pid: u32,
    desc: String,
    name: String,
    socket: Option<PathBuf>,
    port: Option<u16>,
    stderr: Arc<Mutex<Vec<u8>>>,
    stdout_lines: Arc<Mutex<Vec<String>>>,
    /// The control socket, as printed on the `control: PATH` ready line
    /// (daemon mode, see [`Server::daemon`]).
    control: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

fn send_signal(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("pid fits pid_t");
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is the PID of
    // a child we spawned and have not reaped yet, so it cannot refer to an
    // unrelated process.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        // ESRCH cannot happen for an unreaped child; anything else is a bug.
        panic!("kill({pid}, {sig}) failed: {e}");
    }
}

impl Server {
    /// Starts configuring a server for `image`.
    pub fn builder(image: &Path) -> ServerBuilder {
        ServerBuilder {
            image: Some(image.to_path_buf()),
            ready_on_control: false,
            args: Vec::new(),
            unix: true,
            tcp: false,
            name: None,
            socket_path: None,
            limits: ChildLimits::default(),
            default_state: false,
            envs: Vec::new(),
        }
    }

    /// Starts configuring `loopd serve` without an image (a daemon that starts
    /// with no default device; devices come from --config, the state file or
    /// `loopd attach`).  It counts as ready once it printed `control: PATH`.
    pub fn daemon() -> ServerBuilder {
        ServerBuilder {
            image: None,
            ready_on_control: true,
            args: Vec::new(),
            unix: true,
            tcp: false,
            name: None,
            socket_path: None,
            limits: ChildLimits::default(),
            default_state: false,
            envs: Vec::new(),
        }
    }

    /// Starts a Unix-socket server for `image` with the given combination.
    pub fn start(image: &Path, combo: Combo) -> Server {
        Server::builder(image).combo(combo).start()
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn socket(&self) -> &Path {
        self.socket.as_deref().expect("server has no unix socket")
    }

    /// `nbd+unix:///NAME?socket=PATH`
    pub fn uri(&self) -> String {
        self.uri_for_name(&self.name)
    }

    /// A Unix URI for another export name on the same socket.
    pub fn uri_for_name(&self, name: &str) -> String {
        format!(
            "nbd+unix:///{}?socket={}",
            pct(name),
            pct(&self.socket().display().to_string())
        )
    }

    /// `nbd://127.0.0.1:PORT/NAME`
    pub fn tcp_uri(&self) -> String {
        let port = self.port.expect("server has no TCP listener");
        if self.name.is_empty() {
            format!("nbd://127.0.0.1:{port}")
        } else {
            format!("nbd://127.0.0.1:{port}/{}", pct(&self.name))
        }
    }

    pub fn port(&self) -> u16 {
        self.port.expect("server has no TCP listener")
    }

    pub fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    pub fn stdout_text(&self) -> String {
        self.stdout_lines.lock().unwrap().join("\n")
    }

    /// Returns the exit status if the process has exited (reaping it).
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().expect("try_wait"))
    }

    /// Panics (with the server's stderr) unless the process is still running.
    #[track_caller]
    pub fn assert_running(&mut self) {
        if let Some(st) = self.try_wait() {
            panic!(
                "loopd died unexpectedly ({st}):\n--- stderr ---\n{}",
                self.stderr_text()
            );
        }
    }

    /// Sends a signal to the server process.
    pub fn signal(&mut self, sig: libc::c_int) {
        assert!(
            self.try_wait().is_none(),
            "cannot signal loopd: it already exited\n{}",
            self.stderr_text()
        );
        send_signal(self.pid, sig);
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.try_wait() {
                return Some(st);
            }
            if start.elapsed() > timeout {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGTERM and wait (10 s) for a clean exit; returns the exit status.
    /// Panics (after SIGKILL) if the server does not stop in time.
    pub fn stop(&mut self) -> ExitStatus {
        self.stop_with(libc::SIGTERM)
    }

    pub fn stop_with(&mut self, sig: libc::c_int) -> ExitStatus {
        self.signal(sig);
        match self.wait_timeout(Duration::from_secs(10)) {
            Some(st) => st,
            None => {
                send_signal(self.pid, libc::SIGKILL);
                let _ = self.child.as_mut().map(|c| c.wait());
                panic!(
                    "loopd did not exit within 10 s of signal {sig}\n--- stderr ---\n{}",
                    self.stderr_text()
                );
            }
        }
    }

    /// SIGTERM, then assert exit status 0.
    pub fn stop_ok(&mut self) {
        let st = self.stop();
        assert!(
            st.success(),
            "loopd exited with {st} after SIGTERM (expected 0)\n--- stderr ---\n{}",
            self.stderr_text()
        );
    }

    /// `kill -9` the server and reap it.
    pub fn kill9(&mut self) -> ExitStatus {
        self.signal(libc::SIGKILL);
        let st = self
            .wait_timeout(Duration::from_secs(10))
            .expect("SIGKILLed process did not exit");
        assert_eq!(st.signal(), Some(libc::SIGKILL), "unexpected status {st}");
        st
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.is_none() {
            return;
        }
        if thread::panicking() {
            eprintln!(
                "--- loopd ({}) stderr ---\n{}\n--- end loopd stderr ---",
                self.desc,
                self.stderr_text()
            );
        }
        let Some(child) = self.child.as_mut() else {
            return;
        };
        if let Ok(None) = child.try_wait() {
            send_signal(self.pid, libc::SIGTERM);
            let start = Instant::now();
            loop {
                match child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if start.elapsed() > Duration::from_secs(5) => {
                        send_signal(self.pid, libc::SIGKILL);
                        let _ = child.wait();
                        break;
                    }
                    Ok(None) => thread::sleep(Duration::from_millis(10)),
                }
            }
        }
        self.child = None;
    }
}

/// Runs `loopd` with arbitrary arguments (not as a long-running server).
pub fn loopd_run<I, S>(args: I) -> Out
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    let mut c = Command::new(loopd_bin());
    c.args(args).stdin(Stdio::null());
    run_cmd_timeout(c, Duration::from_secs(20))
}

// ---------------------------------------------------------------------------
// Raw NBD client (for malformed-traffic tests)
// ---------------------------------------------------------------------------

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;

/// A hand-rolled NBD client over a Unix socket.
pub struct RawClient {
    pub s: UnixStream,
}

impl RawClient {
    /// Connects with 10 s read/write timeouts.
    pub fn connect(socket: &Path) -> RawClient {
        let s = UnixStream::connect(socket)
            .unwrap_or_else(|e| panic!("connect {}: {e}", socket.display()));
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
        RawClient { s }
    }

    pub fn read_exact(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.s
            .read_exact(&mut b)
            .unwrap_or_else(|e| panic!("reading {n} bytes from loopd: {e}"));
        b
    }

    pub fn read_u16(&mut self) -> u16 {
        u16::from_be_bytes(self.read_exact(2).try_into().unwrap())
    }

    pub fn read_u32(&mut self) -> u32 {
        u32::from_be_bytes(self.read_exact(4).try_into().unwrap())
    }

    pub fn read_u64(&mut self) -> u64 {
        u64::from_be_bytes(self.read_exact(8).try_into().unwrap())
    }

    pub fn send(&mut self, data: &[u8]) {
        self.s
            .write_all(data)
            .unwrap_or_else(|e| panic!("writing {} bytes to loopd: {e}", data.len()));
    }

    /// Sends bytes the server may legitimately refuse to read (it may already
    /// have closed the connection): EPIPE/ECONNRESET are ignored.
    pub fn send_lossy(&mut self, data: &[u8]) {
        match self.s.write_all(data) {
            Ok(()) => {}
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {}
            Err(e) => panic!("writing {} bytes to loopd: {e}", data.len()),
        }
    }

    /// Reads and checks the server greeting; returns the handshake flags.
    pub fn greeting(&mut self) -> u16 {
        let m = self.read_u64();
        assert_eq!(m, NBDMAGIC, "bad server magic 0x{m:x}");
        let o = self.read_u64();
        assert_eq!(o, IHAVEOPT, "server is not newstyle (got 0x{o:x})");
        let flags = self.read_u16();
        assert!(
            flags & 1 != 0,
            "server does not advertise NBD_FLAG_FIXED_NEWSTYLE (flags 0x{flags:x})"
        );
        flags
    }

    /// Full handshake with NBD_OPT_EXPORT_NAME; returns (client, size, transmission flags).
    pub fn handshake(socket: &Path, name: &str) -> (RawClient, u64, u16) {
        let mut c = RawClient::connect(socket);
        let hflags = c.greeting();
        // FIXED_NEWSTYLE | NO_ZEROES (only if the server offers NO_ZEROES).
        let no_zeroes = hflags & 2 != 0;
        let cflags: u32 = if no_zeroes { 3 } else { 1 };
        c.send(&cflags.to_be_bytes());
        c.send_option(NBD_OPT_EXPORT_NAME, name.as_bytes());
        let size = c.read_u64();
        let tflags = c.read_u16();
        if !no_zeroes {
            c.read_exact(124);
        }
        assert!(
            tflags & 1 != 0,
            "NBD_FLAG_HAS_FLAGS not set (flags 0x{tflags:x})"
        );
        (c, size, tflags)
    }

    pub fn send_option(&mut self, opt: u32, data: &[u8]) {
        let mut b = Vec::new();
        b.extend_from_slice(&IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&u32::try_from(data.len()).unwrap().to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    pub fn request_bytes(
        magic: u32,
        flags: u16,
        typ: u16,
        handle: u64,
        off: u64,
        len: u32,
    ) -> Vec<u8> {
        let mut b = Vec::with_capacity(28);
        b.extend_from_slice(&magic.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&typ.to_be_bytes());
        b.extend_from_slice(&handle.to_be_bytes());
        b.extend_from_slice(&off.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b
    }

    pub fn send_request(&mut self, flags: u16, typ: u16, handle: u64, off: u64, len: u32) {
        let b = Self::request_bytes(REQUEST_MAGIC, flags, typ, handle, off, len);
        self.send(&b);
    }

    /// Reads a simple reply header; returns (error, handle).
    pub fn read_simple_reply(&mut self) -> (u32, u64) {
        let m = self.read_u32();
        assert_eq!(m, SIMPLE_REPLY_MAGIC, "bad simple reply magic 0x{m:x}");
        let err = self.read_u32();
        let handle = self.read_u64();
        (err, handle)
    }

    /// NBD_CMD_READ; asserts success and returns the data.
    pub fn read(&mut self, handle: u64, off: u64, len: u32) -> Vec<u8> {
        self.send_request(0, NBD_CMD_READ, handle, off, len);
        let (err, h) = self.read_simple_reply();
        assert_eq!(h, handle, "reply handle mismatch");
        assert_eq!(err, 0, "read {off}+{len} failed with NBD error {err}");
        self.read_exact(usize::try_from(len).unwrap())
    }

    /// NBD_CMD_WRITE; returns the NBD error value (0 = success).
    pub fn write(&mut self, handle: u64, off: u64, data: &[u8]) -> u32 {
        self.write_flags(0, handle, off, data)
    }

    /// NBD_CMD_WRITE with command flags (e.g. FUA); returns the NBD error value.
    pub fn write_flags(&mut self, flags: u16, handle: u64, off: u64, data: &[u8]) -> u32 {
        self.send_request(
            flags,
            NBD_CMD_WRITE,
            handle,
            off,
            u32::try_from(data.len()).unwrap(),
        );
        self.send(data);
        let (err, h) = self.read_simple_reply();
        assert_eq!(h, handle, "reply handle mismatch");
        err
    }

    /// Waits (up to the read timeout) for the server to close the connection.
    /// Any bytes the server sends before closing are returned.
    #[track_caller]
    pub fn expect_closed(&mut self, ctx: &str) -> Vec<u8> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match self.s.read(&mut buf) {
                Ok(0) => return got,
                Ok(n) => {
                    got.extend_from_slice(&buf[..n]);
                    assert!(
                        got.len() < 1 << 20,
                        "{ctx}: server keeps sending data instead of closing"
                    );
                }
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return got,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    panic!("{ctx}: server did not close the connection within 10 s")
                }
                Err(e) => panic!("{ctx}: unexpected read error {e}"),
            }
        }
    }
}

/// Temporary directory for a test's images.
/// A path as the `&str` a command line or script wants (test paths are UTF-8).
pub fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// Unmounts a test's mount when dropped (also when the test fails); a failed
/// umount is reported on stderr.
pub struct Unmount(pub PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let out = run_status("umount", [self.0.as_os_str()]);
        if !out.success() {
            eprintln!("umount {} failed:\n{out}", self.0.display());
        }
    }
}

/// A read-only bind mount of `dir` at `dir/mnt` (needs root): a file under
/// it cannot be opened for writing, whatever its mode. Unmounted when the
/// guard drops.
pub fn read_only_bind(dir: &Path) -> (PathBuf, Unmount) {
    let mnt = dir.join("mnt");
    fs::create_dir(&mnt).expect("mkdir mnt");
    run("mount", ["--bind", path_str(dir), path_str(&mnt)]);
    let guard = Unmount(mnt.clone());
    run("mount", ["-o", "remount,ro,bind", path_str(&mnt)]);
    (mnt, guard)
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("loopd-e2e")
        .tempdir()
        .expect("tempdir")
}

// ---------------------------------------------------------------------------
// The control plane: `loopd attach/detach/list/status/set/resize`
// ---------------------------------------------------------------------------

/// Runs `loopd ARGS --control CONTROL` (a client command) to completion.
pub fn loopd_ctl(control: &Path, args: &[&str]) -> Out {
    let mut c = Command::new(loopd_bin());
    c.args(args).arg("--control").arg(control);
    c.env_remove("LOOPD_CONTROL").stdin(Stdio::null());
    run_cmd_timeout(c, Duration::from_secs(60))
}

/// The machine code a failed client command ends its message with, e.g.
/// `busy` for "loopd: error: … (busy)".
pub fn error_code(out: &Out) -> Option<String> {
    let line = out.stderr.lines().rev().find(|l| !l.trim().is_empty())?;
    let line = line.trim_end();
    let inner = line.strip_suffix(')')?;
    let open = inner.rfind('(')?;
    Some(inner[open + 1..].to_string())
}

/// Percent-encodes `s` for an NBD URI (every byte but RFC 3986's unreserved
/// ones and `/`), written here independently of loopd's encoder.
pub fn pct(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// The exit status `loopd` documents (in `--help` and the README) for a
/// failure with machine code `code`.
pub fn exit_status_for(code: &str) -> i32 {
    match code {
        "usage" => 2,
        "not_running" | "shutting_down" => 3,
        "not_found" => 4,
        "busy" => 5,
        "name_taken" => 6,
        "invalid" | "bad_request" | "unsupported_version" => 7,
        "unavailable" => 8,
        _ => 1,
    }
}

/// Asserts a client command failed with the exit status of `code` and the
/// machine code `code` at the end of its error message.
#[track_caller]
pub fn assert_ctl_error(out: &Out, code: &str) {
    assert!(
        !out.success(),
        "expected failure with ({code}), but the command succeeded:\n{out}"
    );
    assert_eq!(
        out.status.code(),
        Some(exit_status_for(code)),
        "wrong exit status for ({code}):\n{out}"
    );
    assert!(
        out.stderr.contains("loopd: error:"),
        "error message missing on stderr:\n{out}"
    );
    assert_eq!(
        error_code(out).as_deref(),
        Some(code),
        "wrong error code:\n{out}"
    );
}

impl Server {
    /// The control socket (daemon mode only).
    pub fn control(&self) -> &Path {
        self.control
            .as_deref()
            .expect("no control line seen (start the server with Server::daemon())")
    }

    /// Runs a client command against this daemon (whatever its exit status).
    pub fn ctl(&self, args: &[&str]) -> Out {
        loopd_ctl(self.control(), args)
    }

    /// Runs a client command and panics unless it exited 0.
    #[track_caller]
    pub fn ctl_ok(&self, args: &[&str]) -> Out {
        let out = self.ctl(args);
        if !out.success() {
            panic!("loopd client command failed:\n{out}");
        }
        out
    }

    /// Runs a client command and asserts it failed with `code`.
    #[track_caller]
    pub fn ctl_err(&self, args: &[&str], code: &str) -> Out {
        let out = self.ctl(args);
        assert_ctl_error(&out, code);
        out
    }

    /// Runs a client command with `--json` and parses its output.
    #[track_caller]
    pub fn ctl_json(&self, args: &[&str]) -> Json {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.ctl_ok(&a);
        Json::parse(&out.stdout)
    }

    /// One of device `name`'s path counters from `loopd status` (`spliced`,
    /// `buffered`, `inline_cached`, ...).
    #[track_caller]
    pub fn path_count(&self, name: &str, path: &str) -> u64 {
        self.ctl_json(&["status", name]).at("paths").at(path).u64()
    }

    /// `loopd list --json`: the devices.
    #[track_caller]
    pub fn list_json(&self) -> Vec<Json> {
        self.ctl_json(&["list"]).arr().to_vec()
    }

    /// The device named `name` in `loopd list --json`, if any.
    #[track_caller]
    pub fn device(&self, name: &str) -> Option<Json> {
        self.list_json()
            .into_iter()
            .find(|d| d.at("name").str() == name)
    }

    /// Names of all devices, in listing order.
    #[track_caller]
    pub fn device_names(&self) -> Vec<String> {
        self.list_json()
            .iter()
            .map(|d| d.at("name").str().to_string())
            .collect()
    }

    /// Polls `list` until `name` has `n` clients (panics after `timeout`).
    #[track_caller]
    pub fn wait_clients(&self, name: &str, n: u64, timeout: Duration) {
        let start = Instant::now();
        loop {
            let d = self.device(name);
            let got = d.as_ref().map(|d| d.at("clients").u64());
            if got == Some(n) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "device {name:?} did not reach {n} client(s) within {timeout:?} (now {got:?})"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls `list` until `name` is gone; returns how long it took, or `None`
    /// if it was still there after `timeout`.
    pub fn wait_gone(&self, name: &str, timeout: Duration) -> Option<Duration> {
        let start = Instant::now();
        loop {
            if self.device(name).is_none() {
                return Some(start.elapsed());
            }
            if start.elapsed() > timeout {
                return None;
            }
            thread::sleep(Duration::from_millis(25));
        }
    }

    /// All stdout lines printed so far.
    pub fn stdout_lines(&self) -> Vec<String> {
        self.stdout_lines.lock().unwrap().clone()
    }
}

/// A raw connection to the control socket: one JSON line per request.
pub struct ControlConn {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl ControlConn {
    pub fn connect(path: &Path) -> ControlConn {
        let s = UnixStream::connect(path)
            .unwrap_or_else(|e| panic!("connect control socket {}: {e}", path.display()));
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(30))).unwrap();
        ControlConn {
            w: s.try_clone().expect("clone control stream"),
            r: BufReader::new(s),
        }
    }

    /// Sends raw bytes (no newline is added).
    pub fn send_raw(&mut self, data: &[u8]) {
        self.w.write_all(data).expect("write control request");
    }

    /// Reads one reply line and parses it.
    pub fn read_reply(&mut self) -> Json {
        let mut line = String::new();
        let n = self
            .r
            .read_line(&mut line)
            .expect("read control reply (timed out?)");
        assert!(n > 0, "the daemon closed the control connection");
        assert!(line.ends_with('\n'), "reply line not terminated: {line:?}");
        Json::parse(line.trim_end())
    }

    /// Sends one request line and returns the parsed reply.
    pub fn request(&mut self, line: &str) -> Json {
        self.send_raw(format!("{line}\n").as_bytes());
        self.read_reply()
    }

    /// Sends a request that must succeed; returns its `result`.
    #[track_caller]
    pub fn ok(&mut self, line: &str) -> Json {
        let r = self.request(line);
        assert_eq!(r.at("v").u64(), 1, "reply to {line}: {r:?}");
        assert_eq!(r.at("ok"), &Json::Bool(true), "reply to {line}: {r:?}");
        assert!(r.get("error").is_none(), "reply to {line}: {r:?}");
        r.at("result").clone()
    }

    /// Sends a request that must fail with `code`; returns the error message.
    #[track_caller]
    pub fn err(&mut self, line: &str, code: &str) -> String {
        let r = self.request(line);
        assert_reply_error(&r, code, line)
    }
}

/// Asserts a control reply is `{"v":1,"ok":false,"error":{"code":CODE,"message":…}}`.
#[track_caller]
pub fn assert_reply_error(r: &Json, code: &str, ctx: &str) -> String {
    assert_eq!(r.at("v").u64(), 1, "reply to {ctx}: {r:?}");
    assert_eq!(r.at("ok"), &Json::Bool(false), "reply to {ctx}: {r:?}");
    assert!(r.get("result").is_none(), "reply to {ctx}: {r:?}");
    let e = r.at("error");
    assert_eq!(e.at("code").str(), code, "reply to {ctx}: {r:?}");
    let msg = e.at("message").str().to_string();
    assert!(!msg.is_empty(), "empty error message in reply to {ctx}");
    msg
}

/// `nbdinfo --size URI`.
#[track_caller]
pub fn nbd_size(uri: &str) -> u64 {
    let out = run("nbdinfo", ["--size", uri]);
    out.stdout
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("nbdinfo --size printed {:?}", out.stdout))
}

/// `nbdinfo --json URI`: the first export's object.
#[track_caller]
pub fn nbd_info(uri: &str) -> Json {
    let out = run("nbdinfo", ["--json", uri]);
    let doc = Json::parse(&out.stdout);
    doc.at("exports").arr()[0].clone()
}

impl Json {
    /// Any JSON number as `f64` (fio prints some as floats).
    pub fn f64(&self) -> f64 {
        match self {
            Json::Num(n) => n
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("not a number: {n}")),
            other => panic!("not a number: {other:?}"),
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }
}

// ---------------------------------------------------------------------------
// Kernel loop devices (`loopd kernel …`)
// ---------------------------------------------------------------------------

/// The loop number of `/dev/loopN`.
pub fn loop_number(dev: &Path) -> u32 {
    dev.to_str()
        .and_then(|s| s.strip_prefix("/dev/loop"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{} is not /dev/loopN", dev.display()))
}

/// `/sys/block/loopN/REL`, trimmed; `None` if it does not exist.
pub fn loop_sysfs(dev: &Path, rel: &str) -> Option<String> {
    fs::read_to_string(format!("/sys/block/loop{}/{rel}", loop_number(dev)))
        .ok()
        .map(|s| s.trim().to_string())
}

/// A kernel loop device this test attached.  Dropping it detaches the
/// device — but only while it is still backed by this test's image, so a
/// device number reused by someone else is never touched.
pub struct KernelLoop {
    pub dev: PathBuf,
    pub image: PathBuf,
}

impl KernelLoop {
    /// `loopd kernel attach IMAGE ARGS`: asserts success and returns a guard.
    /// The guard is created as soon as a device path is printed, before any
    /// other assertion, so a device is never leaked.
    #[track_caller]
    pub fn attach(image: &Path, args: &[&str]) -> (KernelLoop, Out) {
        let mut c = Command::new(loopd_bin());
        c.arg("kernel").arg("attach").arg(image).args(args);
        c.stdin(Stdio::null());
        let out = run_cmd_timeout(c, Duration::from_secs(30));
        let guard = if args.contains(&"--json") {
            out.stdout
                .lines()
                .find_map(|l| {
                    let l = l.trim();
                    let rest = l.strip_prefix("\"device\":")?;
                    Some(
                        rest.trim()
                            .trim_end_matches(',')
                            .trim_matches('"')
                            .to_string(),
                    )
                })
                .map(PathBuf::from)
        } else {
            out.stdout
                .lines()
                .next()
                .filter(|l| l.starts_with("/dev/loop"))
                .map(|l| PathBuf::from(l.trim()))
        }
        .map(|dev| KernelLoop {
            dev,
            image: image.to_path_buf(),
        });
        match guard {
            Some(g) if out.success() => (g, out),
            Some(g) => {
                drop(g);
                panic!("loopd kernel attach printed a device but failed:\n{out}")
            }
            None => panic!("loopd kernel attach failed:\n{out}"),
        }
    }

    /// Whether the device is (still) backed by this guard's image.
    pub fn is_ours(&self) -> bool {
        let Some(b) = loop_sysfs(&self.dev, "loop/backing_file") else {
            return false;
        };
        let want = fs::canonicalize(&self.image).unwrap_or_else(|_| self.image.clone());
        Path::new(&b) == want || Path::new(&b) == self.image
    }

    pub fn sysfs(&self, rel: &str) -> Option<String> {
        loop_sysfs(&self.dev, rel)
    }

    /// Size of the block device in bytes (sysfs `size` is in 512-byte sectors).
    pub fn size(&self) -> u64 {
        let sectors: u64 = self
            .sysfs("size")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no sysfs size for {}", self.dev.display()));
        sectors * 512
    }

    /// Waits (up to 5 s) until the device is no longer backed by our image
    /// (another test may already have reused the number for its own image).
    pub fn wait_detached(&self) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5) {
            if !self.is_ours() {
                return true;
            }
            thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for KernelLoop {
    fn drop(&mut self) {
        if !self.is_ours() {
            return;
        }
        let out = loopd_run([
            OsStr::new("kernel"),
            OsStr::new("detach"),
            self.dev.as_os_str(),
        ]);
        if !out.success() && self.is_ours() {
            // Fall back to losetup (the device is still ours).
            let _ = run_status("losetup", [OsStr::new("-d"), self.dev.as_os_str()]);
        }
        if !self.wait_detached() {
            eprintln!(
                "warning: {} is still attached to {} after detach",
                self.dev.display(),
                self.image.display()
            );
        }
    }
}
