//! Issue 27 point 7: the bash completion (`loopd completions bash`) offers the
//! names of the running server's devices where a command takes one, asked of
//! the server itself; nothing when no server runs. The generated function is
//! run in bash as a user's `<TAB>` would run it.

mod common;

use common::*;
use std::path::Path;
use std::time::Duration;

/// What bash offers for `words` (the cursor at the end of the last one),
/// with the completion script `script` sourced and `LOOPD_CONTROL=control`.
fn complete(script: &Path, control: &Path, words: &[&str]) -> Vec<String> {
    let cword = words.len() - 1;
    let quoted: Vec<String> = words.iter().map(|w| format!("'{w}'")).collect();
    let line = words.join(" ");
    let program = format!(
        r#"source '{script}' || exit 3
spec=$(complete -p loopd) || exit 4
fn=$(printf '%s\n' "$spec" | sed -n 's/.*-F \([^ ]*\).*/\1/p')
[ -n "$fn" ] || exit 5
COMP_WORDS=({words})
COMP_CWORD={cword}
COMP_LINE='{line}'
COMP_POINT=${{#COMP_LINE}}
"$fn" '{first}' '{cur}' '{prev}'
printf '%s\n' "${{COMPREPLY[@]}}"
"#,
        script = script.display(),
        words = quoted.join(" "),
        first = words[0],
        cur = words[cword],
        prev = words[cword - 1],
    );
    let mut c = tool("bash");
    c.arg("--norc")
        .arg("-c")
        .arg(program)
        .env("LOOPD_CONTROL", control);
    let out = run_cmd_timeout(c, Duration::from_secs(30)).assert_success();
    out.stdout
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

#[test]
fn bash_completes_the_names_of_the_running_servers_devices() {
    let dir = tempdir();
    let script = dir.path().join("loopd.bash");
    let script_out = loopd_run(["completions", "bash"]);
    assert!(script_out.success(), "{script_out}");
    std::fs::write(&script, &script_out.stdout).expect("write script");
    for n in ["alpha", "beta"] {
        create_sparse_image(&dir.path().join(format!("{n}.img")), MIB);
    }
    let srv = Server::daemon().start();
    let ctl = srv.control().to_path_buf();
    for n in ["alpha", "beta"] {
        srv.ctl_ok(&[
            "attach",
            dir.path().join(format!("{n}.img")).to_str().expect("utf-8"),
        ]);
    }
    let bin = loopd_bin();
    let bin = bin.to_str().expect("utf-8");
    let names = ["alpha", "beta"].map(String::from).to_vec();
    for cmd in ["detach", "set", "status", "resize"] {
        assert_eq!(
            complete(&script, &ctl, &[bin, cmd, ""]),
            names,
            "loopd {cmd}"
        );
    }
    assert_eq!(complete(&script, &ctl, &[bin, "set", "a"]), ["alpha"]);
    // After an option's value, still a name.
    assert_eq!(
        complete(&script, &ctl, &[bin, "set", "--size-limit", "1M", "b"]),
        ["beta"]
    );
    // The --control on the line wins over $LOOPD_CONTROL.
    let nowhere = dir.path().join("nowhere.ctl");
    let ctl_s = ctl.to_str().expect("utf-8");
    assert_eq!(
        complete(
            &script,
            &nowhere,
            &[bin, "detach", "--control", ctl_s, "al"]
        ),
        ["alpha"]
    );
    // Not where no name goes: set takes one, attach takes images, options stay options.
    assert!(
        !complete(&script, &ctl, &[bin, "set", "alpha", ""]).contains(&"beta".to_owned()),
        "set takes one name"
    );
    assert!(
        !complete(&script, &ctl, &[bin, "attach", ""]).contains(&"alpha".to_owned()),
        "attach offered device names"
    );
    assert_eq!(
        complete(&script, &ctl, &[bin, "detach", "--fo"]),
        ["--force"]
    );
    // Subcommands are still completed.
    assert_eq!(complete(&script, &ctl, &[bin, "at"]), ["attach"]);
    // No server: nothing at all (not file names either).
    assert!(
        complete(&script, &nowhere, &[bin, "detach", ""]).is_empty(),
        "offered something without a server"
    );
}
