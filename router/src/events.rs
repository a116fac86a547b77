//! KV events from other engines' fleets: vLLM and SGLang pods, placed by the router's policy.
//!
//! The hops, in order:
//! - [`wire`]: the engines' ZMQ messages `[topic, seq, msgpack batch]`, both msgspec encodings
//!   (array-like and tagged maps), hashes as integers or bytes;
//! - [`chain`]: engine block chains to the router's own chained XXH3 block hashes, from the
//!   token ids each `BlockStored` carries (so the engine's hash function, seed and extra keys
//!   never need to be reproduced; docs/kv-events.md says why);
//! - [`feed`]: one pod's batches into the [`cleave_kv_index::PrefixIndex`] with sequence
//!   checks (gap, publisher restart);
//! - [`subscribe`]: the ZMQ SUB socket per pod, and replay requests to the pod's ROUTER
//!   endpoint to close gaps;
//! - [`pool`]: the router's backend for such a pool: pods from `--pod`, health from
//!   `GET /health`, placement with the configured policy, requests forwarded to the pod's
//!   OpenAI `/v1/completions` as token ids.

pub mod chain;
pub mod feed;
pub mod pool;
pub mod subscribe;
pub mod wire;

pub use chain::{ChainConfig, PodChains};
pub use feed::{FeedStats, PodFeed, SeqStep};
pub use pool::{PodDefaults, PodSpec, PodSpecError, Pool, PoolError};
pub use subscribe::Source;
pub use wire::{Batch, BlockStored, EngineEvent, EngineHash, WireError};

pub use cleave_config::router::KvEventsKind;
use cleave_config::router::RouterConfig;

use crate::place::BuildPolicy;

/// The engine pods of `--kv-events` mode.
pub fn engine_pods(config: &RouterConfig) -> Result<Vec<PodSpec>, PodSpecError> {
    let defaults = PodDefaults {
        events_port: config.kv_events_port,
        replay_port: config.kv_events_replay_port,
        topic: config.kv_events_topic.clone(),
        ..Default::default()
    };
    config
        .kv_events_pods
        .iter()
        .map(|p| PodSpec::parse(p, &defaults))
        .collect()
}

/// Starts the `--kv-events` backend: the configured pods, followed until `shutdown`, placed by
/// the configured policy (never disaggregated: engines prefill what they decode).
pub fn start_pool(
    config: &RouterConfig,
    cluster: std::sync::Arc<crate::dispatch::Cluster>,
    place: &crate::place::PlaceConfig,
    model: String,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<Pool, PoolError> {
    let pods = engine_pods(config)?;
    let place = crate::place::PlaceConfig {
        disagg_min_uncached_blocks: usize::MAX,
        ..place.clone()
    };
    let pool = Pool::start(
        &pods,
        &ChainConfig::default(),
        cluster,
        config.policy.build(&place),
        model,
        shutdown,
    )?;
    tracing::info!(kind = ?config.kv_events, pods = pods.len(), policy = ?config.policy, "routing to engine pods");
    Ok(pool)
}
