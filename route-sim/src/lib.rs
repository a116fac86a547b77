//! `cleave-route-sim`, routing at scale, simulated (`cleave bench route`): replays a Mooncake-format trace through the real
//! [`PrefixIndex`] and the real placement policies against simulated continuous-batching workers.
//!
//! Each simulated worker has an LRU prefix cache of `capacity_blocks` trace blocks
//! ([`cache::LruCache`]) that emits `Stored` / `Removed` events with sequence ids. A request's
//! cache change happens when it is placed (its hit count is what the cache held then; FIFO
//! prefill means earlier requests on the worker are computed first), but its events reach the
//! index only when its prefill is done, as a real worker reports blocks once computed. The
//! router's [`WorkerView`] is charged at placement, its prefill part released at the first token
//! and the rest when the request finishes (optimistic accounting, no load reports).
//!
//! Time model ([`engine`], stated in every report): each worker runs iterations of one decode
//! step for its whole running batch plus a FIFO prefill chunk; a decode step's cost grows with
//! the batch per a curve calibrated from `cleave bench engine`. TTFT = arrival to the end of the
//! prefill; ITL = the gaps between a sequence's tokens. Arrivals are the trace's, rescaled by
//! one factor so that the *offered load* is the same at every worker count and cache size: at
//! `offered_load` 0.5 (the default), a router that reached the pooled cache's hit rate would keep
//! the workers 50% busy prefilling on average (the prompt tokens it could not serve from cache / the cluster's prefill
//! capacity over the trace's duration; the factor is in the report). A router with a lower hit
//! rate faces more work in the same time. Every request prefills on its decode worker (no
//! disaggregation in the simulator).
//!
//! `sglang-cache-aware` gets its matches from a tree of the requests it routed (a second
//! [`PrefixIndex`] fed with each placed prompt, never told of evictions), as SGLang's router
//! works; every other policy from the KV-event index.
//!
//! Reference: the hit rate of one pooled LRU cache of `workers × capacity_blocks` blocks serving
//! the whole trace (what perfect affinity with no load limits could reach).

#![forbid(unsafe_code)]

pub mod cache;
pub mod engine;
pub mod report;
pub mod tenants;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::time::{Duration, Instant};

use cleave_kv_index::{KvEvent, KvEventRecord, Matches, PrefixIndex, WorkerId};

use cleave_place::{
    BuildPolicy, Charge, InFlight, Load, PlaceConfig, PlaceError, Placement, PlacementArgs,
    PlacementRequest, PolicyKind, Role, Ticket, WorkerView,
};
pub use cleave_types::trace::{load_trace, parse_trace, TraceError, TraceRequest};
pub use engine::TimeModel;
use engine::{Prefill, SimWorker};
pub use report::{PolicyReport, SimReport};
pub use tenants::TenantTrace;

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The trace has no requests, or the configuration no workers.
    #[error("nothing to simulate: {0}")]
    Empty(&'static str),
    /// A configuration value is out of range.
    #[error("bad simulator configuration: {0}")]
    Config(&'static str),
    /// A policy could not place a request.
    #[error("placement failed")]
    Place(#[from] PlaceError),
}

/// Divisor of the default capacity: each worker caches `unique blocks / workers / 4` blocks, so
/// even the pooled cache holds only a quarter of the trace's distinct blocks.
pub const DEFAULT_CAPACITY_DIVISOR: usize = 4;

/// SGLang router's default `--max-tree-size` (nodes of its tree of routed requests): the cap of
/// the routed-request tree `sglang-cache-aware` matches against.
pub const SGLANG_MAX_TREE_SIZE: usize = 1 << 26;

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Number of workers (all prefill and decode).
    pub workers: usize,
    /// Blocks each worker caches; `None`: `unique blocks / workers / capacity_divisor` (at
    /// least the longest prompt).
    pub capacity_blocks: Option<usize>,
    /// Divisor of the default capacity ([`DEFAULT_CAPACITY_DIVISOR`]).
    pub capacity_divisor: usize,
    /// Tokens per trace block (512 in the Mooncake traces).
    pub block_tokens: u64,
    pub time: TimeModel,
    /// Arrivals are rescaled so that prefilling the prompt tokens the pooled cache would miss
    /// needs this fraction of the cluster's prefill capacity (`None`: the trace's own
    /// timestamps).
    pub offered_load: Option<f64>,
    pub place: PlaceConfig,
    /// Policies to run, each on a fresh cluster.
    pub policies: Vec<PolicyKind>,
    /// Also run the reference [`PINNED`]: every request goes to worker `(its first block id /
    /// this) mod workers`, with no regard to load. For the tenant trace, with its
    /// `prefix_blocks`, each tenant lives on one worker and every worker holds the same number
    /// of tenants: the even static partition, what a placement that keeps each tenant in one
    /// place and spreads them perfectly would reach (docs/routing.md). `None`: not run.
    pub pin_groups_of: Option<u64>,
    /// Correct the router's recent prefill work with each request's cached blocks when it
    /// finishes, as the live router does with the cached tokens its workers report
    /// ([`WorkerView::prefill_measured`]); `false`: the index's guess alone.
    pub measured_prefill: bool,
}

/// Name of the pinned reference in reports ([`SimConfig::pin_groups_of`]).
pub const PINNED: &str = "(tenants pinned)";

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            capacity_blocks: None,
            capacity_divisor: DEFAULT_CAPACITY_DIVISOR,
            block_tokens: 512,
            time: TimeModel::default(),
            offered_load: Some(DEFAULT_OFFERED_LOAD),
            // The router's weights (PlaceConfig::default); the simulator never disaggregates.
            place: PlaceConfig {
                disagg_min_uncached_blocks: usize::MAX,
                ..PlaceConfig::default()
            },
            policies: PolicyKind::ALL.to_vec(),
            pin_groups_of: None,
            measured_prefill: true,
        }
    }
}

/// The default offered load (see [`SimConfig::offered_load`]). 0.5, not 0.8: the Mooncake
/// trace's work is not stationary (bursts, and with large caches the cold-cache misses come
/// first), so at an average of 0.8 even a router at the pooled hit rate is overloaded for long
/// stretches (TTFT p50 of minutes at every worker count with the full-size cache) and TTFT
/// measures the backlog, not the placement. At 0.5 the best policies' TTFT p50 is within ~2× of
/// the unloaded floor and a policy that loses hits still meets a queue.
pub const DEFAULT_OFFERED_LOAD: f64 = 0.5;

/// The prefill weight the simulator uses by default (the router's default). First tuned on the
/// Mooncake trace under the simulator's earlier time model, where KV events arrived at once
/// (`prefill_weight` 4 → 0.93× the pooled hit rate, 16 → 0.97×, 32 → 1.0× with more imbalance;
/// `queued_prefill_weight` equal to `prefill_weight`, ARCHITECTURE.md's form, fell to 0.6–0.8×
/// the pooled hit rate at every weight tried). Under continuous batching with events arriving
/// when the prefill is done, docs/routing.md has the current numbers.
///
/// Since the in-flight overlay (issue 17) the default is 48 with `queued_prefill_weight` 3, i.e.
/// the same 16 : 1 ratio of uncached to queued prefill blocks with the decode blocks weighted a
/// third as much: over `cleave bench route --sweep` `prefix-optimistic` met the goal in 11, 10
/// and 10 of 16 cells at seeds 0x5eed, 7 and 99, against 7, 8 and 6 at 16 / 1.
///
/// Since workers evict a finished sequence's tail before its prefix ([`cache`]), a worker's
/// cache keeps its shared prefixes and affinity needs less protection: 24 (with 3 and the free
/// weight 16) met the goal in 13, 13 and 14 cells, 48 in 10, 12 and 12 (docs/routing.md).
pub const DEFAULT_SIM_PREFILL_WEIGHT: f64 = PlacementArgs::DEFAULT.prefill_weight;
/// The queued-prefill weight the simulator uses by default (the router's default).
pub const DEFAULT_SIM_QUEUED_PREFILL_WEIGHT: f64 = PlacementArgs::DEFAULT.queued_prefill_weight;
/// The weight of uncached blocks that fit in a worker's free KV space (the router's default,
/// [`PlaceConfig::free_prefill_weight`]): over the sweep at seeds 0x5eed, 7 and 99,
/// `prefix-optimistic` met the goal in 12, 12 and 13 cells, against 11, 10 and 10 without it
/// (docs/routing.md).
pub const DEFAULT_SIM_FREE_PREFILL_WEIGHT: f64 = PlacementArgs::DEFAULT.free_prefill_weight;

/// Facts about a trace that the report states.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TraceStats {
    pub requests: usize,
    pub prompt_blocks: usize,
    pub unique_blocks: usize,
    pub longest_prompt_blocks: usize,
    pub input_tokens: u64,
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
            input_tokens: trace.iter().map(|r| r.input_length).sum(),
            duration_s: trace.last().map_or(0.0, |r| r.timestamp as f64 / 1e3),
        }
    }

    /// The default per-worker capacity for `workers` workers and `divisor`.
    pub fn default_capacity(&self, workers: usize, divisor: usize) -> usize {
        (self.unique_blocks / workers.max(1) / divisor.max(1))
            .max(self.longest_prompt_blocks)
            .max(1)
    }

    /// Factor on the trace's timestamps that makes the prompt tokens missed at `hit_rate`
    /// `load` × the prefill capacity of `workers` workers at `tokens_per_s` each (1.0 for a
    /// trace without duration).
    pub fn arrival_scale(
        &self,
        workers: usize,
        tokens_per_s: f64,
        load: f64,
        hit_rate: f64,
    ) -> f64 {
        let missed = self.input_tokens as f64 * (1.0 - hit_rate).max(0.0);
        let needed_s = missed / (workers.max(1) as f64 * tokens_per_s * load);
        if self.duration_s > 0.0 && needed_s > 0.0 {
            needed_s / self.duration_s
        } else {
            1.0
        }
    }
}

/// Hit rate of one LRU cache of `capacity` blocks serving the whole trace.
pub fn pooled_hit_rate(trace: &[TraceRequest], capacity: usize) -> f64 {
    pooled(trace, capacity).0
}

/// One LRU cache of `capacity` blocks serving the whole trace: the hit rate, and per request the
/// blocks it found cached.
fn pooled(trace: &[TraceRequest], capacity: usize) -> (f64, Vec<usize>) {
    let mut cache = cache::LruCache::new(capacity);
    let mut per_request = Vec::with_capacity(trace.len());
    let mut total = 0usize;
    for r in trace {
        per_request.push(cache.serve(&r.block_hashes()));
        total += r.hash_ids.len();
        cache.drain_events();
    }
    let hits: usize = per_request.iter().sum();
    (ratio(hits as f64, total as f64), per_request)
}

/// TTFT with no queue at all: each request's prompt minus what the pooled cache held for it,
/// prefilled alone at `time`'s rate; (p50, p99). What no placement can go below, so a
/// policy's TTFT over this is queueing (and lost hits), not the engine's speed.
fn ttft_floor(
    trace: &[TraceRequest],
    cached: &[usize],
    block_tokens: u64,
    time: &TimeModel,
) -> (f64, f64) {
    let mut floor: Vec<f64> = trace
        .iter()
        .zip(cached)
        .map(|(r, &c)| {
            r.input_length
                .saturating_sub(c as u64 * block_tokens)
                .max(1) as f64
                / time.prefill_tokens_per_s
        })
        .collect();
    floor.sort_by(f64::total_cmp);
    (quantile(&floor, 0.50), quantile(&floor, 0.99))
}

/// Runs every configured policy over `trace`.
///
/// # Errors
/// [`SimError::Empty`] for an empty trace or zero workers; [`SimError::Config`] for a bad time
/// model or load; [`SimError::Place`] if a policy fails.
pub fn run(trace: &[TraceRequest], config: &SimConfig) -> Result<SimReport, SimError> {
    if trace.is_empty() {
        return Err(SimError::Empty("the trace has no requests"));
    }
    if config.workers == 0 {
        return Err(SimError::Empty("zero workers"));
    }
    config.time.validate()?;
    if let Some(load) = config.offered_load {
        if !(load.is_finite() && load > 0.0) {
            return Err(SimError::Config("offered_load must be > 0"));
        }
    }
    let stats = TraceStats::of(trace);
    let capacity = config
        .capacity_blocks
        .unwrap_or_else(|| stats.default_capacity(config.workers, config.capacity_divisor));
    let (pooled, pooled_cached) = pooled(trace, capacity * config.workers);
    let (floor_p50, floor_p99) = ttft_floor(
        trace,
        &pooled_cached,
        config.block_tokens.max(1),
        &config.time,
    );
    let scale = config.offered_load.map_or(1.0, |load| {
        stats.arrival_scale(
            config.workers,
            config.time.prefill_tokens_per_s,
            load,
            pooled,
        )
    });
    let runs = config.policies.iter().map(|&kind| (kind, None));
    // The pinned reference reuses a policy's run with its placement overridden; the kind only
    // names the index it matches against (the KV events, as `prefix-load`).
    let pinned = config
        .pin_groups_of
        .map(|g| (PolicyKind::PrefixLoad, Some(g.max(1))));
    let policies = runs
        .chain(pinned)
        .map(|(kind, pin)| run_policy(trace, config, capacity, scale, kind, pin))
        .collect::<Result<_, _>>()?;
    Ok(SimReport {
        stats,
        workers: config.workers,
        capacity_blocks: capacity,
        block_tokens: config.block_tokens,
        time: config.time.clone(),
        offered_load: config.offered_load,
        arrival_scale: scale,
        place: config.place.clone(),
        measured_prefill: config.measured_prefill,
        pooled_hit_rate: pooled,
        ttft_floor_p50_s: floor_p50,
        ttft_floor_p99_s: floor_p99,
        policies,
    })
}

/// Time key for the event heap: non-negative finite `f64` bits order like the values.
fn key(t: f64) -> u64 {
    t.max(0.0).to_bits()
}

/// The state of one policy's run.
struct Cluster<'a> {
    trace: &'a [TraceRequest],
    time: &'a TimeModel,
    index: PrefixIndex,
    view: WorkerView,
    workers: Vec<SimWorker>,
    charges: Vec<Option<Charge>>,
    /// Per request, the prompt blocks its worker had cached: what its usage reports at the end
    /// (`cached_tokens`), where the live router learns it.
    cached: Vec<u64>,
    /// [`SimConfig::measured_prefill`].
    measured_prefill: bool,
    /// (end of iteration, worker), earliest first.
    pending: BinaryHeap<Reverse<(u64, usize)>>,
    ttft: Vec<f64>,
    itl: Vec<f64>,
    /// Blocks of placed requests whose prefill is not done, when the policy matches in-flight
    /// placements (the live router's overlay; settled when the prefill's events are applied).
    in_flight: Option<InFlight>,
    /// Per request, its overlay ticket until its prefill is done.
    tickets: Vec<Option<Ticket>>,
}

impl Cluster<'_> {
    fn start(&mut self, w: usize, now: f64) {
        if let Some(end) = self.workers[w].start(now, self.time) {
            self.pending.push(Reverse((key(end), w)));
        }
    }

    /// Runs every iteration that ends at or before `until`.
    fn advance(&mut self, until: f64) {
        while let Some(&Reverse((t, w))) = self.pending.peek() {
            if t > key(until) {
                break;
            }
            self.pending.pop();
            let now = f64::from_bits(t);
            let trace = self.trace;
            let done = self.workers[w].finish(now, |r| trace[r].output_length.max(1));
            self.itl.extend_from_slice(&done.itl);
            if let Some(p) = done.prefilled {
                self.ttft.push(now - p.arrival);
                if let Some(c) = self.charges[p.req].as_mut() {
                    self.view.prefill_done(c);
                }
                for record in &p.events {
                    self.index
                        .apply(WorkerId(w as u64), record)
                        .expect("a simulated worker's events arrive in order");
                }
                if let (Some(o), Some(t)) = (self.in_flight.as_mut(), self.tickets[p.req].take()) {
                    o.settle(t);
                }
            }
            for r in done.finished {
                if let Some(mut c) = self.charges[r].take() {
                    if self.measured_prefill {
                        self.view.prefill_measured(&mut c, self.cached[r]);
                    }
                    self.view.release(c);
                }
            }
            self.start(w, now);
        }
    }
}

fn run_policy(
    trace: &[TraceRequest],
    config: &SimConfig,
    capacity: usize,
    scale: f64,
    kind: PolicyKind,
    pin: Option<u64>,
) -> Result<PolicyReport, SimError> {
    let policy = kind.build(&config.place);
    let mut c = Cluster {
        trace,
        time: &config.time,
        index: PrefixIndex::default(),
        view: WorkerView::new(),
        workers: (0..config.workers)
            .map(|_| SimWorker::new(capacity))
            .collect(),
        charges: Vec::with_capacity(trace.len()),
        cached: Vec::with_capacity(trace.len()),
        measured_prefill: config.measured_prefill,
        pending: BinaryHeap::new(),
        ttft: Vec::with_capacity(trace.len()),
        itl: Vec::new(),
        in_flight: kind.matches_in_flight().then(InFlight::default),
        tickets: Vec::with_capacity(trace.len()),
    };
    // SGLang's tree of routed requests, and the next event id per worker for it.
    let mut routed = kind.matches_routed_requests().then(|| {
        (
            PrefixIndex::new(SGLANG_MAX_TREE_SIZE),
            vec![0u64; config.workers],
        )
    });
    for i in 0..config.workers {
        c.index.add_worker(WorkerId(i as u64));
        c.view.upsert(WorkerId(i as u64), Role::Both);
        // The pool capacity a worker reports; the rest of its load is the router's own charges.
        let pool = Load {
            kv_capacity_blocks: capacity as u64,
            ..Load::default()
        };
        c.view.report(WorkerId(i as u64), pool);
        if let Some((tree, _)) = routed.as_mut() {
            tree.add_worker(WorkerId(i as u64));
        }
    }
    let (mut hits, mut total, mut stale) = (0usize, 0usize, 0usize);
    let mut decide = Duration::ZERO;
    let bt = config.block_tokens.max(1);
    // One matches buffer for the whole run (the lookup allocates nothing).
    let mut buf = Matches::default();
    for (n, r) in trace.iter().enumerate() {
        let now = r.timestamp as f64 / 1e3 * scale;
        c.advance(now);
        let hashes = r.block_hashes();
        let start = Instant::now();
        match (routed.as_ref(), c.in_flight.as_ref()) {
            (Some((tree, _)), _) => tree.find_matches_into(&hashes, &mut buf),
            (None, overlay) => {
                c.index.find_matches_into(&hashes, &mut buf);
                if let Some(o) = overlay {
                    o.extend(&c.index, &hashes, &mut buf);
                }
            }
        }
        let req = PlacementRequest {
            prompt_blocks: (r.input_length.div_ceil(bt) as usize).max(hashes.len()),
            decode_blocks: r.output_length.div_ceil(bt) as usize,
            matches: std::mem::take(&mut buf),
        };
        let placement = match pin {
            None => policy.place(&req, &c.view)?,
            Some(g) => {
                let group = r.hash_ids.first().map_or(0, |&h| h / g);
                let decode = WorkerId(group % config.workers as u64);
                Placement {
                    prefill: None,
                    decode,
                    cached_blocks: req.matches.matched(decode).min(req.prompt_blocks),
                }
            }
        };
        decide += start.elapsed();
        c.charges.push(Some(c.view.charge(&req, &placement)));

        let wid = placement.decode;
        let w = wid.0 as usize;
        if let Some((tree, ids)) = routed.as_mut() {
            let record = KvEventRecord {
                id: ids[w],
                event: KvEvent::Stored {
                    parent: None,
                    blocks: hashes.clone(),
                },
            };
            ids[w] += 1;
            tree.apply(wid, &record)
                .expect("the routed tree's ids are sequential");
        }
        let ticket = c
            .in_flight
            .as_mut()
            .map(|o| o.add(wid, hashes.clone(), Duration::from_secs_f64(now.max(0.0))));
        c.tickets.push(ticket);
        let cached = c.workers[w].cache.serve(&hashes);
        c.cached.push(cached as u64);
        if cached != req.matches.matched(wid) {
            stale += 1;
        }
        buf = req.matches;
        hits += cached;
        total += hashes.len();
        let events = c.workers[w].cache.drain_events();
        let uncached = r.input_length.saturating_sub(cached as u64 * bt).max(1);
        c.workers[w].queue.push_back(Prefill {
            req: n,
            arrival: now,
            remaining_tokens: uncached,
            events,
        });
        c.start(w, now);
    }
    c.advance(f64::MAX);
    let final_mismatches = (0..config.workers)
        .filter(|&w| c.index.worker_blocks(WorkerId(w as u64)) != c.workers[w].cache.len())
        .count();
    let busy: Vec<f64> = c.workers.iter().map(|w| w.busy_s).collect();
    let mean = busy.iter().sum::<f64>() / busy.len() as f64;
    let max = busy.iter().copied().fold(0.0, f64::max);
    c.ttft.sort_by(f64::total_cmp);
    c.itl.sort_by(f64::total_cmp);
    Ok(PolicyReport {
        policy: if pin.is_some() { PINNED } else { kind.name() }.to_owned(),
        hit_rate: ratio(hits as f64, total as f64),
        load_imbalance: ratio(max, mean),
        ttft_p50_s: quantile(&c.ttft, 0.50),
        ttft_p99_s: quantile(&c.ttft, 0.99),
        itl_p50_s: quantile(&c.itl, 0.50),
        itl_p99_s: quantile(&c.itl, 0.99),
        decisions_per_s: ratio(trace.len() as f64, decide.as_secs_f64()),
        stale_match_rate: ratio(stale as f64, trace.len() as f64),
        final_index_mismatches: final_mismatches,
        completed: c.ttft.len(),
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
