//! `cleave-router`: places each request on a prefill and a decode worker.
//!
//! The router's hops are `api → admit → place → dispatch → stream`; this crate holds the
//! request path (the routing simulator behind `cleave bench route` is `cleave-route-sim`):
//! - [`api`]: the OpenAI-compatible HTTP front (axum): validation, tokenization, JSON and SSE
//!   responses, OpenAI-shaped errors, `/health`, `/ready`, `/metrics`; it reaches the rest of
//!   the router through the [`api::backend::Backend`] trait.
//! - [`admit`]: bounded in-flight and queue limits and the per-request deadline; [`keys`]:
//!   the API keys and their per-key limits (requests and tokens per minute, concurrency).
//! - [`drain`]: the stop's drain period (`--drain-period`: `Connection: close`, `/ready` 503).
//! - [`tls`]: HTTPS on the OpenAI endpoint (rustls, ALPN h2/http1.1, optional client
//!   certificates, certificate reload without restart).
//! - [`place`] (the `cleave-place` crate): the [`place::Policy`] trait and its policies
//!   (`prefix-optimistic`, the default: `prefix-load`'s cost over the index plus the in-flight
//!   overlay [`place::InFlight`]; plus `round-robin`, `least-load`, `random` as baselines), the
//!   view of worker load with optimistic accounting ([`place::WorkerView`]), the typed result
//!   [`place::Placement`], and the one owner of the placement state
//!   ([`place::PlacementState`]: index, view, overlay behind one lock). Prefix affinity comes
//!   from `cleave-kv-index`'s [`cleave_kv_index::PrefixIndex`].
//! - [`dispatch`]: places each request ([`place`] over the prefix index and load) and streams
//!   it from the chosen decode worker over gRPC, naming the prefill worker when disaggregating;
//!   [`watch`] keeps the index and load current from every worker's `Watch` stream, and
//!   [`discovery`] says which workers exist. [`serve`] wires it all into the `cleave-router`
//!   binary ([`config`]).
//! - [`events`]: KV events of vLLM / SGLang pods (ZMQ, msgpack) into the prefix index, and
//!   the backend that places requests on such a pool (`--kv-events vllm --kv-events-pod …`).
//! - [`epp`]: `--mode endpoint-picker`, the same placement as an Envoy ext_proc endpoint picker
//!   for a Gateway API Inference Extension `InferencePool` (cleave, vLLM or SGLang pods).

#![forbid(unsafe_code)]

pub mod admit;
pub mod api;
pub mod config;
pub mod discovery;
pub mod dispatch;
pub mod drain;
pub mod epp;
mod error;
pub mod events;
pub mod keys;
mod model;
/// Placement (policies, load view, in-flight overlay, the one-lock placement state) is
/// `cleave-place`'s.
pub use cleave_place as place;
pub mod serve;
pub mod tls;
pub mod watch;

pub use error::RouterError;
