//! Argument types shared by subcommands: a device's options (`attach`,
//! `serve IMAGE`), their value enums, `--size-limit`, and reading a
//! `--config` file.

use anyhow::Result;
use clap::ValueEnum;
use loopd::backing::format::ImageFormat;
use loopd::control::proto::DeviceSpec;
use loopd::device::CacheMode;
use loopd::device::spec::Blockdev;
use loopd::size::{parse_block_size, parse_size};
use std::path::{Path, PathBuf};

/// `--cache`; qemu's names for the same two caches are accepted too.
#[derive(Clone, Copy, ValueEnum)]
pub enum Cache {
    /// Direct I/O where the filesystem allows it, else buffered (and say which).
    Auto,
    /// O_DIRECT: keep the image out of the page cache; fail if the filesystem
    /// refuses. Also spelt `none`, as qemu-nbd's --cache=none.
    #[value(alias = "none")]
    Direct,
    /// Through the page cache. Also spelt `writeback`, as qemu-nbd's
    /// --cache=writeback.
    #[value(alias = "writeback")]
    Buffered,
}

impl From<Cache> for CacheMode {
    fn from(c: Cache) -> CacheMode {
        match c {
            Cache::Auto => CacheMode::Auto,
            Cache::Direct => CacheMode::Direct,
            Cache::Buffered => CacheMode::Buffered,
        }
    }
}

// How a device is configured (shared by `serve IMAGE` and `attach`). (A
// plain comment: a doc comment here would become the `about` of both
// subcommands, whose arguments are deferred; see `main.rs`.)
#[derive(clap::Args)]
pub struct DeviceArgs {
    /// Export name [default: the image's file stem]; the empty name also selects
    /// the device given to `serve`.
    #[arg(long, short = 'x', visible_alias = "export-name")]
    pub name: Option<String>,
    /// Create a sparse image of this size (e.g. 1G; K/M/G/T) if IMAGE does not exist.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub create: Option<u64>,
    /// With --create: allocate every block of the new image (fallocate, like
    /// qemu-img's preallocation=falloc) instead of making it sparse. Writes into
    /// it then allocate nothing, which a ublk device serves faster (README: "Sparse
    /// images cost writes a thread hop"); the disk space is taken at once.
    #[arg(long, requires = "create")]
    pub preallocate: bool,
    /// Start of the exported window in the file, in bytes (like losetup --offset).
    #[arg(long, short = 'o', value_name = "BYTES", value_parser = parse_size, default_value = "0")]
    pub offset: u64,
    /// Size of the exported window (like losetup --sizelimit); may reach past the
    /// end of the file, which then reads as zeros. `none` or 0: to the end of
    /// the file (the default).
    #[arg(long, visible_alias = "sizelimit", value_name = "BYTES|none", value_parser = parse_limit)]
    pub size_limit: Option<Limit>,
    /// Logical block size: 512, 1024, 2048 or 4096 [default: the file's direct-I/O
    /// alignment (statx), else the filesystem device's block size, else 512].
    /// NBD clients are told it is the preferred size; the minimum is 1 byte
    /// unless --strict-block-size.
    #[arg(
        long,
        short = 'b',
        visible_alias = "sector-size",
        value_name = "BYTES",
        value_parser = parse_block_size
    )]
    pub block_size: Option<u32>,
    /// Tell NBD clients the block size is also the smallest request they may
    /// send (the NBD minimum block size), so strict clients such as libnbd refuse
    /// unaligned requests themselves. Default: the minimum is 1 byte and the
    /// block size only the preferred size, and every request is served (in
    /// direct mode through an aligned bounce buffer, read-modify-write for
    /// writes), so byte-granular clients (nbdfuse, mmap) work at any block size.
    #[arg(long)]
    pub strict_block_size: bool,
    /// How to reach the file: auto, direct (O_DIRECT) or buffered (page cache).
    #[arg(long, value_enum, default_value = "auto")]
    pub cache: Cache,
    /// Refuse writes (EPERM) and advertise the export as read-only.
    #[arg(long, short = 'r')]
    pub read_only: bool,
    /// Serve the image even if another writer (QEMU, another device) has it open,
    /// and let others open it too (QEMU's force-share). Default: one writer.
    #[arg(long)]
    pub shared: bool,
    /// Declare the image's format: `raw` serves its bytes as they are, even if they
    /// look like qcow2, vmdk, ... [default: probe and refuse non-raw images].
    /// `-f` is this option, as in qemu-nbd (losetup's `-f`, the first free
    /// device, is `loopd kernel attach -f`).
    #[arg(long, short = 'f', value_name = "FORMAT", value_parser = FormatParser)]
    pub format: Option<Format>,
    /// Also hand the device to the kernel as a block device: `ublk` gives
    /// /dev/ublkbN (Linux 6.0+, module ublk_drv); `nbd` connects the kernel's NBD
    /// client to this export in one step and gives /dev/nbdN (module nbd). The
    /// block device is printed once it exists and serves I/O.
    #[arg(long, value_enum, value_name = "KIND")]
    pub blockdev: Option<BlockdevArg>,
    /// ublk: hardware queues, each served by one reactor [default: one per reactor].
    #[arg(long, value_name = "N", requires = "blockdev")]
    pub queues: Option<u16>,
    /// ublk: requests in flight per queue [default: 128].
    #[arg(long, value_name = "D", requires = "blockdev")]
    pub queue_depth: Option<u16>,
    /// ublk: no zero copy. By default a ublk device on a local image with
    /// --cache direct (block size and offset aligned for direct I/O) lets the
    /// kernel hand the request's own pages to the image file's I/O where the
    /// kernel can (UBLK_F_AUTO_BUF_REG, Linux 6.16+); with this option every
    /// request's data is copied through loopd's buffer, as on older kernels.
    #[arg(long, requires = "blockdev")]
    pub no_zero_copy: bool,
    /// nbd: connections between the kernel and loopd, served by several
    /// reactors (like qemu-nbd --connect with multiple connections) [default: 1].
    #[arg(long, value_name = "N", requires = "blockdev")]
    pub connections: Option<u16>,
    /// Return only once the block device's partition devices exist (no window
    /// where mkfs races udev).
    #[arg(long, requires = "blockdev")]
    pub partscan: bool,
    /// Only NBD clients whose TLS certificate proves IDENTITY may open this
    /// device; others are told it does not exist (repeatable). IDENTITY is the
    /// certificate's subject CN, its subject DN (`dn:CN=alice,O=Example`) or a
    /// subjectAltName (`dns:host.example`, `email:a@example.com`, `ip:192.0.2.7`,
    /// `uri:spiffe://...`). Needs the server's --tls and --tls-verify-peer.
    #[arg(long, value_name = "IDENTITY")]
    pub tls_allow: Vec<String>,
    /// An rbd: image: the Ceph configuration file (monitors, keyring)
    /// [default: /etc/ceph/ceph.conf].
    #[arg(long, value_name = "FILE")]
    pub ceph_conf: Option<PathBuf>,
    /// An rbd: image: the Ceph client id, without `client.` [default: admin].
    #[arg(long, value_name = "USER")]
    pub ceph_id: Option<String>,
    /// An rbd: image: RADOS operation timeout in seconds; a stalled cluster
    /// fails requests with an error after it [default: 8, below the NBD reply
    /// timeout].
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub ceph_timeout: Option<u64>,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BlockdevArg {
    /// /dev/ublkbN through the kernel's ublk driver.
    Ublk,
    /// /dev/nbdN: the kernel's NBD client on socket pairs to this export.
    Nbd,
}

impl From<BlockdevArg> for Blockdev {
    fn from(b: BlockdevArg) -> Blockdev {
        match b {
            BlockdevArg::Ublk => Blockdev::Ublk,
            BlockdevArg::Nbd => Blockdev::Nbd,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub enum Format {
    /// The file is the disk, byte for byte.
    Raw,
}

/// `--format`/`-f` of `serve` and `attach`: [`Format`]'s values, and for
/// anything else an error that says `-f` is the format here, for a losetup
/// user whose `-f` means "the first free device" (`-f disk.img`).
#[derive(Clone)]
pub struct FormatParser;

impl clap::builder::TypedValueParser for FormatParser {
    type Value = Format;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<Format, clap::Error> {
        let inner = clap::builder::EnumValueParser::<Format>::new();
        inner.parse_ref(cmd, arg, value).map_err(|_| {
            clap::Error::raw(
                clap::error::ErrorKind::InvalidValue,
                format!(
                    "invalid value {} for '--format <FORMAT>': the one format is raw. \
                     -f is --format here, as in qemu-nbd; losetup's -f (the first free \
                     device) is `loopd kernel attach -f`, and `loopd attach` always makes \
                     a new device\n",
                    loopd::text::quoted(&value.to_string_lossy())
                ),
            )
            .with_cmd(cmd)
        })
    }

    fn possible_values(
        &self,
    ) -> Option<Box<dyn Iterator<Item = clap::builder::PossibleValue> + '_>> {
        Some(Box::new(
            Format::value_variants()
                .iter()
                .filter_map(ValueEnum::to_possible_value),
        ))
    }
}

impl From<Format> for ImageFormat {
    fn from(f: Format) -> ImageFormat {
        match f {
            Format::Raw => ImageFormat::Raw,
        }
    }
}

impl DeviceArgs {
    /// The device spec for `image`, made absolute against this process's working
    /// directory (the daemon may run elsewhere); an `rbd:` image is no path.
    pub fn spec(&self, image: PathBuf) -> DeviceSpec {
        let rbd = image
            .to_str()
            .is_some_and(loopd::backing::rbd::spec::is_rbd);
        let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
        DeviceSpec {
            image: if rbd { image } else { abs(image) },
            ceph_conf: self.ceph_conf.clone().map(abs),
            ceph_id: self.ceph_id.clone(),
            ceph_timeout: self.ceph_timeout,
            rbd_lock_owner: None,
            name: self.name.clone(),
            offset: self.offset,
            size_limit: self.size_limit.and_then(|l| l.0),
            block_size: self.block_size,
            strict_block_size: self.strict_block_size,
            cache: self.cache.into(),
            read_only: self.read_only,
            autoclear: false,
            create: self.create,
            preallocate: self.preallocate,
            shared: self.shared,
            format: self.format.map(Into::into),
            blockdev: self.blockdev.map(Into::into),
            queues: self.queues,
            queue_depth: self.queue_depth,
            no_zero_copy: self.no_zero_copy,
            connections: self.connections,
            partscan: self.partscan,
            ublk_id: None,
            tls_allow: self.tls_allow.clone(),
            file: None,
        }
    }
}

/// Read a `--config` file: `[[device]]` tables.
pub fn read_config(path: &Path) -> Result<Vec<DeviceSpec>> {
    Ok(loopd::daemon::config::read(path)?)
}

/// `--size-limit` of every command: a size, or no limit (`None`).
#[derive(Clone, Copy)]
pub struct Limit(pub Option<u64>);

/// `--size-limit` of every command (`attach`, `serve`, `set`, `kernel
/// attach`): a size, or `none` or `0` for no limit, read by the one parser
/// config files use too ([`loopd::size::parse_limit`]).
pub fn parse_limit(s: &str) -> Result<Limit, loopd::size::SizeError> {
    loopd::size::parse_limit(s).map(Limit)
}
