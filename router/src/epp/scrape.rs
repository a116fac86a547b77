//! Load of vLLM- and SGLang-style model servers from their Prometheus `/metrics`, scraped
//! every interval into the placement view (cleave decode workers report load on their own
//! `Watch` stream instead, [`crate::watch`]).
//!
//! Read per server (summed over label sets, e.g. per model or engine):
//! - queued requests: `vllm:num_requests_waiting` or `sglang:num_queue_reqs` (required);
//! - running requests: `vllm:num_requests_running` or `sglang:num_running_reqs`;
//! - KV cache usage in [0, 1]: `vllm:kv_cache_usage_perc` (vLLM V1), `vllm:gpu_cache_usage_perc`
//!   (V0) or `sglang:token_usage` (the largest over label sets).
//!
//! and turned into the router's [`Load`] units ([`to_load`]): `queue_depth` = waiting + running,
//! `decode_blocks` = usage × the server's KV capacity in blocks (configured), `prefill_blocks` =
//! waiting × the mean prompt length (in blocks) of the requests this picker has placed. The
//! picker's own optimistic charges count too ([`crate::place::WorkerView`]: the larger wins).
//!
//! The text is parsed here rather than with `prometheus-parse`: that crate's name pattern
//! (`\w+`) drops every metric with a colon, which is all of vLLM's and SGLang's.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cleave_kv_index::WorkerId;
use tokio_util::sync::CancellationToken;

use crate::dispatch::Cluster;
use crate::place::Load;

/// What one scrape says.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ServerLoad {
    /// Requests waiting to be scheduled.
    pub waiting: f64,
    /// Requests running.
    pub running: f64,
    /// KV cache usage in [0, 1] (0 when not exported).
    pub kv_usage: f64,
}

/// Why a scrape gave no load.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The HTTP request failed or answered with an error status.
    #[error("fetching the metrics")]
    Http(#[from] reqwest::Error),
    /// The text has no queue metric of a known engine.
    #[error("no vllm:num_requests_waiting or sglang:num_queue_reqs in the metrics")]
    NoQueueMetric,
}

const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
const RUNNING: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];
const KV_USAGE: [&str; 3] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];

/// The samples of a Prometheus text exposition as `(name, value)`; comments, malformed lines
/// and non-finite values are skipped.
fn samples(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines().filter_map(|line| {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            return None;
        }
        // `name{labels} value [timestamp]`; label values may hold spaces, so split after `}`.
        let (name, rest) = match line.find('{') {
            Some(open) => {
                let close = open + line[open..].find('}')?;
                (&line[..open], &line[close + 1..])
            }
            None => line.split_once(char::is_whitespace)?,
        };
        let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
        value.is_finite().then_some((name.trim(), value))
    })
}

/// Reads a server's load from its metrics text.
pub fn parse(text: &str) -> Result<ServerLoad, ScrapeError> {
    let mut load = ServerLoad::default();
    let mut saw_queue = false;
    for (name, value) in samples(text) {
        if WAITING.contains(&name) {
            saw_queue = true;
            load.waiting += value.max(0.0);
        } else if RUNNING.contains(&name) {
            load.running += value.max(0.0);
        } else if KV_USAGE.contains(&name) {
            load.kv_usage = load.kv_usage.max(value.clamp(0.0, 1.0));
        }
    }
    if saw_queue {
        Ok(load)
    } else {
        Err(ScrapeError::NoQueueMetric)
    }
}

/// The mean prompt length, in blocks, of the requests placed so far (an exponentially
/// weighted mean, stored in thousandths), shared by the picker and the scrapers.
#[derive(Debug, Default)]
pub struct PromptBlocks(AtomicU64);

impl PromptBlocks {
    /// Folds one placed request's prompt blocks in (weight 1/16).
    pub fn observe(&self, blocks: usize) {
        let new = (blocks as u64).saturating_mul(1000);
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(if old == 0 {
                    new
                } else {
                    old - old / 16 + new / 16
                })
            });
    }

    /// The mean (1 before any request).
    pub fn mean(&self) -> f64 {
        match self.0.load(Ordering::Relaxed) {
            0 => 1.0,
            v => v as f64 / 1000.0,
        }
    }
}

/// A server's load in the router's units (see the module docs).
pub fn to_load(l: ServerLoad, kv_capacity_blocks: u64, mean_prompt_blocks: f64) -> Load {
    Load {
        prefill_blocks: (l.waiting * mean_prompt_blocks).round() as u64,
        decode_blocks: (l.kv_usage * kv_capacity_blocks as f64).round() as u64,
        queue_depth: (l.waiting + l.running).round() as u64,
        // Not reported: `kv_capacity_blocks` is a configured guess and the index may know
        // nothing of the server's cache, so the cost does not assume free space there.
        kv_capacity_blocks: 0,
    }
}

/// How one server is scraped.
#[derive(Clone, Debug)]
pub struct ScrapeConfig {
    /// Time between scrapes (also the request timeout).
    pub interval: Duration,
    /// KV capacity of one server, in blocks.
    pub kv_capacity_blocks: u64,
}

/// Failed scrapes in a row after which a server is taken out of placement.
pub const FAILURES_UNHEALTHY: u32 = 3;

/// Scrapes `url` into worker `id`'s load until `stop`: a good scrape marks it healthy,
/// [`FAILURES_UNHEALTHY`] failed ones in a row unhealthy (it is not placed on until it answers
/// again). Each scrape may take the interval, but at least a second.
pub async fn follow(
    cluster: Arc<Cluster>,
    id: WorkerId,
    url: String,
    config: ScrapeConfig,
    prompts: Arc<PromptBlocks>,
    stop: CancellationToken,
) {
    let http = match reqwest::Client::builder()
        .timeout(config.interval.max(Duration::from_secs(1)))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "no HTTP client for scraping");
            return;
        }
    };
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut healthy = None;
    let mut failures = 0u32;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let result = async {
            let text = http
                .get(&url)
                .send()
                .await?
                .error_for_status()?
                .text()
                .await?;
            parse(&text)
        }
        .await;
        let ok = cluster.placement().with_view(|view| {
            view.get(id)?;
            let ok = match result {
                Ok(l) => {
                    view.report(id, to_load(l, config.kv_capacity_blocks, prompts.mean()));
                    failures = 0;
                    true
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        tracing::warn!(worker = %id, %url, error = %e, "scraping the model server failed");
                    }
                    healthy == Some(true) && failures < FAILURES_UNHEALTHY
                }
            };
            view.set_healthy(id, ok);
            Some(ok)
        });
        let Some(ok) = ok else { return };
        if healthy != Some(ok) && ok {
            tracing::info!(worker = %id, %url, "model server healthy");
        }
        healthy = Some(ok);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:request_success_total{finished_reason="stop",model_name="m b"} 7.0
"#;

    #[test]
    fn parses_vllm_v1_metrics() {
        let l = parse(VLLM).expect("load");
        assert_eq!(
            l,
            ServerLoad {
                waiting: 7.0,
                running: 3.0,
                kv_usage: 0.5
            }
        );
        assert_eq!(
            to_load(l, 1000, 4.0),
            Load {
                prefill_blocks: 28,
                decode_blocks: 500,
                queue_depth: 10,
                kv_capacity_blocks: 0,
            }
        );
    }

    #[test]
    fn parses_vllm_v0_and_sglang_names() {
        // (server, exposition, expected waiting, running, kv_usage)
        let cases = [
            (
                "v0",
                "vllm:num_requests_waiting 1\nvllm:gpu_cache_usage_perc 0.9 1700000000\n",
                (1.0, 0.0, 0.9),
            ),
            (
                "sglang",
                "sglang:num_queue_reqs{model_name=\"x\"} 4\nsglang:num_running_reqs{model_name=\"x\"} 2\nsglang:token_usage{model_name=\"x\"} 1.5\n",
                (4.0, 2.0, 1.0),
            ),
        ];
        for (server, text, (waiting, running, kv_usage)) in cases {
            assert_eq!(
                parse(text).expect(server),
                ServerLoad {
                    waiting,
                    running,
                    kv_usage
                },
                "{server}"
            );
        }
    }

    #[test]
    fn text_without_a_queue_metric_is_an_error() {
        assert!(matches!(
            parse("cleave_worker_queue_depth 3\ngarbage line\n{}\n"),
            Err(ScrapeError::NoQueueMetric)
        ));
        assert!(matches!(parse(""), Err(ScrapeError::NoQueueMetric)));
        // A malformed value is skipped, not read as zero.
        assert!(parse("vllm:num_requests_waiting NaN-ish\n").is_err());
    }

    #[test]
    fn prompt_mean_moves_towards_what_is_placed() {
        let p = PromptBlocks::default();
        assert_eq!(p.mean(), 1.0);
        p.observe(16);
        assert_eq!(p.mean(), 16.0);
        for _ in 0..200 {
            p.observe(32);
        }
        assert!((p.mean() - 32.0).abs() < 0.5, "mean {}", p.mean());
    }
}
