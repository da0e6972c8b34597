//! `loopd kernel …`: kernel loop devices set up in one step.

use anyhow::Result;
use clap::{Subcommand, ValueEnum};
use loopd::kernel_loop::{self, DirectIo, KernelParams};
use loopd::size::{parse_block_size, parse_size};
use std::path::PathBuf;

#[derive(Subcommand)]
#[command(defer = true)]
pub enum KernelCmd {
    /// Set up /dev/loopN for IMAGE with one LOOP_CONFIGURE; prints the device
    /// (with --partscan, then each partition's node, one per line).
    Attach(KernelAttach),
    /// Detach kernel loop devices (LOOP_CLR_FD), like `losetup -d DEV...`;
    /// `-D`/`--all` detaches every loop device with a backing file (`losetup -D`).
    Detach(KernelDetach),
    /// List kernel loop devices with a backing file.
    List {
        /// Print JSON in `losetup -J`'s shape.
        #[arg(long, short = 'J')]
        json: bool,
        /// Every device (accepted for `losetup -a`; list always shows all).
        #[arg(long, short = 'a')]
        all: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Dio {
    /// Direct I/O where the file allows it (the result says whether it is on).
    Auto,
    /// Direct I/O or fail (no device is left behind).
    On,
    Off,
}

#[derive(clap::Args)]
pub struct KernelDetach {
    /// The devices, e.g. /dev/loop3.
    #[arg(required_unless_present = "all", conflicts_with = "all")]
    devices: Vec<PathBuf>,
    /// Detach every loop device that has a backing file (`losetup -D`).
    #[arg(long, short = 'D')]
    all: bool,
    /// Print the detached devices as JSON.
    #[arg(long, short = 'J')]
    json: bool,
}

#[derive(clap::Args)]
pub struct KernelAttach {
    /// The image file.
    image: PathBuf,
    /// Start of the window in the file, in bytes.
    #[arg(long, short = 'o', value_name = "BYTES", value_parser = parse_size, default_value = "0")]
    offset: u64,
    /// Size of the window; `none` or 0: to the end of the file (the default).
    #[arg(
        long,
        visible_alias = "sizelimit",
        value_name = "BYTES|none",
        value_parser = super::args::parse_limit
    )]
    size_limit: Option<super::args::Limit>,
    /// Logical block size [default: the file's direct-I/O alignment, so that
    /// direct I/O is really on].
    #[arg(
        long,
        short = 'b',
        visible_alias = "sector-size",
        value_name = "BYTES",
        value_parser = parse_block_size
    )]
    block_size: Option<u32>,
    /// Direct I/O to the backing file.
    #[arg(long, value_enum, default_value = "auto")]
    direct_io: Dio,
    /// Read-only device.
    #[arg(long, short = 'r')]
    read_only: bool,
    /// Remove the device when its last user closes it.
    #[arg(long)]
    autoclear: bool,
    /// Set it up even though another writer (a loopd device, QEMU) has the
    /// image open, or one that does not share writing when --read-only
    /// (QEMU's force-share). Default: refused, as `loopd attach` does.
    #[arg(long)]
    shared: bool,
    /// Declare the image's format: `raw` uses its bytes as they are, even if
    /// they look like qcow2, vmdk, ... [default: probe and refuse non-raw
    /// images].
    #[arg(long, value_enum, value_name = "FORMAT")]
    format: Option<super::args::Format>,
    /// Scan the device for partitions: turned on after the device is
    /// configured, under a BSD lock (no udev race); returns once every
    /// partition node (/dev/loopNpK) exists.
    #[arg(long, short = 'P')]
    partscan: bool,
    /// Accepted for `losetup -f --show`: loopd always takes the first free
    /// device and prints it. `-f` is losetup's here (on `serve` and `attach`
    /// it is qemu-nbd's --format, which has no short spelling here).
    #[arg(long, short = 'f')]
    find: bool,
    /// Accepted for `losetup --show`: the device is always printed.
    #[arg(long)]
    show: bool,
    /// Print JSON (device, block size, direct I/O, partitions) instead of
    /// the device path.
    #[arg(long, short = 'J')]
    json: bool,
}

pub fn run(cmd: KernelCmd) -> Result<()> {
    match cmd {
        KernelCmd::Attach(a) => {
            let p = KernelParams {
                image: a.image,
                offset: a.offset,
                // The kernel's lo_sizelimit: 0 is no limit.
                size_limit: a.size_limit.and_then(|l| l.0).unwrap_or(0),
                block_size: a.block_size,
                direct_io: match a.direct_io {
                    Dio::Auto => DirectIo::Auto,
                    Dio::On => DirectIo::On,
                    Dio::Off => DirectIo::Off,
                },
                read_only: a.read_only,
                autoclear: a.autoclear,
                partscan: a.partscan,
                shared: a.shared,
                format: a.format.map(Into::into),
            };
            let r = kernel_loop::attach(&p)?;
            if r.write_protected {
                eprintln!(
                    "loopd: note: {} is write-protected: {} is read-only",
                    loopd::text::quoted_path(&p.image),
                    r.device.display()
                );
            }
            if a.json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("{}", r.device.display());
                for part in &r.partitions {
                    println!("{}", part.device.display());
                }
                if matches!(a.direct_io, Dio::Auto) && !r.direct_io {
                    eprintln!(
                        "loopd: note: the kernel did not enable direct I/O on {} (block size {})",
                        r.device.display(),
                        r.block_size
                    );
                }
            }
            Ok(())
        }
        KernelCmd::Detach(d) => detach(d),
        KernelCmd::List { json, all: _ } => {
            let l = kernel_loop::list();
            if json {
                println!("{}", serde_json::to_string_pretty(&losetup_json(&l))?);
                return Ok(());
            }
            println!(
                "{:<12} {:>10} {:>10} {:>5} {:>3} {:>2} {:>9} BACKING",
                "DEVICE", "OFFSET", "SIZELIMIT", "BLOCK", "DIO", "RO", "AUTOCLEAR"
            );
            for e in l {
                println!(
                    "{:<12} {:>10} {:>10} {:>5} {:>3} {:>2} {:>9} {}",
                    e.device.display(),
                    e.offset,
                    e.size_limit,
                    e.block_size,
                    u8::from(e.direct_io),
                    u8::from(e.read_only),
                    u8::from(e.autoclear),
                    super::print::esc(&e.backing_file)
                );
            }
            Ok(())
        }
    }
}

/// `kernel detach DEV...` / `-D`: every device is tried; the first failure is
/// the command's error (after the others were detached).
fn detach(d: KernelDetach) -> Result<()> {
    let devices = if d.all {
        kernel_loop::list().into_iter().map(|e| e.device).collect()
    } else {
        d.devices
    };
    let mut done = Vec::new();
    let mut first_err = None;
    for dev in devices {
        match kernel_loop::detach(&dev) {
            Ok(()) => done.push(dev),
            // The first failure is the command's error; later ones are told here.
            Err(e) if first_err.is_none() => first_err = Some(e),
            Err(e) => eprintln!(
                "loopd: {}: {}",
                loopd::text::quoted_path(&dev),
                loopd::text::sanitize_line(&e.to_string())
            ),
        }
    }
    if d.json {
        println!("{}", serde_json::json!({ "detached": done }));
    }
    match first_err {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// One device in `losetup -J`'s shape (its field names, order and types).
#[derive(serde::Serialize)]
struct LosetupEntry {
    name: PathBuf,
    sizelimit: u64,
    offset: u64,
    autoclear: bool,
    ro: bool,
    #[serde(rename = "back-file")]
    back_file: String,
    dio: bool,
    #[serde(rename = "log-sec")]
    log_sec: u32,
}

#[derive(serde::Serialize)]
struct LosetupList {
    loopdevices: Vec<LosetupEntry>,
}

fn losetup_json(l: &[kernel_loop::LoopEntry]) -> LosetupList {
    LosetupList {
        loopdevices: l
            .iter()
            .map(|e| LosetupEntry {
                name: e.device.clone(),
                sizelimit: e.size_limit,
                offset: e.offset,
                autoclear: e.autoclear,
                ro: e.read_only,
                back_file: e.backing_file.clone(),
                dio: e.direct_io,
                log_sec: e.block_size,
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(subcommand)]
        k: KernelCmd,
    }

    /// `kernel detach -D` is not run by the e2e tests (it detaches every loop
    /// device on the machine); its command line is checked here.
    #[test]
    fn detach_takes_devices_or_all() {
        assert!(T::try_parse_from(["t", "detach", "-D"]).is_ok());
        assert!(T::try_parse_from(["t", "detach", "--all"]).is_ok());
        assert!(T::try_parse_from(["t", "detach"]).is_err());
        assert!(T::try_parse_from(["t", "detach", "-D", "/dev/loop1"]).is_err());
        match T::try_parse_from(["t", "detach", "/dev/loop1", "/dev/loop2"]).map(|t| t.k) {
            Ok(KernelCmd::Detach(d)) => assert_eq!(d.devices.len(), 2),
            _ => panic!("two devices"),
        }
        assert!(T::try_parse_from(["t", "list", "-J", "-a"]).is_ok());
        assert!(T::try_parse_from(["t", "attach", "x.img", "-f", "--show", "-r", "-P"]).is_ok());
    }

    /// `--size-limit` reads as everywhere else: `none` and 0 are no limit
    /// (the kernel's lo_sizelimit 0).
    #[test]
    fn attach_size_limit_none_is_zero() {
        let limit = |v: &str| match T::try_parse_from(["t", "attach", "x.img", "--size-limit", v])
            .map(|t| t.k)
        {
            Ok(KernelCmd::Attach(a)) => a.size_limit.and_then(|l| l.0),
            _ => panic!("{v}"),
        };
        assert_eq!(limit("none"), None);
        assert_eq!(limit("0"), None);
        assert_eq!(limit("1M"), Some(1 << 20));
    }
}
