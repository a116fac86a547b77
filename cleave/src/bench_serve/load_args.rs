//! The workload and load flags shared by `bench serve` and `bench compare`, and what they
//! build: the load points, each point's requests, and the workload half of the header.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::Args;
use cleave_loadgen::arrival::Load;
use cleave_loadgen::client::Api;
use cleave_loadgen::report::{describe_lengths, machine, measured_prefix_overlap, Header};
use cleave_loadgen::tokens::{PromptFormat, TokenMap};
use cleave_loadgen::trace::{self, TraceSample, TraceScale, MOONCAKE_BLOCK_TOKENS};
use cleave_loadgen::workload::{LengthDist, RequestSpec, Synthetic};
use cleave_types::duration::parse_positive_duration;

/// What is sent and how fast: shared by `bench serve` and `bench compare`.
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// Mooncake-format trace (JSON lines); without it the load is synthetic.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Trace: keep only the first K sessions (requests whose first block is among the first K
    /// distinct first blocks), which keeps the trace's multi-turn prefix reuse in a small sample.
    #[arg(long)]
    pub sessions: Option<usize>,
    /// Requests per load point (trace: the first N of the sample; synthetic: how many).
    #[arg(long, default_value_t = 50)]
    pub requests: usize,
    /// Trace: prompt lengths (and the 512-token blocks) are multiplied by this.
    #[arg(long, default_value_t = 1.0 / 64.0)]
    pub input_scale: f64,
    /// Trace: output lengths are multiplied by this.
    #[arg(long, default_value_t = 0.25)]
    pub output_scale: f64,
    /// Cap on prompt tokens after scaling.
    #[arg(long)]
    pub max_input: Option<usize>,
    /// Cap on output tokens after scaling.
    #[arg(long, default_value_t = 64)]
    pub max_output: usize,
    /// Synthetic: mean prompt tokens.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Synthetic: prompt lengths uniform within ±this fraction of the mean.
    #[arg(long, default_value_t = 0.5)]
    pub input_spread: f64,
    /// Synthetic: mean output tokens.
    #[arg(long, default_value_t = 32)]
    pub output_len: usize,
    /// Synthetic: output lengths uniform within ±this fraction of the mean.
    #[arg(long, default_value_t = 0.0)]
    pub output_spread: f64,
    /// Synthetic: fraction of each prompt taken from a shared prefix.
    #[arg(long, default_value_t = 0.0)]
    pub prefix_fraction: f64,
    /// Synthetic: how many distinct shared prefixes.
    #[arg(long, default_value_t = 4)]
    pub prefix_groups: usize,
    /// Open loop: Poisson arrivals at these rates (req/s), one load point each (may be given
    /// with `--concurrency`: both sweeps run, each charted against its own axis).
    #[arg(long, value_delimiter = ',', conflicts_with = "replay")]
    pub rate: Vec<f64>,
    /// Closed loop: these many requests in flight, one load point each.
    #[arg(long, value_delimiter = ',', conflicts_with = "replay")]
    pub concurrency: Vec<usize>,
    /// Trace: send on the trace's timestamps multiplied by these time scales (0.5 = twice as
    /// fast), one load point each.
    #[arg(long, value_delimiter = ',')]
    pub replay: Vec<f64>,
    /// Stop sending new requests after this long into a load point (`90s`, `2m`; a plain
    /// number is seconds).
    #[arg(long, value_parser = parse_positive_duration)]
    pub duration: Option<Duration>,
    /// Warm-up requests before the first load point (sent one at a time, not counted).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Send prompts as token ids (exact lengths) or as words.
    #[arg(long, value_enum, default_value = "tokens")]
    pub prompt_format: PromptFormat,
    /// The OpenAI route.
    #[arg(long, value_enum, default_value = "completions")]
    pub api: Api,
    /// Do not send `ignore_eos: true` (outputs may then end before their stated length).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Goodput's TTFT SLO, ms.
    #[arg(long, default_value_t = 2000.0)]
    pub slo_ttft_ms: f64,
    /// Goodput's SLO on each request's mean inter-token latency, ms.
    #[arg(long, default_value_t = 100.0)]
    pub slo_itl_ms: f64,
    /// Seed of prompts, lengths and arrivals.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Per-request timeout (a plain number is seconds).
    #[arg(long, value_parser = parse_positive_duration, default_value = "300s")]
    pub timeout: Duration,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Print the results as JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write PNG charts into this directory.
    #[arg(long)]
    pub plot: Option<PathBuf>,
}

/// The load points the flags ask for (default: one point at 1 req/s).
pub fn loads(a: &LoadArgs) -> anyhow::Result<Vec<Load>> {
    let mut out: Vec<Load> = Vec::new();
    for &rate in &a.rate {
        anyhow::ensure!(
            rate > 0.0 && rate.is_finite(),
            "--rate must be > 0, got {rate}"
        );
        out.push(Load::Rate { rate });
    }
    for &concurrency in &a.concurrency {
        anyhow::ensure!(concurrency > 0, "--concurrency must be ≥ 1");
        out.push(Load::Concurrency { concurrency });
    }
    for &time_scale in &a.replay {
        anyhow::ensure!(
            a.trace.is_some(),
            "--replay needs --trace (synthetic load has no timestamps)"
        );
        anyhow::ensure!(
            time_scale > 0.0,
            "--replay time scale must be > 0, got {time_scale}"
        );
        out.push(Load::Replay { time_scale });
    }
    if out.is_empty() {
        out.push(Load::Rate { rate: 1.0 });
    }
    Ok(out)
}

/// The workload of load point `point` (fresh prompts per point, so one point's cache does not
/// help the next) and a description of it for the header.
pub fn workload(
    a: &LoadArgs,
    point: usize,
    load: &Load,
) -> anyhow::Result<(Vec<RequestSpec>, String)> {
    anyhow::ensure!(a.requests > 0, "--requests must be ≥ 1");
    if a.api == Api::Chat && a.prompt_format == PromptFormat::Tokens {
        bail!("--api chat needs --prompt-format text");
    }
    let map = TokenMap {
        seed: a.seed.wrapping_add(point as u64 * 0x9e37),
        ..TokenMap::default()
    };
    match &a.trace {
        Some(path) => {
            let full = cleave_route_sim::load_trace(path)?;
            let sample = TraceSample {
                sessions: a.sessions,
                limit: Some(a.requests),
            };
            let picked = trace::sample(&full, &sample);
            let scale = TraceScale {
                input_scale: a.input_scale,
                output_scale: a.output_scale,
                max_input: a.max_input,
                max_output: Some(a.max_output),
                source_block_tokens: MOONCAKE_BLOCK_TOKENS,
            };
            let time_scale = match load {
                Load::Replay { time_scale } => *time_scale,
                _ => 1.0,
            };
            let reqs = trace::to_requests(&picked, &scale, &map, a.prompt_format, time_scale)?;
            let desc = format!(
                "trace {} ({} of {} requests{}); lengths scaled: input ×{} ({}-token blocks), output ×{}, caps input {}, output {}; trace prefix overlap {:.1}% of blocks",
                path.display(),
                picked.len(),
                full.len(),
                a.sessions.map(|k| format!(", first {k} sessions")).unwrap_or_default(),
                a.input_scale,
                scale.block_tokens(),
                a.output_scale,
                a.max_input.map(|m| m.to_string()).unwrap_or_else(|| "none".into()),
                a.max_output,
                trace::prefix_overlap(&picked) * 100.0
            );
            Ok((reqs, desc))
        }
        None => {
            let syn = Synthetic {
                input: LengthDist {
                    mean: a.input_len,
                    spread: a.input_spread,
                },
                output: LengthDist {
                    mean: a.output_len.min(a.max_output),
                    spread: a.output_spread,
                },
                prefix_fraction: a.prefix_fraction,
                prefix_groups: a.prefix_groups,
                requests: a.requests,
                seed: a.seed.wrapping_add(point as u64),
            };
            let reqs = syn.generate(&map, a.prompt_format)?;
            let desc = format!(
                "synthetic: {} requests, prompt {}±{:.0}%, output {}±{:.0}% (uniform), shared prefix {:.0}% of each prompt from {} prefixes",
                a.requests, a.input_len, a.input_spread * 100.0, a.output_len.min(a.max_output), a.output_spread * 100.0,
                a.prefix_fraction * 100.0, a.prefix_groups
            );
            Ok((reqs, desc))
        }
    }
}

/// The header fields that depend on the workload and loads, not on the endpoint.
pub fn workload_header(
    a: &LoadArgs,
    loads: &[Load],
    first: &[RequestSpec],
    desc: String,
) -> Header {
    Header {
        load: loads.iter().map(|l| l.label()).collect::<Vec<_>>().join(", ")
            + &a.duration.map(|d| format!(" (at most {} s each)", d.as_secs_f64())).unwrap_or_default(),
        workload: desc,
        prompt_lengths: describe_lengths(&first.iter().map(|s| s.prompt_tokens).collect::<Vec<_>>()),
        output_lengths: describe_lengths(&first.iter().map(|s| s.max_tokens).collect::<Vec<_>>()),
        prefix_overlap: measured_prefix_overlap(first),
        warmup: format!("{} requests of 64 prompt / 8 output tokens, unrelated prompts, sent one at a time before the first point", a.warmup),
        slo: format!("TTFT ≤ {} ms and mean ITL ≤ {} ms per request", a.slo_ttft_ms, a.slo_itl_ms),
        machine: machine(),
        notes: format!(
            "prompts as {:?} via /v1/{}; ignore_eos {}; seed {}; fresh prompts per load point",
            a.prompt_format,
            if a.api == Api::Chat { "chat/completions" } else { "completions" },
            !a.no_ignore_eos,
            a.seed
        ),
        ..Header::default()
    }
}
