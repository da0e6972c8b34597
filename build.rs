//! Link flags for the `loopd` binary (not the library, tests or examples).
//!
//! `-z pack-relative-relocs` (DT_RELR): the executable is position-independent,
//! so every pointer in its read-only data (vtables, string tables, clap's
//! definitions) needs a relative relocation at start, about 18,700 of them,
//! which the dynamic loader used to read from a 450 KB table of 24-byte
//! entries. Packed as bitmaps they take under 3 KB, so each `loopd attach`
//! (one process start, like `losetup`) reads less and relocates faster; the
//! binary stays PIE (address randomisation kept). Needs glibc 2.36 (it
//! records `GLIBC_ABI_DT_RELR`, so an older glibc refuses the binary by name
//! instead of misrunning it) and GNU ld 2.38 or lld 15, which Debian 12 has.
//! Only for Linux/glibc targets; elsewhere nothing changes.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    if os == "linux" && env == "gnu" {
        println!("cargo::rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}
