//! What a configuration runs on: processes, compute threads, KV blocks and the CPU cores its
//! processes may use, for the fairness header, and the rule that ratios between configurations
//! are only printed when their compute is equal (same compute threads on the same cores).

use std::fmt::Write;

use serde::Serialize;

/// The resources of one served configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Resources {
    /// Processes serving (router, workers, every rank of a worker group).
    pub processes: usize,
    /// Model compute threads summed over all worker processes.
    pub compute_threads: usize,
    /// KV blocks summed over all workers.
    pub kv_blocks: usize,
    /// KV blocks on the workers that decode (where running sequences live).
    pub decode_kv_blocks: usize,
    /// The CPU cores the processes may run on, as a Linux CPU list (`0-1`, `0,2`).
    pub cores: String,
    /// Whether any process is restricted to fewer cores than the machine has online.
    pub pinned: bool,
    /// Per-role breakdown, e.g. `router; 1 prefill × 1 process × 1 thread; 1 decode × ...`.
    pub layout: String,
    /// How the numbers were obtained (read from the running processes, or only from flags).
    pub source: String,
}

impl Resources {
    /// One line for the header.
    pub fn to_text(&self) -> String {
        let cores = if self.pinned {
            format!("PINNED to cores {}", self.cores)
        } else {
            format!("not pinned (cores {})", self.cores)
        };
        format!(
            "{} processes, {} compute thread{}, {} KV blocks ({} on decode workers), {cores}; {} [{}]",
            self.processes,
            self.compute_threads,
            if self.compute_threads == 1 { "" } else { "s" },
            self.kv_blocks,
            self.decode_kv_blocks,
            self.layout,
            self.source
        )
    }

    /// Whether two configurations have the same compute: equal compute threads on the same
    /// set of cores. Processes and KV blocks may differ (that is often the thing compared).
    pub fn same_compute(&self, other: &Resources) -> bool {
        self.compute_threads == other.compute_threads && self.cores == other.cores
    }

    /// Why `self` differs in compute from `baseline`, if it does.
    pub fn compute_difference(&self, baseline: &Resources) -> Option<String> {
        if self.same_compute(baseline) {
            return None;
        }
        let mut why = Vec::new();
        if self.compute_threads != baseline.compute_threads {
            why.push(format!(
                "{} compute threads vs {}",
                self.compute_threads, baseline.compute_threads
            ));
        }
        if self.cores != baseline.cores {
            why.push(format!("cores {} vs {}", self.cores, baseline.cores));
        }
        Some(why.join(", "))
    }
}

/// For each configuration after the first (the baseline), whether its compute differs from the
/// baseline's and why; configurations without known resources count as different.
pub fn compute_differences(configs: &[(&str, Option<&Resources>)]) -> Vec<(String, String)> {
    let Some((_, base)) = configs.first() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (name, r) in &configs[1..] {
        let why = match (r, base) {
            (Some(r), Some(b)) => r.compute_difference(b),
            _ => Some("resources unknown".to_string()),
        };
        if let Some(why) = why {
            out.push((name.to_string(), why));
        }
    }
    out
}

/// The loud banner printed when configurations differ in compute.
pub fn unequal_banner(base: &str, diffs: &[(String, String)], allowed: bool) -> String {
    let mut o = String::new();
    let rule = "!".repeat(96);
    let _ = writeln!(o, "{rule}");
    let _ = writeln!(
        o,
        "!! UNEQUAL COMPUTE: these configurations do not run on the same compute as {base}:"
    );
    for (name, why) in diffs {
        let _ = writeln!(o, "!!   {name}: {why}");
    }
    if allowed {
        let _ = writeln!(
            o,
            "!! --allow-unequal: ratios are printed anyway; they mix the effect of the design with more hardware."
        );
    } else {
        let _ = writeln!(
            o,
            "!! Their ratios are withheld. Give every configuration the same compute threads (e.g. aggregated"
        );
        let _ = writeln!(
            o,
            "!! `--prefill 0 --decode 2` against `--prefill 1 --decode 1`; --equal-compute adds it), or pass"
        );
        let _ = writeln!(o, "!! --allow-unequal to print them anyway.");
    }
    let _ = writeln!(o, "{rule}");
    o
}

/// A Linux CPU list (`0-3,6`) as core numbers.
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if b < a {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.trim().parse().ok()?),
        }
    }
    out.sort_unstable();
    out.dedup();
    Some(out)
}

/// Core numbers as a compact Linux CPU list (`0-3,6`).
pub fn format_cpu_list(cores: &[usize]) -> String {
    let mut v = cores.to_vec();
    v.sort_unstable();
    v.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            v[i].to_string()
        } else {
            format!("{}-{}", v[i], v[j])
        });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(threads: usize, cores: &str) -> Resources {
        Resources {
            processes: 3,
            compute_threads: threads,
            kv_blocks: 1024,
            decode_kv_blocks: 512,
            cores: cores.into(),
            pinned: false,
            layout: "x".into(),
            source: "test".into(),
        }
    }

    #[test]
    fn compute_is_equal_only_with_equal_threads_on_equal_cores() {
        let base = res(2, "0-1");
        // More processes or fewer decode blocks do not make compute unequal.
        let other = Resources {
            processes: 2,
            decode_kv_blocks: 1024,
            ..res(2, "0-1")
        };
        assert!(other.same_compute(&base));
        assert_eq!(other.compute_difference(&base), None);
        assert_eq!(
            res(1, "0-1").compute_difference(&base).unwrap(),
            "1 compute threads vs 2"
        );
        assert_eq!(
            res(2, "0").compute_difference(&base).unwrap(),
            "cores 0 vs 0-1"
        );
        let diffs = compute_differences(&[
            ("agg", Some(&base)),
            ("same", Some(&other)),
            ("less", Some(&res(1, "0-1"))),
            ("unknown", None),
        ]);
        assert_eq!(
            diffs,
            vec![
                ("less".to_string(), "1 compute threads vs 2".to_string()),
                ("unknown".to_string(), "resources unknown".to_string())
            ]
        );
        let banner = unequal_banner("agg", &diffs, false);
        assert!(banner.contains("UNEQUAL COMPUTE") && banner.contains("less: 1 compute"));
        assert!(banner.contains("withheld"));
        assert!(unequal_banner("agg", &diffs, true).contains("printed anyway"));
    }

    #[test]
    fn cpu_lists_round_trip_and_bad_ones_are_refused() {
        assert_eq!(parse_cpu_list("0-3,6\n"), Some(vec![0, 1, 2, 3, 6]));
        assert_eq!(parse_cpu_list("1"), Some(vec![1]));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a"), None);
        assert_eq!(format_cpu_list(&[6, 0, 1, 2, 3]), "0-3,6");
        assert_eq!(format_cpu_list(&[0, 2]), "0,2");
        assert_eq!(format_cpu_list(&[]), "");
        let r = res(2, "0-1");
        assert!(r.to_text().contains("2 compute threads") && r.to_text().contains("not pinned"));
    }
}
