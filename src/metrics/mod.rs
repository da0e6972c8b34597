//! The Prometheus metrics endpoint (`loopd serve --metrics ADDR|PATH`): the text
//! exposition format 0.0.4 over minimal HTTP/1.x, `GET /metrics`, on a thread of
//! its own. A scrape reads atomics only; see `docs/metrics.md` for every metric.
//!
//! Above the daemon (it reads the export table); nothing below imports it.

pub mod collect;
pub mod expo;
pub mod http;
pub mod request;

use thiserror::Error;

#[derive(Debug, Error)]
pub enum MetricsError {
    #[error("--metrics {0}: cannot listen")]
    BindTcp(String, #[source] std::io::Error),
    #[error("cannot start the metrics thread")]
    Spawn(#[source] std::io::Error),
}
