//! `loopd attach`: one image (one `attach` request, as always), or several —
//! on the command line and/or listed in a file or on stdin (`--from FILE|-`)
//! — in one `attach_batch` request, so the daemon records them all with one
//! durable write. Each device succeeds or fails on its own: the successes
//! print as a single attach does, each failure one `loopd: error:` line naming
//! its image; the exit status is that of the first failure (0 if none).

use super::args::DeviceArgs;
use super::exit::{BatchFailed, DaemonError, UsageError, print_item_error};
use super::print::print_device;
use anyhow::{Context, Result, bail};
use loopd::control::client;
use loopd::control::proto::{ErrorBody, Request};
use std::io::Read;
use std::path::{Path, PathBuf};

/// The images a `--from` list names: one per line; blank lines and lines
/// starting with `#` are skipped; leading and trailing blanks are trimmed.
pub fn parse_list(text: &str) -> Vec<PathBuf> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(PathBuf::from)
        .collect()
}

/// Read `--from FILE` (`-`: stdin).
fn read_list(from: &Path) -> Result<Vec<PathBuf>> {
    let mut text = String::new();
    if from == Path::new("-") {
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read the list of images from stdin")?;
    } else {
        text = std::fs::read_to_string(from)
            .with_context(|| format!("cannot read the list of images {}", from.display()))?;
    }
    Ok(parse_list(&text))
}

/// Run `loopd attach`.
pub fn run(
    ctl: &Path,
    mut images: Vec<PathBuf>,
    from: Option<&Path>,
    dev: &DeviceArgs,
    autoclear: bool,
    json: bool,
) -> Result<()> {
    let single = images.len() == 1 && from.is_none();
    if let Some(f) = from {
        images.extend(read_list(f)?);
    }
    if images.is_empty() {
        bail!(usage(
            "no image given: name one or more, or a list with --from FILE|-"
        ));
    }
    if images.len() > 1 && dev.name.is_some() {
        bail!(usage(
            "--name names one device: it cannot be given with several images"
        ));
    }
    let specs: Vec<_> = images
        .iter()
        .map(|i| {
            let mut s = dev.spec(i.clone());
            s.autoclear = autoclear;
            s
        })
        .collect();
    if single {
        let spec = specs.into_iter().next().unwrap_or_default();
        let v = answer(client::call(ctl, &Request::Attach(Box::new(spec)))?)?;
        return print_device(&v, json);
    }
    let v = answer(client::call(ctl, &Request::AttachBatch { devices: specs })?)?;
    let items = v["devices"].as_array().cloned().unwrap_or_default();
    if items.len() != images.len() {
        bail!(
            "the daemon answered {} outcome(s) for {} image(s)",
            items.len(),
            images.len()
        );
    }
    let mut first: Option<ErrorBody> = None;
    let mut failed = 0;
    let mut out = Vec::new();
    for (image, item) in images.iter().zip(&items) {
        if item["ok"].as_bool() == Some(true) {
            if !json {
                print_device(&item["result"], false)?;
            }
        } else {
            failed += 1;
            let e: ErrorBody = serde_json::from_value(item["error"].clone())
                .context("malformed outcome in the daemon's reply")?;
            print_item_error(&loopd::text::quoted_path(image).to_string(), &e);
            first.get_or_insert(e);
        }
        let mut o = item.clone();
        o["image"] = serde_json::Value::from(image.to_string_lossy().into_owned());
        out.push(o);
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    match first {
        None => Ok(()),
        Some(e) => Err(BatchFailed {
            failed,
            total: images.len(),
            what: "image(s) not attached",
            code: e.code,
        }
        .into()),
    }
}

/// The daemon's answer, or its error.
fn answer(r: Result<serde_json::Value, ErrorBody>) -> Result<serde_json::Value> {
    r.map_err(|e| DaemonError(e).into())
}

fn usage(msg: &str) -> UsageError {
    UsageError(msg.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_lines_are_paths() {
        let l = parse_list("# images\n/a.img\n\n  /b c.img  \r\n#/skipped\n/d.img");
        let want: Vec<PathBuf> = ["/a.img", "/b c.img", "/d.img"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(l, want);
    }
}
