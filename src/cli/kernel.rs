//! `loopd kernel …`: kernel loop devices set up in one step.

use anyhow::Result;
use clap::{Subcommand, ValueEnum};
use loopd::kernel_loop::{self, DirectIo, KernelParams};
use loopd::size::parse_size;
use std::path::PathBuf;

#[derive(Subcommand)]
pub enum KernelCmd {
    /// Set up /dev/loopN for IMAGE with one LOOP_CONFIGURE; prints the device
    /// (with --partscan, then each partition's node, one per line).
    Attach(KernelAttach),
    /// Detach a kernel loop device (LOOP_CLR_FD).
    Detach {
        /// The device, e.g. /dev/loop3.
        device: PathBuf,
    },
    /// List kernel loop devices with a backing file.
    List {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
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
pub struct KernelAttach {
    /// The image file.
    image: PathBuf,
    /// Start of the window in the file, in bytes.
    #[arg(long, value_name = "BYTES", value_parser = parse_size, default_value = "0")]
    offset: u64,
    /// Size of the window (0 = to the end of the file).
    #[arg(long, value_name = "BYTES", value_parser = parse_size, default_value = "0")]
    size_limit: u64,
    /// Logical block size [default: the file's direct-I/O alignment, so that
    /// direct I/O is really on].
    #[arg(long, value_name = "BYTES")]
    block_size: Option<u32>,
    /// Direct I/O to the backing file.
    #[arg(long, value_enum, default_value = "auto")]
    direct_io: Dio,
    /// Read-only device.
    #[arg(long)]
    read_only: bool,
    /// Remove the device when its last user closes it.
    #[arg(long)]
    autoclear: bool,
    /// Scan the device for partitions: turned on after the device is
    /// configured, under a BSD lock (no udev race); returns once every
    /// partition node (/dev/loopNpK) exists.
    #[arg(long)]
    partscan: bool,
    /// Print JSON (device, block size, direct I/O, partitions) instead of
    /// the device path.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: KernelCmd) -> Result<()> {
    match cmd {
        KernelCmd::Attach(a) => {
            let p = KernelParams {
                image: a.image,
                offset: a.offset,
                size_limit: a.size_limit,
                block_size: a.block_size,
                direct_io: match a.direct_io {
                    Dio::Auto => DirectIo::Auto,
                    Dio::On => DirectIo::On,
                    Dio::Off => DirectIo::Off,
                },
                read_only: a.read_only,
                autoclear: a.autoclear,
                partscan: a.partscan,
            };
            let r = kernel_loop::attach(&p)?;
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
        KernelCmd::Detach { device } => {
            kernel_loop::detach(&device)?;
            Ok(())
        }
        KernelCmd::List { json } => {
            let l = kernel_loop::list();
            if json {
                println!("{}", serde_json::to_string_pretty(&l)?);
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
                    e.backing_file
                );
            }
            Ok(())
        }
    }
}
