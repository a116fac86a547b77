//! `cleave bench serve`: drive an OpenAI-compatible endpoint with a Mooncake trace or synthetic
//! load (open or closed loop, a sweep of loads), and report TTFT, ITL and E2E percentiles,
//! throughput, goodput, errors, and cleave's prefix hit rate and disaggregated fraction, under a
//! header that states what a fair comparison holds equal. The engine is [`cleave_loadgen`].

use anyhow::{bail, Context};
use clap::Args;
use cleave_loadgen::arrival::Load;
use cleave_loadgen::client::Target;
use cleave_loadgen::report::{Header, Report};
use cleave_loadgen::runner::{self, PointResult, RunConfig};
use cleave_loadgen::stats::Slo;
use cleave_loadgen::tokens::TokenMap;
use cleave_loadgen::workload;

mod load_args;
pub use load_args::{loads, workload, workload_header, LoadArgs};

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

/// Sends the warm-up requests (not counted); notes failures in the header.
pub async fn warm_up(a: &LoadArgs, cfg: &RunConfig, mut header: Header) -> Header {
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
    header
}

/// Runs load point `i` (its own fresh prompts) against one endpoint.
pub async fn run_point(
    a: &LoadArgs,
    cfg: &RunConfig,
    i: usize,
    load: &Load,
) -> anyhow::Result<PointResult> {
    let client = reqwest::Client::new();
    let (reqs, _) = workload(a, i, load)?;
    Ok(runner::run_point(&client, cfg, *load, reqs).await)
}

/// Runs every load point against one endpoint.
pub async fn run_all(
    a: &LoadArgs,
    cfg: &RunConfig,
    header: Header,
    loads: &[Load],
) -> anyhow::Result<Report> {
    let header = warm_up(a, cfg, header).await;
    let mut points = Vec::new();
    for (i, load) in loads.iter().enumerate() {
        points.push(run_point(a, cfg, i, load).await?);
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
        duration: a.duration,
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
            timeout: args.load.timeout,
        };
        let cfg = run_config(&args.load, target, metrics, args.worker_metrics.clone());
        run_all(&args.load, &cfg, header, &loads).await
    })?;
    print_report(&args.load, &[("run".to_string(), report)], false)
}

/// Prints one report (or a comparison; ratios only between equal compute unless
/// `allow_unequal`) as a table or JSON and writes the charts.
pub fn print_report(
    a: &LoadArgs,
    reports: &[(String, Report)],
    allow_unequal: bool,
) -> anyhow::Result<()> {
    let comparison = (reports.len() > 1)
        .then(|| cleave_loadgen::report::Comparison::new(reports.to_vec(), allow_unequal));
    if a.json {
        let v = match &comparison {
            Some(c) => serde_json::to_value(c)?,
            None => serde_json::to_value(&reports[0].1)?,
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        match &comparison {
            Some(c) => print!("{}", c.to_table()),
            None => print!("{}", reports[0].1.to_table()),
        }
    }
    if let Some(c) = comparison
        .as_ref()
        .filter(|c| !c.unequal_compute.is_empty())
    {
        // Loud on stderr too, so it is seen when stdout goes to a file.
        eprint!(
            "{}",
            cleave_loadgen::resources::unequal_banner(
                &c.configs[0].0,
                &c.unequal_compute,
                allow_unequal
            )
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
