//! cleave's workers: the engine served over gRPC, in one of two roles.
//!
//! - **decode** ([`decode`]): owns the KV memory of running sequences. It admits a request,
//!   allocates its blocks (reusing its own cached prefix), asks the chosen prefill worker to fill
//!   them (`import_kv`), then decodes in its continuous batch and streams tokens.
//! - **prefill** ([`prefill`]): computes prompts (chunked, batched, with its own prefix cache)
//!   and writes each block's KV into the decode worker's memory as soon as it is full
//!   (`export_kv`), then answers with the first token.
//!
//! Both share [`serve`]: the engine on memory allocated by the KV transport, the `Watch`
//! stream of KV events and load for the router ([`watch`]), Prometheus metrics ([`metrics`])
//! and the health endpoints. The binaries `cleave-decode` and `cleave-prefill` are thin mains
//! over [`run`].

#![forbid(unsafe_code)]

pub mod config;
pub mod convert;
pub mod decode;
pub mod metrics;
pub mod prefill;
pub mod serve;
pub mod watch;

pub use config::{Role, WorkerConfig};
pub use serve::{run, Running};
