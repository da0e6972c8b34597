//! The `loopd` command line. Subcommands only; the work is in the library.

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use loopd::device::{CacheMode, Device, DeviceParams};
use loopd::server::{self, Registry, ServeOptions};
use loopd::size::parse_size;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

/// A userspace loop device: serves disk-image files as block devices over NBD,
/// with direct, asynchronous I/O (io_uring).
#[derive(Parser)]
#[command(name = "loopd", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve an image file as an NBD export, in the foreground, until Ctrl-C/SIGTERM.
    Serve(ServeArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum Cache {
    /// Direct I/O where the filesystem allows it, else buffered (and say which).
    Auto,
    /// O_DIRECT: keep the image out of the page cache; fail if the filesystem refuses.
    Direct,
    /// Through the page cache.
    Buffered,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// The image file (or block device) to serve.
    image: PathBuf,
    /// NBD Unix socket to listen on [default: /run/loopd/loopd.sock for root,
    /// else $XDG_RUNTIME_DIR/loopd/loopd.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// Also (or only) listen on TCP, e.g. 127.0.0.1:10809 (NBD's port). Repeatable.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Vec<String>,
    /// Export name [default: the image's file stem]; the empty name also works.
    #[arg(long)]
    name: Option<String>,
    /// Create a sparse image of this size (e.g. 1G; K/M/G/T) if IMAGE does not exist.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    create: Option<u64>,
    /// Start of the exported window in the file, in bytes (like losetup --offset).
    #[arg(long, value_name = "BYTES", value_parser = parse_size, default_value = "0")]
    offset: u64,
    /// Size of the exported window (like losetup --sizelimit); may reach past the
    /// end of the file, which then reads as zeros [default: to the end of the file].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    size_limit: Option<u64>,
    /// Logical block size: 512, 1024, 2048 or 4096 [default: the file's direct-I/O
    /// alignment (statx), else the filesystem device's block size, else 512].
    #[arg(long, value_name = "BYTES")]
    block_size: Option<u32>,
    /// How to reach the file: auto, direct (O_DIRECT) or buffered (page cache).
    #[arg(long, value_enum, default_value = "auto")]
    cache: Cache,
    /// Refuse writes (EPERM) and advertise the export as read-only.
    #[arg(long)]
    read_only: bool,
    /// Reactor threads, each with its own io_uring [default: one per core].
    #[arg(long, value_name = "N", default_value = "0")]
    reactors: usize,
    /// Benchmark switch: one lock for the whole device instead of byte ranges.
    #[arg(long, hide = true)]
    whole_device_lock: bool,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOOPD_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Serve(a) => serve(a),
    }
}

fn serve(a: ServeArgs) -> Result<()> {
    let name = match a.name {
        Some(n) => n,
        None => a
            .image
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    if name.len() > 4096 {
        bail!("export name is longer than 4096 bytes");
    }
    let params = DeviceParams {
        path: a.image.clone(),
        name,
        offset: a.offset,
        size_limit: a.size_limit,
        block_size: a.block_size,
        cache: match a.cache {
            Cache::Auto => CacheMode::Auto,
            Cache::Direct => CacheMode::Direct,
            Cache::Buffered => CacheMode::Buffered,
        },
        read_only: a.read_only,
        create: a.create,
        whole_device_lock: a.whole_device_lock,
    };
    let dev =
        Device::open(&params).with_context(|| format!("cannot serve {}", a.image.display()))?;
    tracing::info!(
        "serving {} as {:?}: {} bytes, block size {}, {}{}",
        dev.path.display(),
        dev.name,
        dev.size,
        dev.block_size,
        dev.cache_note,
        if dev.read_only { ", read-only" } else { "" }
    );
    let registry = Arc::new(Registry::default());
    registry.add(Arc::new(dev));
    let opts = ServeOptions {
        socket: a.socket,
        listen: a.listen,
        reactors: a.reactors,
    };
    server::serve(registry, &opts)?;
    Ok(())
}
