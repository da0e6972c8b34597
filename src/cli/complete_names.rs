//! Device names in the completion scripts: where a command takes a device's
//! name (its positional argument is `name` or `names`: `detach`, `set`,
//! `status`, `resize`), the script offers the names of the running server's
//! devices, asked with `loopd list --names` (honouring a `--control` already
//! typed, else `$LOOPD_CONTROL`); where it takes kernel loop devices
//! (`kernel detach`), the loop devices with a backing file (sysfs). No server
//! running: nothing is offered (and no file names either).
//!
//! Bash gets a wrapper around clap's function that finds the subcommand and
//! the position (skipping options and the values of those that take one,
//! taken from the command definition); fish gets one `complete` line per
//! command; zsh's `_default` action of those arguments is replaced by a
//! function asking the server. Other shells: clap's script as it is.

use clap::Command;
use clap_complete::Shell;

/// What a command's positional argument takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// loopd device names (`list --names`).
    Device,
    /// Kernel loop devices with a backing file.
    Loop,
}

/// A command taking names: its path (`["kernel", "detach"]`), the kind, whether
/// it takes several, and its options that take a value (bash skips it).
struct Target {
    path: Vec<String>,
    kind: Kind,
    many: bool,
    valued: Vec<String>,
}

fn targets(cmd: &Command, prefix: &[String], out: &mut Vec<Target>, groups: &mut Vec<String>) {
    // Not clap's own `help` (the scripts are made without it).
    let shown = cmd
        .get_subcommands()
        .filter(|s| !s.is_hide_set() && s.get_name() != "help");
    for s in shown {
        let mut path = prefix.to_vec();
        path.push(s.get_name().to_owned());
        if s.has_subcommands() {
            groups.push(path.join(" "));
            targets(s, &path, out, groups);
            continue;
        }
        let pos = s.get_positionals().find(|a| !a.is_hide_set());
        let Some(pos) = pos else { continue };
        let kind = match (pos.get_id().as_str(), path.first().map(String::as_str)) {
            ("name" | "names", _) => Kind::Device,
            ("devices", Some("kernel")) => Kind::Loop,
            _ => continue,
        };
        let many = pos.get_num_args().is_some_and(|r| r.max_values() > 1);
        let mut valued = Vec::new();
        for a in s.get_arguments().filter(|a| !a.is_positional()) {
            let takes = a.get_action().takes_values()
                && a.get_num_args().is_none_or(|r| r.min_values() >= 1);
            if !takes {
                continue;
            }
            valued.extend(
                a.get_short_and_visible_aliases()
                    .into_iter()
                    .flatten()
                    .map(|c| format!("-{c}")),
            );
            valued.extend(
                a.get_long_and_visible_aliases()
                    .into_iter()
                    .flatten()
                    .map(|l| format!("--{l}")),
            );
        }
        out.push(Target {
            path,
            kind,
            many,
            valued,
        });
    }
}

/// `script` (clap's, for `shell`) with device names added; `full` is the
/// built command.
pub fn add(shell: Shell, full: &Command, script: Vec<u8>) -> Vec<u8> {
    let mut ts = Vec::new();
    let mut groups = Vec::new();
    targets(full, &[], &mut ts, &mut groups);
    let Ok(text) = String::from_utf8(script) else {
        return Vec::new();
    };
    let out = match shell {
        Shell::Bash => format!("{text}{}", bash(&ts, &groups)),
        Shell::Fish => format!("{text}{}", fish(&ts)),
        Shell::Zsh => zsh(&text, &ts),
        _ => text,
    };
    out.into_bytes()
}

const HEADER: &str = "\n# Device names (added by loopd): where a command takes a device's name, the\n\
# names of the running server's devices (loopd list --names); none when no server runs.\n";

fn bash(ts: &[Target], groups: &[String]) -> String {
    let mut cases = String::new();
    for t in ts {
        let kind = match t.kind {
            Kind::Device => "device",
            Kind::Loop => "loop",
        };
        cases.push_str(&format!(
            "            \"{}\") kind={kind} many={} valued=' {} ' ;;\n",
            t.path.join(" "),
            if t.many { "1" } else { "" },
            t.valued.join(" ")
        ));
    }
    for g in groups {
        cases.push_str(&format!("            \"{g}\") ;;\n"));
    }
    format!(
        r#"{HEADER}
# Succeeds when the cursor is at a device name; prints the candidates.
_loopd_device_names() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" i w sub= kind= many= valued= skip= npos=0
    local -a ctl=()
    for ((i = 1; i < COMP_CWORD; i++)); do
        w="${{COMP_WORDS[i]}}"
        if [[ -n $skip ]]; then skip=; continue; fi
        case "$w" in
        --control) ctl=(--control "${{COMP_WORDS[i+1]}}"); skip=1; continue ;;
        --control=*) ctl=("$w"); continue ;;
        -*) [[ $valued == *" $w "* ]] && skip=1; continue ;;
        esac
        if [[ -n $kind ]]; then npos=$((npos + 1)); continue; fi
        sub="${{sub:+$sub }}$w"
        case "$sub" in
{cases}            *) return 1 ;;
        esac
    done
    [[ -n $kind && -z $skip && $cur != -* ]] || return 1
    [[ -n $many || $npos -eq 0 ]] || return 1
    if [[ $kind == loop ]]; then
        for w in /sys/block/loop*/loop/backing_file; do
            [[ -e $w ]] || continue
            w="${{w#/sys/block/}}"
            printf '/dev/%s\n' "${{w%%/*}}"
        done
    else
        "${{COMP_WORDS[0]}}" list --names "${{ctl[@]}}" 2>/dev/null
    fi
    return 0
}}

_loopd_with_device_names() {{
    local names n cur="${{COMP_WORDS[COMP_CWORD]}}"
    if names=$(_loopd_device_names); then
        COMPREPLY=()
        compopt +o default +o bashdefault 2>/dev/null
        while IFS= read -r n; do
            [[ -n $n && $n == "$cur"* ]] && COMPREPLY+=("$(printf '%q' "$n")")
        done <<< "$names"
        return 0
    fi
    _loopd "$@"
}}
complete -F _loopd_with_device_names -o nosort -o bashdefault -o default loopd
"#
    )
}

fn fish(ts: &[Target]) -> String {
    let mut out = String::from(HEADER);
    for t in ts {
        let cond = match t.path.as_slice() {
            [one] => format!("__fish_loopd_using_subcommand {one}"),
            [group, sub] => format!(
                "__fish_loopd_using_subcommand {group}; and __fish_seen_subcommand_from {sub}"
            ),
            _ => continue,
        };
        // Kernel loop devices: bash only.
        if t.kind != Kind::Device {
            continue;
        }
        let source = "(loopd list --names 2>/dev/null)";
        out.push_str(&format!(
            "complete -c loopd -n \"{cond}\" -f -a \"{source}\"\n"
        ));
    }
    out
}

/// zsh: each name argument's `_default` action becomes `_loopd_device_names`
/// (defined before clap's closing `compdef`).
fn zsh(text: &str, ts: &[Target]) -> String {
    let mut out = String::new();
    let mut replaced = false;
    for line in text.split_inclusive('\n') {
        let t = line.trim_start();
        let is_name_arg = (t.starts_with("':name -- ")
            || t.starts_with("'::name -- ")
            || t.starts_with("'*::names -- ")
            || t.starts_with("'*:names -- "))
            && ts.iter().any(|t| t.kind == Kind::Device);
        if is_name_arg && line.contains(":_default'") {
            out.push_str(&line.replacen(":_default'", ":_loopd_device_names'", 1));
            replaced = true;
        } else {
            out.push_str(line);
        }
    }
    if !replaced {
        return text.to_owned();
    }
    let helper = format!(
        "{HEADER}_loopd_device_names() {{\n    local -a names\n    names=(${{(f)\"$(loopd list --names 2>/dev/null)\"}})\n    compadd -a names\n}}\n\n"
    );
    match out.rfind("if [ \"$funcstack[1]\" = \"_loopd\" ]") {
        Some(i) => format!("{}{helper}{}", &out[..i], &out[i..]),
        None => format!("{out}{helper}"),
    }
}

/// `loopd list --names` (hidden; what the scripts ask): the devices' names,
/// one a line, missing ones included; a name a shell could not be offered
/// whole (a control character, a newline) is left out.
pub fn print_names(v: &serde_json::Value) {
    let devs = v["devices"].as_array().cloned().unwrap_or_default();
    for d in &devs {
        if let Some(n) = d["name"]
            .as_str()
            .filter(|n| !n.chars().any(char::is_control))
        {
            println!("{n}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction};

    fn sample() -> Command {
        let mut c = Command::new("loopd")
            .subcommand(
                Command::new("detach")
                    .arg(Arg::new("names").num_args(1..).required(true))
                    .arg(Arg::new("control").long("control"))
                    .arg(Arg::new("force").long("force").action(ArgAction::SetTrue)),
            )
            .subcommand(Command::new("attach").arg(Arg::new("images")))
            .subcommand(
                Command::new("kernel")
                    .subcommand(Command::new("detach").arg(Arg::new("devices").num_args(0..))),
            );
        c.build();
        c
    }

    #[test]
    fn targets_are_the_commands_taking_names() {
        let mut ts = Vec::new();
        let mut groups = Vec::new();
        targets(&sample(), &[], &mut ts, &mut groups);
        let paths: Vec<String> = ts.iter().map(|t| t.path.join(" ")).collect();
        assert_eq!(paths, ["detach", "kernel detach"]);
        assert_eq!(groups, ["kernel"]);
        assert!(ts[0].many);
        assert_eq!(ts[0].valued, ["--control"]);
        assert!(ts[1].kind == Kind::Loop);
    }

    #[test]
    fn bash_wraps_clap_function() {
        let s = String::from_utf8(add(Shell::Bash, &sample(), b"_loopd() { :; }\n".to_vec()))
            .expect("utf-8");
        assert!(
            s.contains("\"detach\") kind=device many=1 valued=' --control ' ;;"),
            "{s}"
        );
        assert!(s.contains("complete -F _loopd_with_device_names"), "{s}");
    }
}
