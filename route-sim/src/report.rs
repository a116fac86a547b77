//! The simulator's results: a table for people and the JSON shape
//! `{"pooled_hit_rate", "policies": [{"policy", "hit_rate", "load_imbalance", "ttft_p50_s",
//! "ttft_p99_s", "itl_p50_s", "itl_p99_s", "stale_match_rate", "decisions_per_s"}]}` for scripts.

use std::fmt::Write as _;

use super::{TimeModel, TraceStats};
use cleave_place::PlaceConfig;

/// The anchors' policies, which the goal compares against.
pub const ANCHORS: [&str; 2] = ["sglang-cache-aware", "dynamo-cost"];

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
    /// Inter-token latency over every decoded token.
    pub itl_p50_s: f64,
    pub itl_p99_s: f64,
    /// Share of placements whose match on the chosen worker differed from its cache (events
    /// still in flight, or a policy matching against what it routed rather than KV events).
    pub stale_match_rate: f64,
    /// Placements per second of wall clock spent in index lookup + policy.
    pub decisions_per_s: f64,
    /// Workers whose index entry count differs from their cache's after the run (should be 0).
    #[serde(skip)]
    pub final_index_mismatches: usize,
    /// Requests that got their first token (all of them).
    #[serde(skip)]
    pub completed: usize,
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
    pub offered_load: Option<f64>,
    /// Factor applied to the trace's timestamps.
    #[serde(skip)]
    pub arrival_scale: f64,
    #[serde(skip)]
    pub place: PlaceConfig,
    /// [`super::SimConfig::measured_prefill`].
    #[serde(skip)]
    pub measured_prefill: bool,
    /// Hit rate of one LRU cache of `workers × capacity_blocks` blocks.
    pub pooled_hit_rate: f64,
    /// TTFT p50 with the pooled cache's hits and no queue (see `sim::run`): the floor.
    #[serde(skip)]
    pub ttft_floor_p50_s: f64,
    /// TTFT p99 likewise.
    #[serde(skip)]
    pub ttft_floor_p99_s: f64,
    pub policies: Vec<PolicyReport>,
}

/// The issue-17 goal for one policy against the anchors in the same run.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct GoalCheck {
    pub policy: String,
    /// Hit rate / pooled hit rate (goal ≥ 0.97).
    pub hit_vs_pooled: f64,
    /// TTFT p99 / the better anchor's (goal ≤ 0.9).
    pub ttft_p99_vs_best_anchor: f64,
    /// Goal ≤ 1.15.
    pub load_imbalance: f64,
    pub pass: bool,
}

impl SimReport {
    /// `{"pooled_hit_rate": x, "policies": [...]}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain numbers and strings")
    }

    /// The report of `policy`, if it ran.
    pub fn policy(&self, policy: &str) -> Option<&PolicyReport> {
        self.policies.iter().find(|p| p.policy == policy)
    }

    /// The goal for `policy`: `None` unless it and both anchors ran.
    pub fn goal(&self, policy: &str) -> Option<GoalCheck> {
        let p = self.policy(policy)?;
        let best = ANCHORS
            .iter()
            .map(|a| self.policy(a).map(|r| r.ttft_p99_s))
            .collect::<Option<Vec<f64>>>()?
            .into_iter()
            .fold(f64::INFINITY, f64::min);
        let hit_vs_pooled = p.hit_rate / self.pooled_hit_rate.max(f64::MIN_POSITIVE);
        let ttft = p.ttft_p99_s / best.max(f64::MIN_POSITIVE);
        Some(GoalCheck {
            policy: p.policy.clone(),
            hit_vs_pooled,
            ttft_p99_vs_best_anchor: ttft,
            load_imbalance: p.load_imbalance,
            pass: hit_vs_pooled >= 0.97 && ttft <= 0.9 && p.load_imbalance <= 1.15,
        })
    }

    /// The setup lines: trace, cluster, time model, placement parameters.
    pub fn header(&self) -> String {
        let s = &self.stats;
        let t = &self.time;
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
        let curve: Vec<String> = t
            .decode_tokens_per_s
            .iter()
            .map(|(b, r)| format!("b{b} {r:.0}"))
            .collect();
        let load = self
            .offered_load
            .map_or("the trace's own".to_owned(), |l| format!("{l:.2}"));
        let _ = writeln!(
            out,
            "time model: continuous batching per worker, FIFO prefill {:.0} tok/s in chunks of {} beside decode steps (aggregate decode tok/s {}; linear beyond); offered load {} (arrivals ×{:.2})",
            t.prefill_tokens_per_s,
            t.prefill_chunk_tokens,
            curve.join(", "),
            load,
            self.arrival_scale
        );
        let _ = writeln!(
            out,
            "unloaded TTFT floor (pooled cache's hits, empty queue, prefill alone): p50 {:.2}s, p99 {:.2}s",
            self.ttft_floor_p50_s, self.ttft_floor_p99_s
        );
        let p = &self.place;
        let _ = writeln!(
            out,
            "placement: prefix-load {}·uncached ({} where it fits in free KV) + {}·queued_prefill + {}·recent_prefill ({}) + decode; sglang cache_threshold {} balance_abs {} balance_rel {}; dynamo overlap_score_weight {} temperature 0; seed {:#x}",
            p.prefill_weight,
            p.free_prefill_weight,
            p.queued_prefill_weight,
            p.recent_prefill_weight,
            if self.measured_prefill { "measured" } else { "charged" },
            p.sglang.cache_threshold,
            p.sglang.balance_abs_threshold,
            p.sglang.balance_rel_threshold,
            p.dynamo.overlap_score_weight,
            p.seed
        );
        out
    }

    /// The policy table alone.
    pub fn rows(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<19} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>10}",
            "policy",
            "hit_rate",
            "vs_pooled",
            "imbalance",
            "ttft_p50",
            "ttft_p99",
            "itl_p50",
            "itl_p99",
            "stale",
            "decide/s"
        );
        let _ = writeln!(
            out,
            "{:<19} {:>8.4} {:>8.3}x",
            "(pooled cache)", self.pooled_hit_rate, 1.0
        );
        for p in &self.policies {
            let _ = writeln!(
                out,
                "{:<19} {:>8.4} {:>8.3}x {:>9.3} {:>8.2}s {:>8.2}s {:>8.3}s {:>8.3}s {:>6.3} {:>10.0}",
                p.policy,
                p.hit_rate,
                p.hit_rate / self.pooled_hit_rate.max(f64::MIN_POSITIVE),
                p.load_imbalance,
                p.ttft_p50_s,
                p.ttft_p99_s,
                p.itl_p50_s,
                p.itl_p99_s,
                p.stale_match_rate,
                p.decisions_per_s
            );
        }
        out
    }

    /// The human-readable table, with the setup it was measured under.
    pub fn to_table(&self) -> String {
        let mut out = self.header();
        let _ = writeln!(out, "pooled hit rate: {:.4}", self.pooled_hit_rate);
        out.push_str(&self.rows());
        out
    }
}
