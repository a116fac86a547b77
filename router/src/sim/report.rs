//! The simulator's results: a table for people and the JSON shape
//! `{"pooled_hit_rate", "policies": [{"policy", "hit_rate", "load_imbalance", "ttft_p50_s",
//! "ttft_p99_s", "decisions_per_s"}]}` for scripts.

use std::fmt::Write as _;

use super::{TimeModel, TraceStats};
use crate::place::PlaceConfig;

/// One policy's results.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PolicyReport {
    pub policy: String,
    /// Prompt blocks served from the chosen worker's cache (leading blocks only) / all blocks.
    pub hit_rate: f64,
    /// Max / mean busy time over workers.
    pub load_imbalance: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    /// Placements per second of wall clock spent in index lookup + policy.
    pub decisions_per_s: f64,
    /// Requests whose index match on the chosen worker differed from its cache (should be 0).
    #[serde(skip)]
    pub index_mismatches: usize,
}

/// Results of a simulation.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SimReport {
    #[serde(skip)]
    pub stats: TraceStats,
    #[serde(skip)]
    pub workers: usize,
    #[serde(skip)]
    pub capacity_blocks: usize,
    #[serde(skip)]
    pub block_tokens: u64,
    #[serde(skip)]
    pub time: TimeModel,
    #[serde(skip)]
    pub place: PlaceConfig,
    /// Hit rate of one LRU cache of `workers × capacity_blocks` blocks.
    pub pooled_hit_rate: f64,
    pub policies: Vec<PolicyReport>,
}

impl SimReport {
    /// `{"pooled_hit_rate": x, "policies": [...]}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain numbers and strings")
    }

    /// The human-readable table, with the setup it was measured under.
    pub fn to_table(&self) -> String {
        let s = &self.stats;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "trace: {} requests over {:.0} s, {} prompt blocks of {} tokens, {} unique, longest prompt {} blocks",
            s.requests, s.duration_s, s.prompt_blocks, self.block_tokens, s.unique_blocks, s.longest_prompt_blocks
        );
        let _ = writeln!(
            out,
            "cluster: {} workers × {} blocks of LRU prefix cache (pooled reference: one LRU of {} blocks = {:.1}% of unique blocks)",
            self.workers,
            self.capacity_blocks,
            self.workers * self.capacity_blocks,
            100.0 * (self.workers * self.capacity_blocks) as f64 / s.unique_blocks.max(1) as f64
        );
        let _ = writeln!(
            out,
            "time model: FIFO per worker; prefill {:.0} uncached tokens/s; decode {:.1} ms/output token; TTFT = queue wait + prefill",
            self.time.prefill_tokens_per_s,
            self.time.decode_s_per_token * 1e3
        );
        let _ = writeln!(
            out,
            "placement: prefix-load cost = {}·uncached + {}·queued_prefill + active_decode + new_decode blocks; prefill on the decode worker (no disaggregation); seed {:#x}",
            self.place.prefill_weight, self.place.queued_prefill_weight, self.place.seed
        );
        let _ = writeln!(out, "pooled hit rate: {:.4}", self.pooled_hit_rate);
        let rr = self
            .policies
            .iter()
            .find(|p| p.policy == "round-robin")
            .map(|p| p.hit_rate);
        let _ = writeln!(
            out,
            "{:<12} {:>8} {:>9} {:>8} {:>9} {:>10} {:>10} {:>12}",
            "policy",
            "hit_rate",
            "vs_pooled",
            "vs_rr",
            "imbalance",
            "ttft_p50_s",
            "ttft_p99_s",
            "decisions/s"
        );
        for p in &self.policies {
            let vs_rr = rr
                .filter(|&r| r > 0.0)
                .map_or("-".to_owned(), |r| format!("{:.2}x", p.hit_rate / r));
            let _ = writeln!(
                out,
                "{:<12} {:>8.4} {:>8.3}x {:>8} {:>9.3} {:>10.3} {:>10.3} {:>12.0}",
                p.policy,
                p.hit_rate,
                p.hit_rate / self.pooled_hit_rate.max(f64::MIN_POSITIVE),
                vs_rr,
                p.load_imbalance,
                p.ttft_p50_s,
                p.ttft_p99_s,
                p.decisions_per_s
            );
        }
        out
    }
}
