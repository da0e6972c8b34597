//! The command line's subcommands beyond the one-line control requests:
//! [`attach`] (one image, or many in one batch), [`detach`] (one device or several), [`args`] (argument types shared by subcommands), [`print`] (output:
//! tables, JSON, escaping of the daemon's strings), [`serve`], [`kernel`],
//! [`reload`], [`generate`] (with [`examples`], [`config_page`] and
//! [`complete_names`]), [`exit`] (exit statuses), [`log`] and [`syslog`].

pub mod args;
pub mod attach;
pub mod complete_names;
pub mod config_page;
pub mod detach;
pub mod examples;
pub mod exit;
pub mod generate;
pub mod kernel;
pub mod log;
pub mod print;
pub mod reload;
pub mod serve;
pub mod syslog;

pub use args::{Cache, DeviceArgs, Limit, parse_limit};
pub use print::{print_done, print_list, print_set, print_status, print_status_all};
