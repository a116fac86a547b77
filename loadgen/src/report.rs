//! The report: a header that states what a fair comparison must hold equal, then one row per
//! load point; as a terminal table or JSON; and comparisons of several configurations.

use std::fmt::Write;

use serde::Serialize;

use crate::resources::{compute_differences, unequal_banner, Resources};
use crate::runner::PointResult;
use crate::stats::{percentile, Summary};
use crate::tokens::Prompt;
use crate::workload::RequestSpec;

/// The fairness header: every field a reader needs to judge whether two results compare.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Header {
    /// The endpoint's base URL.
    pub endpoint: String,
    /// Model name as served.
    pub model: String,
    /// Weight quantization (stated or read from the GGUF file name).
    pub quantization: String,
    /// KV cache element type.
    pub kv_dtype: String,
    /// The model's context limit, tokens.
    pub context_limit: String,
    /// The loads run (rates or concurrencies).
    pub load: String,
    /// Where the requests came from (trace and its sampling/scaling, or synthetic parameters).
    pub workload: String,
    /// Prompt lengths as sent (tokens): mean, p50, p99, max.
    pub prompt_lengths: String,
    /// Output lengths as requested: mean, p50, p99, max.
    pub output_lengths: String,
    /// Mean fraction of each prompt that repeats a prefix of an earlier prompt.
    pub prefix_overlap: f64,
    /// Warm-up requests (not counted).
    pub warmup: String,
    /// SLOs of the goodput column.
    pub slo: String,
    /// The machine: CPU, cores, memory, load average at the start.
    pub machine: String,
    /// Anything else to state (prompt format, ignore_eos, seed).
    pub notes: String,
    /// What the configuration runs on (known when `bench compare` started it).
    pub resources: Option<Resources>,
}

/// Describes `values` as "mean m, p50 a, p99 b, max c".
pub fn describe_lengths(values: &[usize]) -> String {
    let v: Vec<f64> = values.iter().map(|&x| x as f64).collect();
    if v.is_empty() {
        return "none".into();
    }
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    format!(
        "mean {mean:.0}, p50 {:.0}, p99 {:.0}, max {:.0}",
        percentile(&v, 50.0).unwrap_or(0.0),
        percentile(&v, 99.0).unwrap_or(0.0),
        v.iter().cloned().fold(0.0, f64::max)
    )
}

/// Mean over requests of (longest prefix shared with any earlier prompt) / (prompt length),
/// for token prompts (text prompts: by characters).
pub fn measured_prefix_overlap(specs: &[RequestSpec]) -> f64 {
    let seqs: Vec<Vec<u32>> = specs
        .iter()
        .map(|s| match &s.prompt {
            Prompt::Tokens(t) => t.clone(),
            Prompt::Text(t) => t.chars().map(|c| c as u32).collect(),
        })
        .collect();
    if seqs.is_empty() {
        return 0.0;
    }
    let mut total = 0.0;
    for (i, s) in seqs.iter().enumerate() {
        let best = seqs[..i]
            .iter()
            .map(|p| p.iter().zip(s).take_while(|(a, b)| a == b).count())
            .max()
            .unwrap_or(0);
        total += best as f64 / s.len().max(1) as f64;
    }
    total / seqs.len() as f64
}

/// The machine, for the header.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines().next().and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|k| k.parse::<f64>().ok())
            })
        })
        .map(|kb| format!("{:.0} GiB", kb / 1024.0 / 1024.0))
        .unwrap_or_else(|| "? GiB".into());
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| "?".into());
    format!("{cpu}, {cores} cores, {mem}; load average at start {load}")
}

/// One configuration's results.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The fairness header.
    pub header: Header,
    /// One per load point.
    pub points: Vec<PointResult>,
}

fn s3(s: &Summary) -> String {
    format!("{:.0}/{:.0}/{:.0}/{:.0}", s.p50, s.p90, s.p99, s.mean)
}

fn pct(x: Option<f64>) -> String {
    x.map(|v| format!("{:.1}%", v * 100.0))
        .unwrap_or_else(|| "n/a".into())
}

impl Header {
    /// The header as `key: value` lines.
    pub fn to_text(&self) -> String {
        let mut o = String::new();
        let rows = [
            ("endpoint", self.endpoint.clone()),
            ("model", self.model.clone()),
            ("quantization", self.quantization.clone()),
            ("KV dtype", self.kv_dtype.clone()),
            ("context limit", self.context_limit.clone()),
            ("load", self.load.clone()),
            ("workload", self.workload.clone()),
            ("prompt tokens", self.prompt_lengths.clone()),
            ("output tokens", self.output_lengths.clone()),
            (
                "prefix overlap",
                format!(
                    "{:.1}% of prompt tokens repeat an earlier prefix",
                    self.prefix_overlap * 100.0
                ),
            ),
            ("warm-up", self.warmup.clone()),
            ("SLOs (goodput)", self.slo.clone()),
            ("machine", self.machine.clone()),
            (
                "resources",
                self.resources.as_ref().map(Resources::to_text).unwrap_or_else(|| {
                    "not known (an external endpoint: state its processes, threads and KV blocks yourself)"
                        .into()
                }),
            ),
            ("notes", self.notes.clone()),
        ];
        for (k, v) in rows {
            let _ = writeln!(o, "  {k:<15} {v}");
        }
        o
    }
}

impl Report {
    /// Header plus a table of the load points.
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        o.push_str(&self.header.to_text());
        let _ = writeln!(
            o,
            "\n{:<18} {:>7} {:>23} {:>19} {:>23} {:>9} {:>6} {:>7} {:>7} {:>7}  errors",
            "load",
            "ok/n",
            "TTFT ms p50/90/99/μ",
            "ITL ms p50/90/99/μ",
            "E2E ms p50/90/99/μ",
            "out tok/s",
            "req/s",
            "goodput",
            "prefix",
            "disagg"
        );
        for p in &self.points {
            let s = &p.stats;
            let errors = if s.errors.is_empty() {
                "-".to_string()
            } else {
                s.errors
                    .iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            };
            let prefix = p.cleave.prefix_hit_rate.or(s.client_cached_fraction);
            let _ = writeln!(
                o,
                "{:<18} {:>7} {:>23} {:>19} {:>23} {:>9.1} {:>6.2} {:>7.2} {:>7} {:>7}  {errors}",
                p.load.label(),
                format!("{}/{}", s.ok, s.requests),
                s3(&s.ttft_ms),
                s3(&s.itl_ms),
                s3(&s.e2e_ms),
                s.output_tokens_per_s,
                s.requests_per_s,
                s.goodput_per_s,
                pct(prefix),
                pct(p.cleave.disaggregated_fraction),
            );
        }
        o
    }
}

/// Several configurations run with the same workload and loads.
#[derive(Clone, Debug, Serialize)]
pub struct Comparison {
    /// (name, report) in run order; the first is the baseline of the ratios.
    pub configs: Vec<(String, Report)>,
    /// Configurations whose compute differs from the baseline's, and how.
    pub unequal_compute: Vec<(String, String)>,
    /// Whether ratios are printed for them anyway (`--allow-unequal`).
    pub allow_unequal: bool,
}

impl Comparison {
    /// A comparison of `configs` (the first is the baseline); finds which differ in compute.
    pub fn new(configs: Vec<(String, Report)>, allow_unequal: bool) -> Self {
        let named: Vec<(&str, Option<&Resources>)> = configs
            .iter()
            .map(|(n, r)| (n.as_str(), r.header.resources.as_ref()))
            .collect();
        let unequal_compute = compute_differences(&named);
        Comparison {
            configs,
            unequal_compute,
            allow_unequal,
        }
    }

    /// Each configuration's table, then ratios against the first at every load point, except
    /// for configurations whose compute differs from the baseline's (unless allowed).
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        let Some((base_name, base)) = self.configs.first() else {
            return o;
        };
        let banner = (!self.unequal_compute.is_empty())
            .then(|| unequal_banner(base_name, &self.unequal_compute, self.allow_unequal));
        if let Some(b) = &banner {
            o.push_str(b);
        }
        for (name, r) in &self.configs {
            let _ = writeln!(o, "== {name}\n{}", r.to_table());
        }
        if let Some(b) = &banner {
            o.push_str(b);
        }
        let _ = writeln!(
            o,
            "== ratios against {base_name} (value / baseline; <1 is lower)"
        );
        let _ = writeln!(
            o,
            "{:<24} {:<18} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9}",
            "config",
            "load",
            "TTFT p50",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "E2E p99",
            "out tok/s",
            "prefix"
        );
        for (name, r) in &self.configs[1..] {
            let unequal = self.unequal_compute.iter().find(|(n, _)| n == name);
            if let (Some((_, why)), false) = (unequal, self.allow_unequal) {
                let _ = writeln!(
                    o,
                    "{name:<24} ratios withheld: unequal compute ({why}); --allow-unequal prints them"
                );
                continue;
            }
            for (p, b) in r.points.iter().zip(&base.points) {
                let ratio = |x: f64, y: f64| {
                    if y > 0.0 {
                        format!("{:.2}×", x / y)
                    } else {
                        "n/a".into()
                    }
                };
                let px = p.cleave.prefix_hit_rate.or(p.stats.client_cached_fraction);
                let bx = b.cleave.prefix_hit_rate.or(b.stats.client_cached_fraction);
                let prefix = match (px, bx) {
                    (Some(x), Some(y)) => ratio(x, y),
                    _ => "n/a".into(),
                };
                let (s, t) = (&p.stats, &b.stats);
                let _ = writeln!(
                    o,
                    "{:<24} {:<18} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>9}",
                    name,
                    p.load.label(),
                    ratio(s.ttft_ms.p50, t.ttft_ms.p50),
                    ratio(s.ttft_ms.p99, t.ttft_ms.p99),
                    ratio(s.itl_ms.p50, t.itl_ms.p50),
                    ratio(s.itl_ms.p99, t.itl_ms.p99),
                    ratio(s.e2e_ms.p99, t.e2e_ms.p99),
                    ratio(s.output_tokens_per_s, t.output_tokens_per_s),
                    prefix,
                );
            }
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arrival::Load;
    use crate::scrape::CleaveDelta;
    use crate::stats::PointStats;

    fn report(threads: usize, ttft_p50: f64) -> Report {
        let mut stats = PointStats::default();
        stats.ttft_ms.p50 = ttft_p50;
        Report {
            header: Header {
                resources: Some(Resources {
                    processes: 3,
                    compute_threads: threads,
                    cores: "0-1".into(),
                    ..Resources::default()
                }),
                ..Header::default()
            },
            points: vec![PointResult {
                load: Load::Concurrency { concurrency: 4 },
                stats,
                cleave: CleaveDelta::default(),
                results: Vec::new(),
            }],
        }
    }

    #[test]
    fn ratios_are_withheld_for_unequal_compute_unless_allowed() {
        let configs = vec![
            ("agg".to_string(), report(2, 100.0)),
            ("pd".to_string(), report(2, 150.0)),
            ("big".to_string(), report(4, 50.0)),
        ];
        let c = Comparison::new(configs.clone(), false);
        assert_eq!(
            c.unequal_compute,
            vec![("big".to_string(), "4 compute threads vs 2".to_string())]
        );
        let t = c.to_table();
        assert!(t.contains("UNEQUAL COMPUTE"), "{t}");
        assert!(t.contains("2 compute threads"), "{t}");
        // Equal compute: the ratio is there; unequal: withheld, no number.
        assert!(t.contains("1.50×"), "{t}");
        assert!(
            t.contains("big                      ratios withheld"),
            "{t}"
        );
        assert!(!t.contains("0.50×"), "{t}");
        let allowed = Comparison::new(configs.clone(), true).to_table();
        assert!(allowed.contains("0.50×") && allowed.contains("printed anyway"));
        // All equal: no banner at all.
        let fair = Comparison::new(configs[..2].to_vec(), false).to_table();
        assert!(
            !fair.contains("UNEQUAL") && fair.contains("1.50×"),
            "{fair}"
        );
        // A configuration without known resources cannot be shown to be equal.
        let mut unknown = configs[..2].to_vec();
        unknown[1].1.header.resources = None;
        let t = Comparison::new(unknown, false).to_table();
        assert!(
            t.contains("ratios withheld: unequal compute (resources unknown)"),
            "{t}"
        );
    }
}
