//! Percentiles, per-load-point summaries and goodput.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::client::RequestResult;

/// The `p`-th percentile (0..=100) of `values` by linear interpolation between closest ranks
/// (NumPy's default); None for no values.
pub fn percentile(values: &[f64], p: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v: Vec<f64> = values.to_vec();
    v.sort_by(f64::total_cmp);
    Some(percentile_sorted(&v, p))
}

fn percentile_sorted(v: &[f64], p: f64) -> f64 {
    let rank = (p.clamp(0.0, 100.0) / 100.0) * (v.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

/// p50/p90/p99/mean of one latency, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Summary {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
    /// Samples.
    pub n: usize,
}

impl Summary {
    /// Summarises `seconds` in milliseconds (all zeros for no samples).
    pub fn of_seconds(seconds: &[f64]) -> Summary {
        if seconds.is_empty() {
            return Summary::default();
        }
        let mut v: Vec<f64> = seconds.iter().map(|s| s * 1000.0).collect();
        v.sort_by(f64::total_cmp);
        Summary {
            p50: percentile_sorted(&v, 50.0),
            p90: percentile_sorted(&v, 90.0),
            p99: percentile_sorted(&v, 99.0),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            n: v.len(),
        }
    }
}

/// Service-level objectives for goodput: a request is good when it succeeded, its TTFT is at
/// most `ttft_ms` and its own mean inter-token latency at most `itl_ms`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Slo {
    /// TTFT bound, ms.
    pub ttft_ms: f64,
    /// Mean-ITL bound per request, ms.
    pub itl_ms: f64,
}

impl Slo {
    /// Whether `r` meets both bounds.
    pub fn met(&self, r: &RequestResult) -> bool {
        let Some(ttft) = r.ttft_s else { return false };
        let itl_ok = if r.itl_s.is_empty() {
            true
        } else {
            r.itl_s.iter().sum::<f64>() / r.itl_s.len() as f64 * 1000.0 <= self.itl_ms
        };
        r.error.is_none() && ttft * 1000.0 <= self.ttft_ms && itl_ok
    }
}

/// Everything measured at one load point.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PointStats {
    /// Counted requests (warm-up excluded).
    pub requests: usize,
    /// Successful ones.
    pub ok: usize,
    /// Errors by kind.
    pub errors: BTreeMap<String, usize>,
    /// Time to first token.
    pub ttft_ms: Summary,
    /// Inter-token latency (all gaps of all successful requests).
    pub itl_ms: Summary,
    /// End-to-end latency of successful requests.
    pub e2e_ms: Summary,
    /// Wall time from the first send to the last completion, s.
    pub duration_s: f64,
    /// Generated tokens per second over the duration.
    pub output_tokens_per_s: f64,
    /// Successful requests per second.
    pub requests_per_s: f64,
    /// Requests meeting the SLOs per second.
    pub goodput_per_s: f64,
    /// Fraction of requests meeting the SLOs.
    pub slo_attainment: f64,
    /// Prompt tokens the server reported cached / prompt tokens (None: not reported).
    pub client_cached_fraction: Option<f64>,
}

/// Summarises the results of one load point.
pub fn summarise(results: &[RequestResult], slo: &Slo) -> PointStats {
    let ok: Vec<&RequestResult> = results.iter().filter(|r| r.error.is_none()).collect();
    let mut errors = BTreeMap::new();
    for r in results {
        if let Some(e) = &r.error {
            *errors.entry(e.clone()).or_insert(0) += 1;
        }
    }
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect();
    let e2e: Vec<f64> = ok.iter().map(|r| r.e2e_s).collect();
    let start = results
        .iter()
        .map(|r| r.sent_s)
        .fold(f64::INFINITY, f64::min);
    let end = results
        .iter()
        .map(|r| r.sent_s + r.e2e_s)
        .fold(f64::NEG_INFINITY, f64::max);
    let duration = if results.is_empty() {
        0.0
    } else {
        (end - start).max(1e-9)
    };
    let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
    let good = results.iter().filter(|r| slo.met(r)).count();
    let reported: Vec<&&RequestResult> = ok.iter().filter(|r| r.cached_tokens.is_some()).collect();
    let client_cached_fraction = if reported.is_empty() {
        None
    } else {
        let cached: u64 = reported.iter().filter_map(|r| r.cached_tokens).sum();
        let prompt: u64 = reported.iter().map(|r| r.prompt_tokens).sum();
        Some(if prompt == 0 {
            0.0
        } else {
            cached as f64 / prompt as f64
        })
    };
    PointStats {
        requests: results.len(),
        ok: ok.len(),
        errors,
        ttft_ms: Summary::of_seconds(&ttft),
        itl_ms: Summary::of_seconds(&itl),
        e2e_ms: Summary::of_seconds(&e2e),
        duration_s: duration,
        output_tokens_per_s: per_s(ok.iter().map(|r| r.output_tokens as f64).sum()),
        requests_per_s: per_s(ok.len() as f64),
        goodput_per_s: per_s(good as f64),
        slo_attainment: if results.is_empty() {
            0.0
        } else {
            good as f64 / results.len() as f64
        },
        client_cached_fraction,
    }
}
