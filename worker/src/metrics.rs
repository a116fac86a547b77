//! The worker's Prometheus metrics, registered into a registry the caller owns.
//!
//! | name | type | meaning |
//! | --- | --- | --- |
//! | `cleave_kv_blocks_used` | gauge | KV blocks referenced by sequences |
//! | `cleave_kv_blocks_total` | gauge | KV blocks in the pool |
//! | `cleave_worker_queue_depth` | gauge | sequences waiting for admission |
//! | `cleave_worker_running_sequences` | gauge | sequences in the running batch |
//! | `cleave_prefix_cache_hit_tokens_total` | counter | prompt tokens served from the prefix cache |
//! | `cleave_prefix_cache_query_tokens_total` | counter | prompt tokens looked up in the prefix cache |
//! | `cleave_kv_transfer_bytes_total` | counter | KV bytes written to (prefill) or received from (decode) peers |
//! | `cleave_kv_transfer_seconds` | histogram | time of one request's KV transfer |
//! | `cleave_worker_prefill_fallbacks_total` | counter | decode: prompts computed locally because the prefill worker failed |
//! | `cleave_worker_disaggregated_requests_total` | counter | decode: requests whose KV came from a prefill worker |
//! | `cleave_moe_expert_tokens_total{layer,expert}` | counter | MoE models: tokens routed to each expert ([`WorkerMetrics::observe_experts`]) |

use std::sync::Mutex;

use cleave_engine::engine::EngineStats;
use cleave_engine::kv::tiers::TierStats;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// All metrics of one worker.
#[derive(Debug)]
pub struct WorkerMetrics {
    kv_blocks_used: Gauge,
    kv_blocks_total: Gauge,
    queue_depth: Gauge,
    running: Gauge,
    prefix_hit_tokens: Counter,
    prefix_query_tokens: Counter,
    /// KV bytes moved.
    pub transfer_bytes: Counter,
    /// Per-request KV transfer time.
    pub transfer_seconds: Histogram,
    /// Local prefills after a prefill worker failed.
    pub prefill_fallbacks: Counter,
    /// Requests whose KV came from a prefill worker.
    pub disaggregated: Counter,
    last: Mutex<(u64, u64)>,
    expert_tokens: Family<Vec<(String, String)>, Counter>,
    last_experts: Mutex<Vec<Vec<u64>>>,
    tier_hits: Family<Vec<(String, String)>, Counter>,
    tier_stored: Family<Vec<(String, String)>, Counter>,
    tier_refused: Counter,
    tier_entries: Family<Vec<(String, String)>, Gauge>,
    last_tiers: Mutex<TierStats>,
}

impl WorkerMetrics {
    /// Creates the metrics and registers them.
    pub fn new(registry: &mut Registry) -> Self {
        let m = WorkerMetrics {
            kv_blocks_used: Gauge::default(),
            kv_blocks_total: Gauge::default(),
            queue_depth: Gauge::default(),
            running: Gauge::default(),
            prefix_hit_tokens: Counter::default(),
            prefix_query_tokens: Counter::default(),
            transfer_bytes: Counter::default(),
            transfer_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 18)),
            prefill_fallbacks: Counter::default(),
            disaggregated: Counter::default(),
            last: Mutex::new((0, 0)),
            expert_tokens: Family::default(),
            last_experts: Mutex::new(Vec::new()),
            tier_hits: Family::default(),
            tier_stored: Family::default(),
            tier_refused: Counter::default(),
            tier_entries: Family::default(),
            last_tiers: Mutex::new(TierStats::default()),
        };
        registry.register(
            "cleave_kv_blocks_used",
            "KV blocks referenced by sequences",
            m.kv_blocks_used.clone(),
        );
        registry.register(
            "cleave_kv_blocks_total",
            "KV blocks in the pool",
            m.kv_blocks_total.clone(),
        );
        registry.register(
            "cleave_worker_queue_depth",
            "Sequences waiting for admission",
            m.queue_depth.clone(),
        );
        registry.register(
            "cleave_worker_running_sequences",
            "Sequences in the running batch",
            m.running.clone(),
        );
        registry.register(
            "cleave_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            m.prefix_hit_tokens.clone(),
        );
        registry.register(
            "cleave_prefix_cache_query_tokens",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_query_tokens.clone(),
        );
        registry.register(
            "cleave_kv_transfer_bytes",
            "KV bytes moved between workers",
            m.transfer_bytes.clone(),
        );
        registry.register(
            "cleave_kv_transfer_seconds",
            "Time of one request's KV transfer",
            m.transfer_seconds.clone(),
        );
        registry.register(
            "cleave_worker_prefill_fallbacks",
            "Prompts computed locally after a prefill worker failed",
            m.prefill_fallbacks.clone(),
        );
        registry.register(
            "cleave_worker_disaggregated_requests",
            "Requests whose KV came from a prefill worker",
            m.disaggregated.clone(),
        );
        registry.register(
            "cleave_moe_expert_tokens",
            "Tokens routed to each expert of each MoE layer",
            m.expert_tokens.clone(),
        );
        registry.register(
            "cleave_kv_tier_hit_blocks",
            "KV blocks restored into the pool from a tier instead of computed",
            m.tier_hits.clone(),
        );
        registry.register(
            "cleave_kv_tier_stored_blocks",
            "KV blocks stored in a tier (host: evicted from the pool; disk: written)",
            m.tier_stored.clone(),
        );
        registry.register(
            "cleave_kv_tier_refused_blocks",
            "Disk tier entries refused as corrupt, truncated or written for another model",
            m.tier_refused.clone(),
        );
        registry.register(
            "cleave_kv_tier_blocks",
            "KV blocks held in a tier now",
            m.tier_entries.clone(),
        );
        m
    }

    /// Brings the KV tier metrics up to `t` (cumulative counters from the engine).
    fn observe_tiers(&self, t: &TierStats) {
        let tier = |name: &str| vec![("tier".to_string(), name.to_string())];
        let mut last = self.last_tiers.lock().expect("metrics lock");
        for (name, hits, last_hits, stored, last_stored, entries) in [
            (
                "host",
                t.host_hits,
                last.host_hits,
                t.host_stored,
                last.host_stored,
                t.host_entries,
            ),
            (
                "disk",
                t.disk_hits,
                last.disk_hits,
                t.disk_written,
                last.disk_written,
                t.disk_entries,
            ),
        ] {
            self.tier_hits
                .get_or_create(&tier(name))
                .inc_by(hits.saturating_sub(last_hits));
            self.tier_stored
                .get_or_create(&tier(name))
                .inc_by(stored.saturating_sub(last_stored));
            self.tier_entries
                .get_or_create(&tier(name))
                .set(entries as i64);
        }
        self.tier_refused
            .inc_by(t.disk_refused.saturating_sub(last.disk_refused));
        *last = *t;
    }

    /// Brings the per-expert counters up to `counts` (`Model::expert_counts()`: cumulative
    /// tokens per `[layer][expert]`; every rank routes every token, so the leader's model
    /// alone covers the whole group). Dense models pass an empty list.
    pub fn observe_experts(&self, counts: &[Vec<u64>]) {
        let mut last = self.last_experts.lock().expect("metrics lock");
        last.resize_with(counts.len(), Vec::new);
        for (layer, (now, before)) in counts.iter().zip(last.iter_mut()).enumerate() {
            before.resize(now.len(), 0);
            for (expert, (&n, b)) in now.iter().zip(before.iter_mut()).enumerate() {
                let labels = vec![
                    ("layer".to_string(), layer.to_string()),
                    ("expert".to_string(), expert.to_string()),
                ];
                self.expert_tokens
                    .get_or_create(&labels)
                    .inc_by(n.saturating_sub(*b));
                *b = n.max(*b);
            }
        }
    }

    /// Brings the engine-derived metrics up to date (called before each scrape).
    pub fn observe_engine(&self, s: &EngineStats) {
        self.kv_blocks_used.set(s.pool.used as i64);
        self.kv_blocks_total.set(s.pool.total as i64);
        self.queue_depth.set(s.waiting as i64);
        self.running.set(s.running as i64);
        let mut last = self.last.lock().expect("metrics lock");
        let (hit, query) = (s.counters.prefix_hit_tokens, s.counters.prefix_query_tokens);
        self.prefix_hit_tokens.inc_by(hit.saturating_sub(last.0));
        self.prefix_query_tokens
            .inc_by(query.saturating_sub(last.1));
        *last = (hit.max(last.0), query.max(last.1));
        drop(last);
        self.observe_tiers(&s.tiers);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_counters_follow_the_models_cumulative_counts() {
        let mut registry = Registry::default();
        let m = WorkerMetrics::new(&mut registry);
        m.observe_experts(&[vec![3, 1], vec![]]);
        m.observe_experts(&[vec![5, 1], vec![]]);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        assert!(
            out.contains("cleave_moe_expert_tokens_total{layer=\"0\",expert=\"0\"} 5"),
            "{out}"
        );
        assert!(out.contains("cleave_moe_expert_tokens_total{layer=\"0\",expert=\"1\"} 1"));
    }

    #[test]
    fn tier_counters_follow_the_engines_cumulative_stats() {
        let mut registry = Registry::default();
        let m = WorkerMetrics::new(&mut registry);
        let mut s = EngineStats::default();
        s.tiers.host_hits = 2;
        s.tiers.disk_written = 1;
        m.observe_engine(&s);
        s.tiers.host_hits = 5;
        s.tiers.disk_refused = 1;
        s.tiers.host_entries = 7;
        m.observe_engine(&s);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        for want in [
            "cleave_kv_tier_hit_blocks_total{tier=\"host\"} 5",
            "cleave_kv_tier_stored_blocks_total{tier=\"disk\"} 1",
            "cleave_kv_tier_refused_blocks_total 1",
            "cleave_kv_tier_blocks{tier=\"host\"} 7",
        ] {
            assert!(out.contains(want), "{want} missing in:\n{out}");
        }
    }
}
