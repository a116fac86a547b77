//! Routing at scale, simulated: replays a Mooncake-format trace through the real
//! [`PrefixIndex`] and the real placement policies against simulated workers.
//!
//! Each simulated worker has an LRU prefix cache of `capacity_blocks` trace blocks
//! ([`cache::LruCache`]) that emits `Stored` / `Removed` events with sequence ids; the events go
//! into the index before the next request is placed, so the *index* decides affinity, exactly as
//! in the router. The router's [`WorkerView`] is charged at placement and released when the
//! simulated prefill and request finish (optimistic accounting, no load reports).
//!
//! Time model (stated in every report, [`TimeModel`]): a worker serves its requests one at a time
//! in arrival order (FIFO); a request's prefill takes `uncached_tokens / prefill_tokens_per_s`
//! where `uncached_tokens = input_length − cached_blocks · block_tokens` (at least 0), its decode
//! `output_length · decode_s_per_token` (a per-token cost amortised over a decode batch); busy
//! time accumulates per worker; TTFT = queue wait + prefill. Blocks enter a worker's cache when
//! the request is placed (not when its prefill ends), and every request prefills on its decode
//! worker (no disaggregation in the simulator).
//!
//! Reference: the hit rate of one pooled LRU cache of `workers × capacity_blocks` blocks serving
//! the whole trace (what perfect affinity with no load limits could reach).

pub mod cache;
pub mod report;
pub mod trace;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::time::{Duration, Instant};

use cleave_kv_index::{PrefixIndex, WorkerId};

use crate::place::{
    Charge, PlaceConfig, PlaceError, PlacementRequest, PolicyKind, Role, WorkerView,
};
use cache::LruCache;
pub use report::{PolicyReport, SimReport};
pub use trace::{load_trace, parse_trace, TraceRequest};

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The trace could not be read.
    #[error("cannot read trace {path}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A trace line is not a valid request.
    #[error("trace {path} line {line}: bad request")]
    Parse {
        path: String,
        line: usize,
        #[source]
        source: serde_json::Error,
    },
    /// The trace has no requests, or the configuration no workers.
    #[error("nothing to simulate: {0}")]
    Empty(&'static str),
    /// A policy could not place a request.
    #[error("placement failed")]
    Place(#[from] PlaceError),
}

/// How long simulated work takes.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TimeModel {
    /// Prefill throughput of one worker on uncached prompt tokens.
    pub prefill_tokens_per_s: f64,
    /// Decode cost per generated token on one worker (amortised over its batch).
    pub decode_s_per_token: f64,
}

impl Default for TimeModel {
    /// 10,000 prefill tokens/s and 2 ms per output token: roughly a 7–8B model on one modern GPU
    /// (prefill) with a ~15-way decode batch at ~30 ms per step.
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 10_000.0,
            decode_s_per_token: 0.002,
        }
    }
}

/// Divisor of the default capacity: each worker caches `unique blocks / workers / 4` blocks, so
/// even the pooled cache holds only a quarter of the trace's distinct blocks.
pub const DEFAULT_CAPACITY_DIVISOR: usize = 4;

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of workers (all prefill and decode).
    pub workers: usize,
    /// Blocks each worker caches; `None`: `unique blocks / workers / DEFAULT_CAPACITY_DIVISOR`
    /// (at least the longest prompt).
    pub capacity_blocks: Option<usize>,
    /// Tokens per trace block (512 in the Mooncake traces).
    pub block_tokens: u64,
    pub time: TimeModel,
    pub place: PlaceConfig,
    /// Policies to run, each on a fresh cluster.
    pub policies: Vec<PolicyKind>,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            capacity_blocks: None,
            block_tokens: 512,
            time: TimeModel::default(),
            place: PlaceConfig {
                prefill_weight: DEFAULT_SIM_PREFILL_WEIGHT,
                queued_prefill_weight: DEFAULT_SIM_QUEUED_PREFILL_WEIGHT,
                disagg_min_uncached_blocks: usize::MAX,
                ..PlaceConfig::default()
            },
            policies: PolicyKind::ALL.to_vec(),
        }
    }
}

/// The prefill weight the simulator uses by default: the router's default, tuned on the
/// Mooncake trace (`prefill_weight` 4 → 0.93× the pooled hit rate, 16 → 0.97×, 32 → 1.0× with
/// more imbalance; `queued_prefill_weight` equal to `prefill_weight`, ARCHITECTURE.md's form,
/// fell to 0.6–0.8× the pooled hit rate at every weight tried).
pub const DEFAULT_SIM_PREFILL_WEIGHT: f64 = 16.0;
/// The queued-prefill weight the simulator uses by default (the router's default).
pub const DEFAULT_SIM_QUEUED_PREFILL_WEIGHT: f64 = 1.0;

/// Facts about a trace that the report states.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TraceStats {
    pub requests: usize,
    pub prompt_blocks: usize,
    pub unique_blocks: usize,
    pub longest_prompt_blocks: usize,
    pub duration_s: f64,
}

impl TraceStats {
    /// Counts `trace`.
    pub fn of(trace: &[TraceRequest]) -> Self {
        let unique: HashSet<u64> = trace
            .iter()
            .flat_map(|r| r.hash_ids.iter().copied())
            .collect();
        Self {
            requests: trace.len(),
            prompt_blocks: trace.iter().map(|r| r.hash_ids.len()).sum(),
            unique_blocks: unique.len(),
            longest_prompt_blocks: trace.iter().map(|r| r.hash_ids.len()).max().unwrap_or(0),
            duration_s: trace.last().map_or(0.0, |r| r.timestamp as f64 / 1e3),
        }
    }

    /// The default per-worker capacity for `workers` workers.
    pub fn default_capacity(&self, workers: usize) -> usize {
        (self.unique_blocks / workers.max(1) / DEFAULT_CAPACITY_DIVISOR)
            .max(self.longest_prompt_blocks)
            .max(1)
    }
}

/// Hit rate of one LRU cache of `capacity` blocks serving the whole trace.
pub fn pooled_hit_rate(trace: &[TraceRequest], capacity: usize) -> f64 {
    let mut cache = LruCache::new(capacity);
    let (mut hits, mut total) = (0usize, 0usize);
    for r in trace {
        hits += cache.serve(&r.block_hashes());
        total += r.hash_ids.len();
        cache.drain_events();
    }
    ratio(hits as f64, total as f64)
}

/// Runs every configured policy over `trace`.
///
/// # Errors
/// [`SimError::Empty`] for an empty trace or zero workers; [`SimError::Place`] if a policy fails.
pub fn run(trace: &[TraceRequest], config: &SimConfig) -> Result<SimReport, SimError> {
    if trace.is_empty() {
        return Err(SimError::Empty("the trace has no requests"));
    }
    if config.workers == 0 {
        return Err(SimError::Empty("zero workers"));
    }
    let stats = TraceStats::of(trace);
    let capacity = config
        .capacity_blocks
        .unwrap_or_else(|| stats.default_capacity(config.workers));
    let pooled = pooled_hit_rate(trace, capacity * config.workers);
    let policies = config
        .policies
        .iter()
        .map(|&kind| run_policy(trace, config, capacity, kind))
        .collect::<Result<_, _>>()?;
    Ok(SimReport {
        stats,
        workers: config.workers,
        capacity_blocks: capacity,
        block_tokens: config.block_tokens,
        time: config.time.clone(),
        place: config.place.clone(),
        pooled_hit_rate: pooled,
        policies,
    })
}

/// A simulated worker: its cache and when it is next free.
struct SimWorker {
    cache: LruCache,
    free_at: f64,
    busy: f64,
}

/// A pending completion in the simulation.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Done {
    Prefill(usize),
    Request(usize),
}

fn run_policy(
    trace: &[TraceRequest],
    config: &SimConfig,
    capacity: usize,
    kind: PolicyKind,
) -> Result<PolicyReport, SimError> {
    let policy = kind.build(&config.place);
    let mut index = PrefixIndex::default();
    let mut view = WorkerView::new();
    let mut workers: Vec<SimWorker> = (0..config.workers)
        .map(|i| {
            index.add_worker(WorkerId(i as u64));
            view.upsert(WorkerId(i as u64), Role::Both);
            SimWorker {
                cache: LruCache::new(capacity),
                free_at: 0.0,
                busy: 0.0,
            }
        })
        .collect();
    let mut charges: Vec<Option<Charge>> = Vec::with_capacity(trace.len());
    // (time in µs, completion), earliest first.
    let mut pending: BinaryHeap<Reverse<(u64, Done)>> = BinaryHeap::new();
    let mut ttft = Vec::with_capacity(trace.len());
    let (mut hits, mut total, mut mismatches) = (0usize, 0usize, 0usize);
    let mut decide = Duration::ZERO;
    let bt = config.block_tokens.max(1);
    for (n, r) in trace.iter().enumerate() {
        let now = r.timestamp as f64 / 1e3;
        let now_us = r.timestamp * 1_000;
        while let Some(&Reverse((t, done))) = pending.peek() {
            if t > now_us {
                break;
            }
            pending.pop();
            match done {
                Done::Prefill(i) => {
                    if let Some(c) = charges[i].as_mut() {
                        view.prefill_done(c);
                    }
                }
                Done::Request(i) => {
                    if let Some(c) = charges[i].take() {
                        view.release(c);
                    }
                }
            }
        }
        let hashes = r.block_hashes();
        let start = Instant::now();
        let matches = index.find_matches(&hashes);
        let req = PlacementRequest {
            prompt_blocks: (r.input_length.div_ceil(bt) as usize).max(hashes.len()),
            decode_blocks: r.output_length.div_ceil(bt) as usize,
            matches,
        };
        let placement = policy.place(&req, &view)?;
        decide += start.elapsed();
        charges.push(Some(view.charge(&req, &placement)));

        let wid = placement.decode;
        let w = &mut workers[wid.0 as usize];
        let cached = w.cache.serve(&hashes);
        if cached != req.matches.matched(wid) {
            mismatches += 1;
        }
        for record in w.cache.drain_events() {
            index
                .apply(wid, &record)
                .expect("a simulated worker's events have no gaps");
        }
        hits += cached;
        total += hashes.len();

        let uncached_tokens = r.input_length.saturating_sub(cached as u64 * bt);
        let prefill = uncached_tokens as f64 / config.time.prefill_tokens_per_s;
        let decode = r.output_length as f64 * config.time.decode_s_per_token;
        let begin = w.free_at.max(now);
        w.free_at = begin + prefill + decode;
        w.busy += prefill + decode;
        ttft.push(begin - now + prefill);
        let us = |s: f64| (s * 1e6).ceil() as u64;
        pending.push(Reverse((us(begin + prefill), Done::Prefill(n))));
        pending.push(Reverse((us(w.free_at), Done::Request(n))));
    }
    let busy: Vec<f64> = workers.iter().map(|w| w.busy).collect();
    let mean = busy.iter().sum::<f64>() / busy.len() as f64;
    let max = busy.iter().copied().fold(0.0, f64::max);
    ttft.sort_by(f64::total_cmp);
    Ok(PolicyReport {
        policy: kind.name().to_owned(),
        hit_rate: ratio(hits as f64, total as f64),
        load_imbalance: ratio(max, mean),
        ttft_p50_s: quantile(&ttft, 0.50),
        ttft_p99_s: quantile(&ttft, 0.99),
        decisions_per_s: ratio(trace.len() as f64, decide.as_secs_f64()),
        index_mismatches: mismatches,
    })
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Nearest-rank quantile of sorted `xs`.
fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let rank = ((q * xs.len() as f64).ceil() as usize).clamp(1, xs.len());
    xs[rank - 1]
}
