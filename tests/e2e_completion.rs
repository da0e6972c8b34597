//! Issue 27 point 7: the bash completion (`loopd completions bash`) offers the
//! names of the running server's devices where a command takes one, asked of
//! the server itself; nothing when no server runs. The generated function is
//! run in bash as a user's `<TAB>` would run it.

mod common;

use common::*;

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
            bash_complete(&script, Some(&ctl), &[bin, cmd, ""]),
            names,
            "loopd {cmd}"
        );
    }
    assert_eq!(
        bash_complete(&script, Some(&ctl), &[bin, "set", "a"]),
        ["alpha"]
    );
    // After an option's value, still a name.
    assert_eq!(
        bash_complete(
            &script,
            Some(&ctl),
            &[bin, "set", "--size-limit", "1M", "b"]
        ),
        ["beta"]
    );
    // The --control on the line wins over $LOOPD_CONTROL.
    let nowhere = dir.path().join("nowhere.ctl");
    let ctl_s = ctl.to_str().expect("utf-8");
    assert_eq!(
        bash_complete(
            &script,
            Some(&nowhere),
            &[bin, "detach", "--control", ctl_s, "al"]
        ),
        ["alpha"]
    );
    // Not where no name goes: set takes one, attach takes images, options stay options.
    assert!(
        !bash_complete(&script, Some(&ctl), &[bin, "set", "alpha", ""])
            .contains(&"beta".to_owned()),
        "set takes one name"
    );
    assert!(
        !bash_complete(&script, Some(&ctl), &[bin, "attach", ""]).contains(&"alpha".to_owned()),
        "attach offered device names"
    );
    assert_eq!(
        bash_complete(&script, Some(&ctl), &[bin, "detach", "--fo"]),
        ["--force"]
    );
    // Subcommands are still completed.
    assert_eq!(bash_complete(&script, Some(&ctl), &[bin, "at"]), ["attach"]);
    // No server: nothing at all (not file names either).
    assert!(
        bash_complete(&script, Some(&nowhere), &[bin, "detach", ""]).is_empty(),
        "offered something without a server"
    );
}
