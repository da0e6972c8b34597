//! `loopd.toml(5)`: the man page of the `--config` file, written by `loopd
//! man` beside the command pages. Its key table is the one of
//! `docs/config.md` (a test checks both list the same keys, and that every
//! example value parses).

use clap_mangen::roff::{Roff, bold, italic, roman};

/// The page's name (`loopd.toml.5`).
pub const NAME: &str = "loopd.toml";

/// One key of a `[[device]]` table.
pub struct Key {
    pub key: &'static str,
    pub kind: &'static str,
    pub default: &'static str,
    pub meaning: &'static str,
    /// A value that parses, as written in TOML.
    pub example: &'static str,
}

const fn key(
    key: &'static str,
    kind: &'static str,
    default: &'static str,
    meaning: &'static str,
    example: &'static str,
) -> Key {
    Key {
        key,
        kind,
        default,
        meaning,
        example,
    }
}

/// Every key, in `docs/config.md`'s order.
pub const KEYS: &[Key] = &[
    key(
        "image",
        "path",
        "none: required",
        "The image file or block device, or an RBD image rbd:POOL[/NAMESPACE]/IMAGE[@SNAP]. \
         A relative path is relative to the directory of the config file, not to loopd's \
         working directory.",
        "\"/srv/images/a.img\"",
    ),
    key(
        "name",
        "string",
        "the image's file stem",
        "Export name; unique in the server.",
        "\"a\"",
    ),
    key(
        "create",
        "size",
        "none",
        "Create a sparse image of this size if image does not exist (never truncates or \
         grows an existing one).",
        "\"10G\"",
    ),
    key(
        "preallocate",
        "bool",
        "false",
        "With create: allocate every block of the new image (fallocate) instead of making \
         it sparse; writes into it then allocate nothing (faster through ublk), and the \
         disk space is taken at once.",
        "true",
    ),
    key(
        "offset",
        "size",
        "0",
        "Start of the exported window in the file.",
        "\"1M\"",
    ),
    key(
        "size_limit",
        "size",
        "to the end of the file",
        "Size of the window; may reach past the end of the file (reads as zeros).",
        "\"512M\"",
    ),
    key(
        "block_size",
        "size",
        "the file's direct-I/O alignment",
        "Logical block size: 512, 1024, 2048 or 4096.",
        "4096",
    ),
    key(
        "strict_block_size",
        "bool",
        "false",
        "Advertise the block size as the NBD minimum block size.",
        "true",
    ),
    key(
        "cache",
        "\"auto\", \"direct\" or \"buffered\"",
        "\"auto\"",
        "How the file is reached: direct I/O where the filesystem allows it, O_DIRECT, or \
         the page cache.",
        "\"buffered\"",
    ),
    key(
        "read_only",
        "bool",
        "false",
        "Refuse writes; a read-only image file gives a read-only device anyway.",
        "true",
    ),
    key(
        "autoclear",
        "bool",
        "false",
        "Remove the device when its last client disconnects.",
        "true",
    ),
    key(
        "shared",
        "bool",
        "false",
        "Let other writers (QEMU, other devices) use the image (QEMU's force-share).",
        "true",
    ),
    key(
        "format",
        "\"raw\"",
        "probe",
        "Declare the format; without it non-raw images (qcow2, vmdk, ...) are refused.",
        "\"raw\"",
    ),
    key(
        "blockdev",
        "\"ublk\" or \"nbd\"",
        "none",
        "Also give the device to the kernel as /dev/ublkbN or /dev/nbdN.",
        "\"ublk\"",
    ),
    key(
        "queues",
        "number",
        "one per reactor",
        "ublk hardware queues.",
        "2",
    ),
    key(
        "queue_depth",
        "number",
        "128",
        "ublk requests in flight per queue.",
        "64",
    ),
    key(
        "no_zero_copy",
        "boolean",
        "false",
        "ublk: copy data through loopd's buffer even where the kernel offers zero copy.",
        "true",
    ),
    key("connections", "number", "1", "Kernel NBD connections.", "2"),
    key(
        "partscan",
        "bool",
        "false",
        "Wait for the block device's partition nodes.",
        "true",
    ),
    key(
        "ceph_conf",
        "path",
        "/etc/ceph/ceph.conf",
        "An rbd: image: the Ceph configuration (monitors, keyring); relative to the config \
         file's directory.",
        "\"/etc/ceph/prod.conf\"",
    ),
    key(
        "ceph_id",
        "string",
        "\"admin\"",
        "An rbd: image: the Ceph client id, without client.",
        "\"loopd\"",
    ),
    key(
        "ceph_timeout",
        "number",
        "8",
        "An rbd: image: RADOS operation timeout, in seconds.",
        "20",
    ),
    key(
        "tls_allow",
        "list of strings",
        "everyone",
        "TLS client identities allowed to open the device (cn:, dn:, dns:, email:, ip:, \
         uri:); needs the server's --tls-verify-peer.",
        "[\"cn:ci-runner\", \"dns:builder.example\"]",
    ),
];

/// The example file of the page.
pub const EXAMPLE: &str = "\
# /etc/loopd/devices.toml
[[device]]
image = \"/srv/images/a.img\"
name = \"a\"

[[device]]
image = \"b.img\"            # relative: /etc/loopd/b.img
create = \"10G\"             # made sparse at start if missing
block_size = 4096
cache = \"buffered\"
read_only = true
";

fn para(roff: &mut Roff, text: &str) {
    roff.control("PP", []);
    roff.text([roman(text)]);
}

/// The page, in roff.
pub fn render(version: &str) -> String {
    let mut r = Roff::default();
    let title = format!("loopd {version}");
    r.control(
        "TH",
        ["LOOPD.TOML", "5", "", title.as_str(), "loopd manual"],
    );
    r.control("SH", ["NAME"]);
    r.text([roman(
        "loopd.toml - the devices loopd serve --config attaches at start",
    )]);
    r.control("SH", ["SYNOPSIS"]);
    r.text([bold("loopd serve --config"), roman(" "), italic("FILE")]);
    r.control("SH", ["DESCRIPTION"]);
    para(
        &mut r,
        "A TOML file of [[device]] tables, one per device. loopd serve attaches each \
         of them at start, before it reports ready; SIGHUP or loopd reload reads the file \
         again. Unknown keys are an error (a typo is never ignored). Sizes are a number \
         of bytes or a string with a binary suffix, as on the command line: 4096, \"4k\", \
         \"512M\", \"1.5G\", \"2T\". Each key is the attach option of the same name.",
    );
    para(
        &mut r,
        "Devices of the config file are not written to the state file: the file is \
         their record. A name both in the file and in the state file is the file's; the \
         state record is dropped, with a warning.",
    );
    r.control("SH", ["KEYS"]);
    for k in KEYS {
        r.control("TP", []);
        r.text([bold(k.key), roman(" ("), italic(k.kind), roman(")")]);
        r.text([roman(format!(
            "{} Default: {}. Example: ",
            k.meaning, k.default
        ))]);
        r.text([bold(format!("{} = {}", k.key, k.example))]);
    }
    r.control("SH", ["WHEN A DEVICE CANNOT BE ATTACHED"]);
    para(
        &mut r,
        "A file that cannot be read, is not TOML, or has an unknown key or a bad value (a \
         block size no device has, a create size that is not whole blocks, a name that \
         is invalid or given to two devices) stops the start, before any device is \
         attached: loopd serve exits with status 7 (invalid; 1, io, when the file \
         cannot be read), naming the file. On a reload such a file changes nothing and is \
         the reload's error.",
    );
    para(
        &mut r,
        "A device of a file that parses but that cannot be attached (its image missing, \
         locked by another writer, not raw, its block device unavailable) does not stop \
         the start, as it does not stop a reload or the restore of the state file. An \
         error line names the file, the device and why; the server starts, serves the \
         other devices and reports ready (READY=1, --fork returns 0). loopd list and \
         loopd status NAME show the device missing, with the reason; it is tried again \
         every 2 seconds and by each reload (listed as failed while it still fails), and \
         loopd detach NAME forgets it until the next reload or start.",
    );
    r.control("SH", ["RELOADING"]);
    para(
        &mut r,
        "A reload attaches the devices new in the file; applies size_limit, cache and \
         read_only changes live, offset and block_size changes while no client is \
         connected; reports any other change (detach and attach the device to apply \
         it); and attaches again a device of the file that was detached.",
    );
    para(
        &mut r,
        "A device no longer in the file stays attached until the server stops, but it \
         is not attached at the next start: the file was its only record. The reload \
         names each such device, in its reply (kept) and in a warning; detach it with \
         loopd detach NAME, or put it back in the file to keep it.",
    );
    r.control("SH", ["EXAMPLES"]);
    r.control("RS", ["4"]);
    r.control("nf", []);
    for line in EXAMPLE.lines() {
        r.text([roman(line)]);
    }
    r.control("fi", []);
    r.control("RE", []);
    r.control("SH", ["FILES"]);
    r.control("TP", []);
    r.text([italic("/etc/loopd/devices.toml")]);
    r.text([roman(
        "The file the loopd.service unit passes to --config (scripts/install.sh installs \
         one with comments only).",
    )]);
    r.control("SH", ["SEE ALSO"]);
    r.text([
        bold("loopd-serve"),
        roman("(1), "),
        bold("loopd-reload"),
        roman("(1), "),
        bold("loopd"),
        roman("(1)"),
    ]);
    r.render()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys of docs/config.md's table, in order.
    fn doc_keys() -> Vec<String> {
        include_str!("../../docs/config.md")
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn the_page_lists_the_keys_of_docs_config_md() {
        let ours: Vec<&str> = KEYS.iter().map(|k| k.key).collect();
        assert_eq!(ours, doc_keys());
    }

    #[test]
    fn every_example_parses() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("c.toml");
        for k in KEYS.iter().filter(|k| k.key != "image") {
            // `preallocate` is refused without `create` (what it applies to).
            let with = if k.key == "preallocate" {
                "create = \"1G\"\n"
            } else {
                ""
            };
            std::fs::write(
                &f,
                format!(
                    "[[device]]\nimage = \"/a.img\"\n{with}{} = {}\n",
                    k.key, k.example
                ),
            )
            .expect("write");
            loopd::daemon::config::read(&f).unwrap_or_else(|e| panic!("{}: {e}", k.key));
        }
        std::fs::write(&f, EXAMPLE).expect("write");
        let devs = loopd::daemon::config::read(&f).expect("the example parses");
        assert_eq!(devs.len(), 2);
    }

    #[test]
    fn the_page_has_its_sections() {
        let page = render("1.0");
        for s in [
            ".TH LOOPD.TOML 5",
            ".SH KEYS",
            ".SH EXAMPLES",
            "WHEN A DEVICE CANNOT BE ATTACHED",
            "size_limit",
            "tls_allow",
        ] {
            assert!(page.contains(s), "{s} missing:\n{page}");
        }
    }
}
