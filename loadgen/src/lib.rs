//! Load generation for OpenAI-compatible endpoints (`cleave bench serve`): Mooncake-format traces
//! or synthetic workloads turned into real prompts ([`workload`]), open- and closed-loop arrivals
//! ([`arrival`]), an SSE streaming client that times every token ([`client`], [`sse`]),
//! percentile statistics and goodput ([`stats`]), Prometheus scrapes of cleave's own counters
//! ([`scrape`]), and the report as a table, JSON and PNG charts ([`report`], [`plot`]).

#![forbid(unsafe_code)]

pub mod arrival;
pub mod client;
pub mod plot;
pub mod progress;
pub mod report;
pub mod resources;
pub mod runner;
pub mod scrape;
pub mod sse;
pub mod stats;
pub mod tokens;
pub mod trace;
pub mod workload;

/// Errors a user can cause (bad files, bad flags); the charts have their own [`plot::PlotError`].
#[derive(Debug, thiserror::Error)]
pub enum LoadgenError {
    /// A flag or workload parameter is out of range.
    #[error("invalid setting: {0}")]
    Invalid(String),
    /// The trace could not be read.
    #[error(transparent)]
    Trace(#[from] cleave_types::trace::TraceError),
}
