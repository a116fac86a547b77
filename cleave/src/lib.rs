//! The `cleave` command line: fetch the default model, generate text, score a file, benchmark
//! the engine. `main.rs` only parses arguments and calls [`run`].

#![forbid(unsafe_code)]

pub mod bench;
pub mod bench_collectives;
pub mod bench_compare;
pub mod bench_index;
pub mod bench_overload;
pub mod bench_quants;
pub mod bench_route;
pub mod bench_serve;
pub mod bench_structured;
pub mod bench_tp_deviation;
pub mod fetch;
pub mod fuzz;
pub mod generate;
pub mod http;
pub mod load;
pub mod score;
pub mod soak;
pub mod up;

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};

/// cleave: disaggregated LLM serving. These commands run the engine locally.
#[derive(Debug, Parser)]
#[command(name = "cleave", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start the router and the workers locally (the OpenAI API at http://127.0.0.1:8000/v1).
    Up(up::UpArgs),
    /// Run one worker (what `cleave up` starts; also the `cleave-prefill`/`cleave-decode` binaries).
    Worker(WorkerArgs),
    /// Run the router (what `cleave up` starts; also the `cleave-router` binary).
    Router(cleave_router::config::RouterConfig),
    /// Manage the default model.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Generate text from a prompt, streaming it to stdout.
    Generate(generate::GenerateArgs),
    /// Chat with the model on the terminal (one line per turn, empty line or EOF to quit).
    Chat(generate::ChatArgs),
    /// Teacher-forced scoring of a text file: token ids, perplexity, next-token argmax.
    Score(score::ScoreArgs),
    /// Random and mutated inputs against the API, the workers' gRPC, the KV transport's wire,
    /// the GGUF parser and the chat templates; fails when any case panics, hangs or gets an
    /// answer outside the protocol.
    Fuzz(fuzz::FuzzArgs),
    /// Mixed traffic through a local `cleave up` for a long time while a random worker is
    /// killed and restarted every few minutes: every request ends, KV blocks return to zero,
    /// no panic (a non-zero exit otherwise).
    Soak(Box<soak::SoakArgs>),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        command: BenchCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Download the default model (SmolLM2-135M-Instruct Q4_1) into the cache and print its path.
    Fetch {
        /// Download again even if a verified copy is cached.
        #[arg(long)]
        force: bool,
    },
    /// Print where the default model is (or would be) cached.
    Path,
    /// Describe a GGUF file: architecture, tensor-type histogram, context length, vocabulary,
    /// and whether cleave can run it (if not, every reason why).
    Inspect {
        /// The GGUF file.
        file: PathBuf,
    },
    /// Write a tiny random-weight model (Hugging Face layout, byte-level tokenizer) into DIR:
    /// for trying `cleave up --ep N` / `--tp N` without downloading an MoE model. Its output
    /// is meaningless text.
    Tiny {
        /// Where to write `config.json`, `model.safetensors` and the tokenizer files.
        dir: PathBuf,
        /// Architecture: llama, mixtral, qwen2-moe (shared expert, a dense layer) or
        /// qwen3-moe.
        #[arg(long, default_value = "qwen3-moe")]
        kind: String,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Prefill and decode throughput of the engine (batch 1, 4, 16), peak RSS, and llama.cpp's
    /// numbers on the same file when llama-cpp-python is installed.
    Engine(bench::BenchArgs),
    /// GB/s of KV-block-shaped transfers over UCX and TCP, next to memcpy (and ucx_perftest).
    KvTransfer(bench::KvTransferArgs),
    /// Routing at scale, simulated: a Mooncake-format trace through the router's prefix index and
    /// placement policies against simulated workers (hit rate, load imbalance, TTFT, decisions/s).
    Route(bench_route::RouteArgs),
    /// Prefix-index speed on one core: a trace replayed as KV events and lookups (ops/s, lookup
    /// p50/p99, memory per cached block).
    Index(bench_index::IndexArgs),
    /// End-to-end serving benchmark of any OpenAI-compatible endpoint: a Mooncake trace or
    /// synthetic load, TTFT/ITL/E2E percentiles, goodput, sweeps, JSON and PNG charts.
    Serve(Box<bench_serve::ServeArgs>),
    /// The same workload against several local `cleave up` configurations, with ratios.
    Compare(Box<bench_compare::CompareArgs>),
    /// Open-loop load at a multiple of the measured capacity through a local `cleave up`:
    /// admitted TTFT against the admission SLO, 429s, peak RSS, and recovery afterwards.
    Overload(Box<bench_overload::OverloadArgs>),
    /// All-reduce and all-to-all bandwidth of local rank processes per message size, next to
    /// memcpy, over each transport.
    Collectives(bench_collectives::CollectivesArgs),
    /// What constrained decoding costs: decode ITL and tok/s at 1 and 16 concurrent requests,
    /// free vs each request with its own JSON schema, and schema compile time.
    Structured(bench_structured::StructuredArgs),
    /// How far a tensor-parallel group's logits are from one process's on long prompts
    /// (threads as ranks): argmax agreement and |Δ logprob| by position, and a check that
    /// chunked prefill is bit-identical at both sizes.
    TpDeviation(bench_tp_deviation::TpDeviationArgs),
    /// Quantizations of one model side by side on one thread: prefill and decode tok/s,
    /// perplexity on a reference text, argmax agreement with the first.
    Quants(bench_quants::QuantsArgs),
    /// One rank of `bench collectives` (started by it).
    #[command(hide = true)]
    CollectivesRank(bench_collectives::RankArgs),
}

/// Flags of `cleave worker`.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// prefill or decode.
    #[arg(long, value_enum)]
    pub role: cleave_worker::Role,
    #[command(flatten)]
    pub config: cleave_worker::WorkerConfig,
}

/// Options shared by every command that loads a model.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// A GGUF file or Hugging Face directory; default: the cached default model (fetched on
    /// first use).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: Option<PathBuf>,
    /// Compute threads (1 suits 2-vCPU machines).
    #[arg(long, default_value_t = 1, env = "CLEAVE_THREADS")]
    pub threads: usize,
}

/// Runs one command.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Model { command } => match command {
            ModelCommand::Fetch { force } => {
                let path = fetch::fetch_default_model(force)?;
                println!("{}", path.display());
                Ok(())
            }
            ModelCommand::Path => {
                println!("{}", cleave_text::gguf::default_model_path().display());
                Ok(())
            }
            ModelCommand::Inspect { file } => {
                let g = cleave_text::gguf::GgufFile::open(&file)
                    .with_context(|| format!("reading {}", file.display()))?;
                println!("{}", cleave_engine::inspect::inspect(&g));
                Ok(())
            }
            ModelCommand::Tiny { dir, kind, seed } => {
                use cleave_text::tiny;
                let k = tiny::parse_kind(&kind).with_context(|| {
                    format!("unknown --kind {kind:?}: use llama, mixtral, qwen2-moe or qwen3-moe")
                })?;
                tiny::write_model(&dir, k, cleave_text::safetensors::Dtype::F32, seed)
                    .with_context(|| format!("writing {}", dir.display()))?;
                println!("{}", dir.display());
                Ok(())
            }
        },
        Command::Up(args) => up::up(args),
        Command::Worker(args) => {
            let service = match args.role {
                cleave_worker::Role::Decode => cleave_decode_worker::SERVICE,
                cleave_worker::Role::Prefill => cleave_prefill_worker::SERVICE,
            };
            Ok(cleave_worker::serve_until_signal(service, args.config)?)
        }
        Command::Router(config) => Ok(cleave_router::serve::serve_until_signal(config)?),
        Command::Generate(args) => generate::generate(args),
        Command::Chat(args) => generate::chat(args),
        Command::Score(args) => score::score(args),
        Command::Fuzz(args) => fuzz::fuzz(args),
        Command::Soak(args) => soak::soak(*args),
        Command::Bench { command } => match command {
            BenchCommand::Engine(args) => bench::bench_engine(args),
            BenchCommand::Structured(args) => bench_structured::bench_structured(args),
            BenchCommand::TpDeviation(args) => bench_tp_deviation::tp_deviation(args),
            BenchCommand::Quants(args) => bench_quants::bench_quants(args),
            BenchCommand::KvTransfer(args) => bench::bench_kv_transfer(args),
            BenchCommand::Route(args) => bench_route::bench_route(args),
            BenchCommand::Index(args) => bench_index::bench_index(args),
            BenchCommand::Serve(args) => bench_serve::bench_serve(*args),
            BenchCommand::Compare(args) => bench_compare::bench_compare(*args),
            BenchCommand::Overload(args) => bench_overload::bench_overload(*args),
            BenchCommand::Collectives(args) => bench_collectives::bench_collectives(args),
            BenchCommand::CollectivesRank(args) => bench_collectives::bench_rank(args),
        },
    }
}
