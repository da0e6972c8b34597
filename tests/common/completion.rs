//! A user's `<TAB>` in bash, run against a generated completion script.

use super::tools::{run_cmd_timeout, tool};
use std::path::Path;
use std::time::Duration;

/// What bash offers for `words` (the cursor at the end of the last one) with
/// the completion script `script` sourced and, where given,
/// `LOOPD_CONTROL=control` (the server whose device names it may ask for).
pub fn bash_complete(script: &Path, control: Option<&Path>, words: &[&str]) -> Vec<String> {
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
    c.arg("--norc").arg("-c").arg(program);
    if let Some(control) = control {
        c.env("LOOPD_CONTROL", control);
    }
    let out = run_cmd_timeout(c, Duration::from_secs(30)).assert_success();
    out.stdout
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}
