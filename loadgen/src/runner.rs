//! Runs load points: warm-up (not counted), then the workload under one [`Load`], with cleave's
//! counters read before and after.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::task::JoinSet;

use crate::arrival::{poisson, Load};
use crate::client::{send, RequestResult, Target};
use crate::progress::Progress;
use crate::scrape::{self, CleaveDelta};
use crate::stats::{summarise, PointStats, Slo};
use crate::workload::RequestSpec;

/// Settings shared by every load point.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The endpoint.
    pub target: Target,
    /// SLOs for goodput.
    pub slo: Slo,
    /// Stop sending new requests after this long (None: send the whole workload).
    pub duration: Option<Duration>,
    /// Seed of the Poisson arrivals.
    pub seed: u64,
    /// Draw a progress bar on stderr.
    pub progress: bool,
    /// The router's `/metrics` URL (None: do not read it).
    pub router_metrics: Option<String>,
    /// Workers' `/metrics` URLs.
    pub worker_metrics: Vec<String>,
}

/// The result of one load point.
#[derive(Clone, Debug, Serialize)]
pub struct PointResult {
    /// The load.
    pub load: Load,
    /// Latencies, throughput, goodput, errors.
    pub stats: PointStats,
    /// cleave's prefix hit rate and disaggregated fraction over the point.
    pub cleave: CleaveDelta,
    /// Per-request results (for the distribution charts; not in the JSON).
    #[serde(skip)]
    pub results: Vec<RequestResult>,
}

/// Sends `warmup` one at a time and discards the results; returns how many failed.
pub async fn warm(client: &reqwest::Client, cfg: &RunConfig, warmup: &[RequestSpec]) -> usize {
    let t0 = Instant::now();
    let mut failed = 0;
    for spec in warmup {
        if send(client, &cfg.target, spec, t0).await.error.is_some() {
            failed += 1;
        }
    }
    failed
}

/// Runs `workload` under `load` and summarises it.
pub async fn run_point(
    client: &reqwest::Client,
    cfg: &RunConfig,
    load: Load,
    workload: Vec<RequestSpec>,
) -> PointResult {
    let before = scrape::snapshot(client, cfg.router_metrics.as_deref(), &cfg.worker_metrics).await;
    let progress = Arc::new(Progress::new(workload.len(), load.label(), cfg.progress));
    let workload = Arc::new(workload);
    let t0 = Instant::now();
    let deadline = cfg.duration.map(|d| t0 + d);
    let mut set = JoinSet::new();
    match load {
        Load::Rate { .. } | Load::Replay { .. } => {
            let offsets: Vec<Duration> = match load {
                Load::Rate { rate } => poisson(rate, workload.len(), cfg.seed),
                _ => workload.iter().map(|s| s.at.unwrap_or_default()).collect(),
            };
            for (i, at) in offsets.into_iter().enumerate() {
                let when = t0 + at;
                if deadline.is_some_and(|d| when > d) {
                    break;
                }
                tokio::time::sleep_until(when.into()).await;
                let (client, target, workload, progress) = (
                    client.clone(),
                    cfg.target.clone(),
                    workload.clone(),
                    progress.clone(),
                );
                set.spawn(async move {
                    let r = send(&client, &target, &workload[i], t0).await;
                    progress.tick();
                    vec![r]
                });
            }
        }
        Load::Concurrency { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..concurrency.max(1) {
                let (client, target, workload, progress, next) = (
                    client.clone(),
                    cfg.target.clone(),
                    workload.clone(),
                    progress.clone(),
                    next.clone(),
                );
                set.spawn(async move {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= workload.len() || deadline.is_some_and(|d| Instant::now() > d) {
                            break;
                        }
                        out.push(send(&client, &target, &workload[i], t0).await);
                        progress.tick();
                    }
                    out
                });
            }
        }
    }
    let mut results = Vec::new();
    while let Some(r) = set.join_next().await {
        results.extend(r.unwrap_or_default());
    }
    progress.finish();
    results.sort_by(|a, b| a.sent_s.total_cmp(&b.sent_s));
    let after = scrape::snapshot(client, cfg.router_metrics.as_deref(), &cfg.worker_metrics).await;
    PointResult {
        load,
        stats: summarise(&results, &cfg.slo),
        cleave: scrape::delta(&before, &after),
        results,
    }
}
