//! NBD client tools as a test drives them: `qemu-io`, `nbdsh` (libnbd's Python
//! shell, with [`NBDSH_PRELUDE`]) and `nbdinfo`.

use super::json::{Json, JsonExt};
use super::tools::{Out, run, run_status};

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
