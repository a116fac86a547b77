//! `cleave bench route`: routing at scale, simulated. Replays a Mooncake-format trace through the
//! router's real prefix index and placement policies against simulated workers
//! ([`cleave_router::sim`]) and prints, per policy, the prefix hit rate (next to one pooled
//! cache's), load imbalance, simulated TTFT and placement decisions per second.

use std::path::PathBuf;

use clap::Args;
use cleave_router::place::PolicyKind;
use cleave_router::sim::{self, SimConfig, TimeModel};

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
    /// Simulated workers (each prefills and decodes).
    #[arg(long, default_value_t = 8)]
    pub workers: usize,
    /// Prefix-cache blocks per worker. Default: unique blocks in the trace / workers / 4 (at
    /// least the longest prompt), so the caches are under pressure.
    #[arg(long)]
    pub capacity_blocks: Option<usize>,
    /// Tokens per trace block (512 for the Mooncake traces).
    #[arg(long, default_value_t = 512)]
    pub block_tokens: u64,
    /// Prefill throughput of one worker, uncached tokens per second.
    #[arg(long, default_value_t = TimeModel::default().prefill_tokens_per_s)]
    pub prefill_tokens_per_s: f64,
    /// Decode cost per output token on one worker, seconds (amortised over its batch).
    #[arg(long, default_value_t = TimeModel::default().decode_s_per_token)]
    pub decode_s_per_token: f64,
    /// Weight of a request's uncached prompt blocks in prefix-load's cost.
    #[arg(long, default_value_t = sim::DEFAULT_SIM_PREFILL_WEIGHT)]
    pub prefill_weight: f64,
    /// Weight of the prefill blocks already queued on a worker in prefix-load's cost.
    #[arg(long, default_value_t = sim::DEFAULT_SIM_QUEUED_PREFILL_WEIGHT)]
    pub queued_prefill_weight: f64,
    /// Policies to compare (default: all, prefix-load first).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// Seed of the policies' RNG.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// Print `{"pooled_hit_rate", "policies": [...]}` instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Runs the simulation and prints the table or JSON.
pub fn bench_route(args: RouteArgs) -> anyhow::Result<()> {
    let trace = sim::load_trace(&args.trace)?;
    let mut config = SimConfig {
        workers: args.workers,
        capacity_blocks: args.capacity_blocks,
        block_tokens: args.block_tokens,
        time: TimeModel {
            prefill_tokens_per_s: args.prefill_tokens_per_s,
            decode_s_per_token: args.decode_s_per_token,
        },
        ..SimConfig::default()
    };
    config.place.prefill_weight = args.prefill_weight;
    config.place.queued_prefill_weight = args.queued_prefill_weight;
    config.place.seed = args.seed;
    if !args.policies.is_empty() {
        config.policies = args.policies;
    }
    let report = sim::run(&trace, &config)?;
    if args.json {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_table());
    }
    Ok(())
}
