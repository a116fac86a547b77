//! `cleave bench serve`: drive an OpenAI-compatible endpoint with a Mooncake trace or synthetic
//! load (open or closed loop, a sweep of loads), and report TTFT, ITL and E2E percentiles,
//! throughput, goodput, errors, and cleave's prefix hit rate and disaggregated fraction, under a
//! header that states what a fair comparison holds equal. The engine is [`cleave_loadgen`].

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use cleave_loadgen::arrival::Load;
use cleave_loadgen::client::{Api, Target};
use cleave_loadgen::report::{describe_lengths, machine, measured_prefix_overlap, Header, Report};
use cleave_loadgen::runner::{self, RunConfig};
use cleave_loadgen::stats::Slo;
use cleave_loadgen::tokens::{PromptFormat, TokenMap};
use cleave_loadgen::trace::{self, TraceSample, TraceScale, MOONCAKE_BLOCK_TOKENS};
use cleave_loadgen::workload::{self, LengthDist, RequestSpec, Synthetic};

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
    /// Open loop: Poisson arrivals at these rates (req/s), one load point each.
    #[arg(long, value_delimiter = ',', conflicts_with_all = ["concurrency", "replay"])]
    pub rate: Vec<f64>,
    /// Closed loop: these many requests in flight, one load point each.
    #[arg(long, value_delimiter = ',', conflicts_with = "replay")]
    pub concurrency: Vec<usize>,
    /// Trace: send on the trace's timestamps multiplied by these time scales (0.5 = twice as
    /// fast), one load point each.
    #[arg(long, value_delimiter = ',')]
    pub replay: Vec<f64>,
    /// Stop sending new requests after this many seconds of a load point.
    #[arg(long)]
    pub duration: Option<f64>,
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
    /// Per-request timeout, s.
    #[arg(long, default_value_t = 300.0)]
    pub timeout: f64,
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

/// Flags of `cleave bench serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Base URL of the OpenAI API (with or without the trailing /v1).
    #[arg(long)]
    pub url: String,
    /// The `model` to request (default: the first of GET /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// The router's Prometheus endpoint (default: URL's /metrics; "none" to skip).
    #[arg(long)]
    pub metrics: Option<String>,
    /// Workers' Prometheus endpoints, for the prefix-cache hit rate (repeatable).
    #[arg(long)]
    pub worker_metrics: Vec<String>,
    /// Stated weight quantization for the header (default: guessed from the model name).
    #[arg(long)]
    pub quantization: Option<String>,
    /// Stated KV cache dtype for the header.
    #[arg(long, default_value = "not stated (--kv-dtype)")]
    pub kv_dtype: String,
    /// Stated context limit for the header.
    #[arg(long, default_value = "not stated (--context)")]
    pub context: String,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// `http://h:p`, `http://h:p/v1` or `http://h:p/v1/` → (`http://h:p/v1`, `http://h:p`).
pub fn split_url(url: &str) -> anyhow::Result<(String, String)> {
    let u = url.trim_end_matches('/');
    if !(u.starts_with("http://") || u.starts_with("https://")) {
        bail!("--url must start with http:// or https://, got {url:?}");
    }
    let root = u.strip_suffix("/v1").unwrap_or(u).to_string();
    Ok((format!("{root}/v1"), root))
}

/// A quantization name inside a model or file name (Q4_1, Q8_0, F16, ...).
pub fn guess_quantization(name: &str) -> String {
    let upper = name.to_uppercase();
    for part in upper.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
        let q = part.starts_with('Q') && part[1..].starts_with(|c: char| c.is_ascii_digit());
        let iq = part.starts_with("IQ") && part.len() > 2;
        if q || iq || ["F16", "BF16", "F32"].contains(&part) {
            return part.to_string();
        }
    }
    "not stated (--quantization)".into()
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
            let full = cleave_router::sim::load_trace(path)?;
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
            + &a.duration.map(|d| format!(" (at most {d} s each)")).unwrap_or_default(),
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

/// Runs every load point against one endpoint.
pub async fn run_all(
    a: &LoadArgs,
    cfg: &RunConfig,
    mut header: Header,
    loads: &[Load],
) -> anyhow::Result<Report> {
    let client = reqwest::Client::new();
    let map = TokenMap {
        seed: a.seed ^ 0xa11,
        ..TokenMap::default()
    };
    let warm = workload::warmup(a.warmup, 64, 8, &map, a.prompt_format);
    let failed = runner::warm(&client, cfg, &warm).await;
    if failed > 0 {
        header.warmup.push_str(&format!(" ({failed} failed)"));
    }
    let mut points = Vec::new();
    for (i, load) in loads.iter().enumerate() {
        let (reqs, _) = workload(a, i, load)?;
        points.push(runner::run_point(&client, cfg, *load, reqs).await);
    }
    Ok(Report { header, points })
}

/// A run configuration for `target` from the flags.
pub fn run_config(
    a: &LoadArgs,
    target: Target,
    router_metrics: Option<String>,
    worker_metrics: Vec<String>,
) -> RunConfig {
    RunConfig {
        target,
        slo: Slo {
            ttft_ms: a.slo_ttft_ms,
            itl_ms: a.slo_itl_ms,
        },
        duration: a.duration.map(Duration::from_secs_f64),
        seed: a.seed,
        progress: !a.no_progress,
        router_metrics,
        worker_metrics,
    }
}

/// The model the endpoint serves (first of /v1/models).
pub async fn served_model(base: &str) -> anyhow::Result<String> {
    let url = format!("{base}/models");
    let text = reqwest::get(&url)
        .await
        .with_context(|| format!("GET {url}"))?
        .text()
        .await
        .with_context(|| format!("GET {url}"))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("GET {url}: not JSON: {text:.200}"))?;
    v.pointer("/data/0/id")
        .and_then(|m| m.as_str())
        .map(str::to_string)
        .with_context(|| format!("{url} lists no model; pass --model"))
}

/// Entry point of `cleave bench serve`.
pub fn bench_serve(args: ServeArgs) -> anyhow::Result<()> {
    let (base, root) = split_url(&args.url)?;
    let loads = loads(&args.load)?;
    let (first, desc) = workload(&args.load, 0, &loads[0])?;
    let rt = tokio::runtime::Runtime::new()?;
    let report = rt.block_on(async {
        let model = match &args.model {
            Some(m) => m.clone(),
            None => served_model(&base).await?,
        };
        let mut header = workload_header(&args.load, &loads, &first, desc);
        header.endpoint = base.clone();
        header.quantization = args
            .quantization
            .clone()
            .unwrap_or_else(|| guess_quantization(&model));
        header.model = model.clone();
        header.kv_dtype = args.kv_dtype.clone();
        header.context_limit = args.context.clone();
        let metrics = match args.metrics.as_deref() {
            Some("none") => None,
            Some(m) => Some(m.to_string()),
            None => Some(format!("{root}/metrics")),
        };
        let target = Target {
            base: base.clone(),
            model,
            api: args.load.api,
            ignore_eos: !args.load.no_ignore_eos,
            timeout: Duration::from_secs_f64(args.load.timeout),
        };
        let cfg = run_config(&args.load, target, metrics, args.worker_metrics.clone());
        run_all(&args.load, &cfg, header, &loads).await
    })?;
    print_report(&args.load, &[("run".to_string(), report)])
}

/// Prints one report (or a comparison) as a table or JSON and writes the charts.
pub fn print_report(a: &LoadArgs, reports: &[(String, Report)]) -> anyhow::Result<()> {
    if a.json {
        let v = if reports.len() == 1 {
            serde_json::to_value(&reports[0].1)?
        } else {
            serde_json::to_value(cleave_loadgen::report::Comparison {
                configs: reports.to_vec(),
            })?
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if reports.len() == 1 {
        print!("{}", reports[0].1.to_table());
    } else {
        print!(
            "{}",
            cleave_loadgen::report::Comparison {
                configs: reports.to_vec()
            }
            .to_table()
        );
    }
    if let Some(dir) = &a.plot {
        let refs: Vec<(String, &Report)> = reports.iter().map(|(n, r)| (n.clone(), r)).collect();
        for p in cleave_loadgen::plot::write_charts(dir, &refs)? {
            eprintln!("chart: {}", p.display());
        }
    }
    Ok(())
}
