//! The EXAMPLES section of each man page: commands taken from the README,
//! per subcommand path (`""` is `loopd.1`, `"kernel attach"` is
//! `loopd-kernel-attach.1`). `main.rs`'s tests parse every one with the real
//! command line definition, and check each visible page has some.

/// One example: what it does, and the command (no quotes: the tests split it
/// on white space; what follows ` | ` or ` > ` is another program's).
pub struct Example {
    pub what: &'static str,
    pub command: &'static str,
}

const fn ex(what: &'static str, command: &'static str) -> Example {
    Example { what, command }
}

/// Every page's examples.
pub const EXAMPLES: &[(&str, &[Example])] = &[
    (
        "",
        &[
            ex(
                "Serve a 1 GiB sparse image (created if missing) until Ctrl-C; it prints \
                 the URI clients use:",
                "loopd serve demo.img --create 1G",
            ),
            ex(
                "Run the server for many devices, attach one, list them, detach it:",
                "loopd serve --socket /run/loopd/loopd.sock",
            ),
            ex("", "loopd attach /srv/a.img --create 1G"),
            ex("", "loopd list"),
            ex("", "loopd detach a"),
        ],
    ),
    (
        "serve",
        &[
            ex(
                "Serve a 1 GiB sparse image (created if missing) until Ctrl-C:",
                "loopd serve demo.img --create 1G",
            ),
            ex(
                "Serve it over TCP with TLS:",
                "loopd serve disk.img --listen 0.0.0.0:10809 --tls require --tls-certs \
                 /etc/loopd/pki",
            ),
            ex(
                "Serve it as the kernel block device /dev/ublkbN (printed):",
                "loopd serve disk.img --blockdev ublk",
            ),
            ex(
                "Run the server with the devices of a config file (see loopd.toml(5)) \
                 and the state file, for attach and the other commands:",
                "loopd serve --config /etc/loopd/devices.toml --socket /run/loopd/loopd.sock",
            ),
        ],
    ),
    (
        "attach",
        &[
            ex(
                "Attach an image, created sparse if missing; prints its name and URIs:",
                "loopd attach /srv/a.img --create 1G",
            ),
            ex(
                "Attach one read-only with 4 KiB blocks, removed when its last client leaves:",
                "loopd attach /srv/b.img --name b --block-size 4096 --read-only --autoclear",
            ),
            ex(
                "Attach several in one durable step:",
                "loopd attach /srv/c.img /srv/d.img --block-size 4096",
            ),
            ex(
                "Attach the images a list names, one per line:",
                "loopd attach --from images.txt",
            ),
            ex(
                "Attach one as the kernel block device /dev/nbdN, with its partitions:",
                "loopd attach disk.img --blockdev nbd --partscan",
            ),
        ],
    ),
    (
        "detach",
        &[
            ex(
                "Detach a device (refused while clients are connected):",
                "loopd detach a",
            ),
            ex(
                "Cut its clients off, then detach it:",
                "loopd detach a --force",
            ),
        ],
    ),
    (
        "list",
        &[
            ex("List the devices, like losetup --list:", "loopd list"),
            ex("The same as JSON:", "loopd list --json"),
        ],
    ),
    (
        "status",
        &[
            ex(
                "A device's configuration, counters and latency:",
                "loopd status a",
            ),
            ex("Every device, one row each:", "loopd status"),
            ex("As JSON:", "loopd status a --json"),
        ],
    ),
    (
        "set",
        &[
            ex(
                "Change the size of the window live:",
                "loopd set a --size-limit 512M",
            ),
            ex(
                "Remove the limit (to the end of the file):",
                "loopd set a --size-limit none",
            ),
            ex(
                "Change the block size, which connected clients cannot follow:",
                "loopd set a --block-size 4096 --force",
            ),
        ],
    ),
    (
        "resize",
        &[ex(
            "Grow the image, then the device (like losetup --set-capacity):",
            "loopd resize a",
        )],
    ),
    (
        "reload-tls",
        &[ex(
            "Use the renewed certificates for new connections:",
            "loopd reload-tls",
        )],
    ),
    (
        "reload",
        &[
            ex(
                "Re-read the config file and the certificates; print what changed:",
                "loopd reload",
            ),
            ex("The same report as JSON:", "loopd reload --json"),
        ],
    ),
    (
        "kernel",
        &[
            ex(
                "Set up /dev/loopN for an image, list, detach:",
                "loopd kernel attach disk.img --partscan",
            ),
            ex("", "loopd kernel list"),
            ex("", "loopd kernel detach /dev/loop0"),
        ],
    ),
    (
        "kernel attach",
        &[
            ex(
                "Set up /dev/loopN for an image, with its partitions; prints the devices:",
                "loopd kernel attach disk.img --partscan",
            ),
            ex(
                "losetup's spellings work too:",
                "loopd kernel attach -f --show -r -P -o 1M --sizelimit 1M -b 4k disk.img",
            ),
        ],
    ),
    (
        "kernel detach",
        &[
            ex("Detach a loop device:", "loopd kernel detach /dev/loop0"),
            ex(
                "Detach every loop device with a backing file:",
                "loopd kernel detach --all",
            ),
        ],
    ),
    (
        "kernel list",
        &[
            ex("List the loop devices:", "loopd kernel list"),
            ex("In losetup -J's shape:", "loopd kernel list -J"),
        ],
    ),
    (
        "completions",
        &[ex(
            "Install the bash completion (it offers the names of the devices of the \
             running server where a command takes one):",
            "loopd completions bash > /usr/share/bash-completion/completions/loopd",
        )],
    ),
    (
        "man",
        &[ex(
            "Write the pages into a directory (then install the .1 pages in man1 and \
             loopd.toml.5 in man5, as scripts/install.sh does):",
            "loopd man --out-dir /tmp/loopd-man",
        )],
    ),
];

/// The examples of the page for subcommand path `path` (`""`: `loopd.1`).
pub fn for_path(path: &str) -> &'static [Example] {
    EXAMPLES
        .iter()
        .find(|(p, _)| *p == path)
        .map_or(&[], |(_, e)| e)
}
