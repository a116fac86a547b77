//! `cleave bench route`: routing at scale, simulated. Replays a Mooncake-format trace (or the
//! generated many-tenant trace) through the router's real prefix index and placement policies
//! against simulated continuous-batching workers ([`cleave_route_sim`]) and prints, per policy,
//! the prefix hit rate (next to one pooled cache's), load imbalance, simulated TTFT and ITL, and
//! placement decisions per second. `--sweep` runs 4/8/16/32 workers × two cache sizes × both
//! trace shapes and ends with the issue-17 goal check of `prefix-load` against the anchors.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context as _;
use clap::{Args, ValueEnum};
use cleave_route_sim as sim;
use cleave_router::place::{PlaceConfig, PolicyKind};
use sim::{SimConfig, SimReport, TenantTrace, TimeModel, TraceRequest};

/// Which trace to replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TraceShape {
    /// The Mooncake-format file given by `--trace`.
    Mooncake,
    /// Many tenants, each with a long private prefix (generated, `sim::tenants`).
    Tenants,
}

/// Options of `cleave bench route`.
#[derive(Debug, Clone, Args)]
pub struct RouteArgs {
    /// Mooncake-format trace (JSON lines: timestamp ms, input_length, output_length, hash_ids).
    /// Default: the shared synthetic trace, relative to the repository root.
    #[arg(
        long,
        default_value = "../shared/traces/mooncake_synthetic_trace.jsonl"
    )]
    pub trace: PathBuf,
    /// Trace shapes to replay.
    #[arg(long, value_delimiter = ',', default_value = "mooncake")]
    pub shape: Vec<TraceShape>,
    /// Simulated worker counts (each worker prefills and decodes).
    #[arg(long, value_delimiter = ',', default_value = "8")]
    pub workers: Vec<usize>,
    /// Prefix-cache blocks per worker. Default: unique blocks in the trace / workers /
    /// `--capacity-divisor` (at least the longest prompt).
    #[arg(long)]
    pub capacity_blocks: Option<usize>,
    /// Divisors of the default capacity (one run per divisor; 4: the pooled cache holds a quarter
    /// of the trace's distinct blocks, 1: all of them).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    pub capacity_divisor: Vec<usize>,
    /// Shorthand for `--shape mooncake,tenants --workers 4,8,16,32 --capacity-divisor 4,1`, plus
    /// the goal check.
    #[arg(long)]
    pub sweep: bool,
    /// Tokens per trace block (512 for the Mooncake traces).
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u64,
    /// Prefill throughput of one worker, uncached tokens per second.
    #[arg(long, default_value_t = TimeModel::default().prefill_tokens_per_s)]
    pub prefill_tokens_per_s: f64,
    /// Decode calibration, `batch:aggregate_tokens_per_s` points (default: `cleave bench engine`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1:176.9,4:560.7,16:653.0"
    )]
    pub decode_curve: Vec<String>,
    /// Prefill tokens per iteration beside a running decode batch.
    #[arg(long, default_value_t = TimeModel::default().prefill_chunk_tokens)]
    pub prefill_chunk_tokens: u64,
    /// Rescale arrivals so that prefilling what the pooled cache would miss needs this share of
    /// the cluster's prefill capacity.
    #[arg(long, default_value_t = sim::DEFAULT_OFFERED_LOAD)]
    pub offered_load: f64,
    /// Keep the trace's own timestamps instead (ignores `--offered-load`).
    #[arg(long)]
    pub trace_time: bool,
    /// Weight of a request's uncached prompt blocks in prefix-load's cost.
    #[arg(long, default_value_t = sim::DEFAULT_SIM_PREFILL_WEIGHT)]
    pub prefill_weight: f64,
    /// Weight of the prefill blocks already queued on a worker in prefix-load's cost.
    #[arg(long, default_value_t = sim::DEFAULT_SIM_QUEUED_PREFILL_WEIGHT)]
    pub queued_prefill_weight: f64,
    /// Weight of the uncached prompt blocks that fit in a worker's free KV space (evicting
    /// nothing) in prefix-load's cost; `--prefill-weight`'s value turns the distinction off.
    #[arg(long, default_value_t = sim::DEFAULT_SIM_FREE_PREFILL_WEIGHT)]
    pub free_prefill_weight: f64,
    /// Weight of the prefill work placed on a worker lately (decayed per placement, queued or
    /// done) in prefix-load's cost; 0 turns it off.
    #[arg(long, default_value_t = PlaceConfig::default().recent_prefill_weight)]
    pub recent_prefill_weight: f64,
    /// Leave the recent prefill work at what the router charged (the index's guess) instead of
    /// correcting it with each request's cached blocks when it finishes, as the live router
    /// does with the cached tokens its workers report.
    #[arg(long)]
    pub unmeasured_prefill: bool,
    /// Policies to compare (default: prefix-load, prefix-optimistic (the router's default), the two
    /// anchors, round-robin).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// Seed of the policies' RNG and of the tenant trace.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// Print one JSON object per run (`{"trace", "workers", ..., "pooled_hit_rate", "policies"}`).
    #[arg(long)]
    pub json: bool,
}

/// The default comparison: ours (the index-only cost and the default, in-flight-aware one),
/// the anchors, a cache-blind baseline.
pub const DEFAULT_POLICIES: [PolicyKind; 5] = [
    PolicyKind::PrefixLoad,
    PolicyKind::PrefixOptimistic,
    PolicyKind::SglangCacheAware,
    PolicyKind::DynamoCost,
    PolicyKind::RoundRobin,
];

fn decode_curve(points: &[String]) -> anyhow::Result<Vec<(usize, f64)>> {
    points
        .iter()
        .map(|p| {
            let (b, t) = p
                .split_once(':')
                .with_context(|| format!("--decode-curve point {p:?} is not batch:tokens_per_s"))?;
            Ok((
                b.trim()
                    .parse()
                    .with_context(|| format!("--decode-curve batch {b:?}"))?,
                t.trim()
                    .parse()
                    .with_context(|| format!("--decode-curve rate {t:?}"))?,
            ))
        })
        .collect()
}

/// Runs the simulation(s) and prints tables or JSON.
pub fn bench_route(mut args: RouteArgs) -> anyhow::Result<()> {
    if args.sweep {
        args.shape = vec![TraceShape::Mooncake, TraceShape::Tenants];
        args.workers = vec![4, 8, 16, 32];
        args.capacity_divisor = vec![4, 1];
    }
    let mut base = SimConfig {
        block_tokens: args.block_tokens,
        capacity_blocks: args.capacity_blocks,
        time: TimeModel {
            prefill_tokens_per_s: args.prefill_tokens_per_s,
            decode_tokens_per_s: decode_curve(&args.decode_curve)?,
            prefill_chunk_tokens: args.prefill_chunk_tokens,
        },
        offered_load: (!args.trace_time).then_some(args.offered_load),
        policies: if args.policies.is_empty() {
            DEFAULT_POLICIES.to_vec()
        } else {
            args.policies.clone()
        },
        ..SimConfig::default()
    };
    base.place.prefill_weight = args.prefill_weight;
    base.place.queued_prefill_weight = args.queued_prefill_weight;
    base.place.free_prefill_weight = args.free_prefill_weight;
    base.place.recent_prefill_weight = args.recent_prefill_weight;
    base.place.seed = args.seed;
    let mut goals = String::new();
    for &shape in &args.shape {
        // For the tenant trace, also the even static partition (each tenant pinned to a worker).
        let (name, trace, pin): (&str, Vec<TraceRequest>, _) = match shape {
            TraceShape::Mooncake => ("mooncake", sim::load_trace(&args.trace)?, None),
            TraceShape::Tenants => {
                let tenants = TenantTrace {
                    seed: args.seed,
                    block_tokens: args.block_tokens,
                    ..TenantTrace::default()
                };
                ("tenants", tenants.generate(), Some(tenants.prefix_blocks))
            }
        };
        for &divisor in &args.capacity_divisor {
            for &workers in &args.workers {
                let config = SimConfig {
                    workers,
                    capacity_divisor: divisor,
                    pin_groups_of: pin,
                    measured_prefill: !args.unmeasured_prefill,
                    ..base.clone()
                };
                let report = sim::run(&trace, &config)?;
                if args.json {
                    println!("{}", run_json(name, divisor, &report));
                } else {
                    println!("== {name}, {workers} workers, cache ÷{divisor}");
                    print!("{}", report.header());
                    print!("{}", report.rows());
                    println!();
                }
                goal_line(&mut goals, name, divisor, &report);
            }
        }
    }
    if !args.json && !goals.is_empty() {
        println!("goal (issue 17): hit ≥ 0.97× pooled, TTFT p99 ≤ 0.9× the better anchor, imbalance ≤ 1.15");
        println!(
            "{:<9} {:>5} {:>7} {:<19} {:>9} {:>12} {:>9} {:>5}",
            "trace", "cache", "workers", "policy", "vs_pooled", "p99/anchor", "imbalance", "pass"
        );
        print!("{goals}");
    }
    Ok(())
}

fn goal_line(out: &mut String, trace: &str, divisor: usize, report: &SimReport) {
    for p in &report.policies {
        if sim::report::ANCHORS.contains(&p.policy.as_str()) || p.policy == "round-robin" {
            continue;
        }
        if let Some(g) = report.goal(&p.policy) {
            let _ = writeln!(
                out,
                "{:<9} {:>5} {:>7} {:<19} {:>8.3}x {:>11.3}x {:>9.3} {:>5}",
                trace,
                format!("÷{divisor}"),
                report.workers,
                g.policy,
                g.hit_vs_pooled,
                g.ttft_p99_vs_best_anchor,
                g.load_imbalance,
                if g.pass { "yes" } else { "no" }
            );
        }
    }
}

fn run_json(trace: &str, divisor: usize, report: &SimReport) -> String {
    serde_json::json!({
        "trace": trace,
        "workers": report.workers,
        "capacity_divisor": divisor,
        "capacity_blocks": report.capacity_blocks,
        "arrival_scale": report.arrival_scale,
        "pooled_hit_rate": report.pooled_hit_rate,
        "policies": report.policies,
    })
    .to_string()
}
