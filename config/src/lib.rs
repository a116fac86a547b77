//! `cleave-config`: what each of cleave's binaries accepts, as clap types (flags, each with its
//! `CLEAVE_*` variable), and the checks that need nothing but the values.
//!
//! - [`router::RouterConfig`]: `cleave-router` (with [`epp::EppConfig`] for
//!   `--mode endpoint-picker`);
//! - [`worker::WorkerConfig`]: the worker binaries (with [`group::GroupArgs`] for multi-process
//!   groups);
//! - [`internal_tls::InternalTlsArgs`]: mutual TLS between the processes, on all of them;
//! - [`placement::PlacementArgs`]: the router's placement weights and disaggregation threshold,
//!   the one home of their defaults.
//!
//! The binaries parse them; the operator renders its ConfigMaps through the same definitions and
//! parses what it rendered back, so it needs this crate and not the binaries' (which link the
//! engine, UCX, etcd and tonic). The closed sets whose behaviour lives in those crates (KV element
//! type, KV transport, collective transport) come from [`cleave_types::choices`].

#![forbid(unsafe_code)]

pub mod epp;
mod error;
pub mod group;
pub mod internal_tls;
pub mod kv_pool;
pub mod placement;
pub mod router;
pub mod worker;

pub use error::ConfigError;

/// Async runtime threads of the servers (gRPC, HTTP, KV transfers) by default, beside the
/// compute threads.
pub const DEFAULT_RUNTIME_THREADS: usize = 2;
