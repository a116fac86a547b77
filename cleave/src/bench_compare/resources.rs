//! The resources of a `cleave up` configuration: declared from its flags (parsed exactly as
//! `cleave up` parses them, so the defaults are the same), then measured on the running fleet
//! (processes and their compute threads and allowed cores from `/proc`, KV blocks from each
//! worker's `cleave_kv_blocks_total`); and `--equal-compute`'s aggregated partner.

use std::path::Path;

use anyhow::Context;
use clap::Parser;
use cleave_loadgen::resources::{format_cpu_list, parse_cpu_list, Resources};
use cleave_loadgen::scrape::sum_metric;

use crate::up::UpArgs;

/// `cleave up`'s flags on their own, for parsing a configuration.
#[derive(Debug, Parser)]
#[command(
    name = "cleave up",
    disable_help_flag = true,
    disable_version_flag = true
)]
struct UpFlags {
    #[command(flatten)]
    up: UpArgs,
}

/// Parses `flags` as `cleave up` would.
pub fn parse_up_flags(flags: &[String]) -> anyhow::Result<UpArgs> {
    UpFlags::try_parse_from(std::iter::once("cleave up".to_string()).chain(flags.iter().cloned()))
        .map(|f| f.up)
        .map_err(|e| anyhow::anyhow!("{}", e.render().to_string().trim_end()))
}

/// Processes per worker (`--tp`/`--ep`).
fn group_size(up: &UpArgs) -> anyhow::Result<usize> {
    Ok(cleave_worker::group::size_from_flags(up.tp, up.ep)?
        .unwrap_or(1)
        .max(1))
}

/// The cores this process may run on (inherited by the fleet it starts), and whether that is
/// fewer than the machine has online.
/// The cores this process may run on (Linux CPU list) and whether that is fewer than online.
pub fn own_cores() -> (String, bool) {
    let allowed = status_field(Path::new("/proc/self/status"), "Cpus_allowed_list:");
    cores_of(allowed.as_deref().into_iter())
}

/// The union of `lists` (Linux CPU lists) and whether it is fewer cores than are online.
fn cores_of<'a>(lists: impl Iterator<Item = &'a str>) -> (String, bool) {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|s| parse_cpu_list(&s));
    let mut union = Vec::new();
    let mut pinned = false;
    let mut any = false;
    for l in lists {
        if let Some(c) = parse_cpu_list(l) {
            any = true;
            pinned |= online.as_ref().is_some_and(|o| c.len() < o.len());
            union.extend(c);
        }
    }
    if !any {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        return (format!("any of {n}"), false);
    }
    (format_cpu_list(&union), pinned)
}

fn status_field(path: &Path, key: &str) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(key).map(|v| v.trim().to_string()))
}

/// What `flags` ask for: the declaration the refusal is decided on before anything starts.
pub fn declared(flags: &[String]) -> anyhow::Result<Resources> {
    let up = parse_up_flags(flags)?;
    anyhow::ensure!(up.decode >= 1, "--decode must be at least 1");
    let group = group_size(&up)?;
    let workers = up.prefill + up.decode;
    let (cores, pinned) = own_cores();
    Ok(Resources {
        processes: workers * group + 1,
        compute_threads: workers * group * up.threads,
        // 0 when the workers size their pools from the model (`--kv-memory`).
        kv_blocks: workers * up.kv_blocks.unwrap_or(0),
        decode_kv_blocks: up.decode * up.kv_blocks.unwrap_or(0),
        cores,
        pinned,
        layout: layout(&up, group),
        source: "from the flags".into(),
    })
}

fn layout(up: &UpArgs, group: usize) -> String {
    let role = |n: usize, what: &str| {
        format!(
            "{n} {what} × {group} process{} × {} thread{}",
            if group == 1 { "" } else { "es" },
            up.threads,
            if up.threads == 1 { "" } else { "s" }
        )
    };
    let mut parts = vec!["router (no model compute)".to_string()];
    if up.prefill > 0 {
        parts.push(role(up.prefill, "prefill"));
    }
    parts.push(role(up.decode, "decode"));
    let pool = match up.kv_blocks {
        Some(n) => format!("{n} KV blocks per worker"),
        None => format!("KV pool per worker from --kv-memory {}", up.kv_memory),
    };
    format!(
        "{}; {pool}; {}",
        parts.join(" + "),
        if up.prefill == 0 {
            "aggregated"
        } else {
            "disaggregated"
        }
    )
}

/// One process of a running fleet, as read from `/proc`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Proc {
    /// Whether it runs the model (`cleave worker ...`), not the router.
    pub worker: bool,
    /// Its `cleave-matmul-*` threads (a worker with one thread computes on its engine thread).
    pub matmul_threads: usize,
    /// Its `Cpus_allowed_list`.
    pub cores: Option<String>,
}

impl Proc {
    /// The model compute threads of this process.
    pub fn compute_threads(&self) -> usize {
        match (self.worker, self.matmul_threads) {
            (false, _) => 0,
            (true, 0) => 1,
            (true, n) => n,
        }
    }
}

/// The pids of `pid`'s descendants (the fleet under one `cleave up`), read from `/proc`.
pub fn descendants(proc_root: &Path, pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir(proc_root) else {
        return Vec::new();
    };
    let mut parent_of = Vec::new();
    for e in entries.flatten() {
        let Some(p) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(pp) =
            status_field(&e.path().join("status"), "PPid:").and_then(|v| v.parse::<u32>().ok())
        {
            parent_of.push((p, pp));
        }
    }
    let mut fleet = vec![pid];
    let mut i = 0;
    while i < fleet.len() {
        let parent = fleet[i];
        fleet.extend(
            parent_of
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    fleet.split_off(1)
}

/// Whether process `pid` is a worker (`cleave worker ...`), not the router.
pub fn is_worker(proc_root: &Path, pid: u32) -> bool {
    let cmdline =
        std::fs::read(proc_root.join(pid.to_string()).join("cmdline")).unwrap_or_default();
    cmdline.split(|&b| b == 0).nth(1) == Some(b"worker".as_slice())
}

/// Resident memory of process `pid`, bytes (None: gone).
pub fn rss_bytes(proc_root: &Path, pid: u32) -> Option<u64> {
    let v = status_field(&proc_root.join(pid.to_string()).join("status"), "VmRSS:")?;
    let kb: u64 = v.split_whitespace().next()?.parse().ok()?;
    Some(kb * 1024)
}

/// The processes of the fleet under `pid` (one `cleave up`), read from `/proc`.
pub fn fleet_processes(proc_root: &Path, pid: u32) -> Vec<Proc> {
    descendants(proc_root, pid)
        .iter()
        .map(|p| {
            let dir = proc_root.join(p.to_string());
            let worker = is_worker(proc_root, *p);
            let matmul_threads = std::fs::read_dir(dir.join("task"))
                .map(|ts| {
                    ts.flatten()
                        .filter(|t| {
                            std::fs::read_to_string(t.path().join("comm"))
                                .is_ok_and(|c| c.starts_with("cleave-matmul"))
                        })
                        .count()
                })
                .unwrap_or(0);
            Proc {
                worker,
                matmul_threads,
                cores: status_field(&dir.join("status"), "Cpus_allowed_list:"),
            }
        })
        .collect()
}

/// The resources of a running fleet: `declared` corrected by what `procs` and the workers'
/// metrics (`(role, /metrics text)`) show; the source says which parts were measured.
pub fn measured(
    declared: &Resources,
    procs: &[Proc],
    worker_metrics: &[(String, String)],
) -> Resources {
    let mut r = declared.clone();
    let mut measured = Vec::new();
    if !procs.is_empty() {
        r.processes = procs.len();
        r.compute_threads = procs.iter().map(Proc::compute_threads).sum();
        let (cores, pinned) = cores_of(procs.iter().filter_map(|p| p.cores.as_deref()));
        (r.cores, r.pinned) = (cores, pinned);
        measured.push("processes, threads and cores from /proc");
    }
    let blocks: Vec<(&str, f64)> = worker_metrics
        .iter()
        .filter_map(|(role, text)| {
            Some((
                role.as_str(),
                sum_metric(text, "cleave_kv_blocks_total", None)?,
            ))
        })
        .collect();
    if !blocks.is_empty() {
        r.kv_blocks = blocks.iter().map(|(_, b)| *b as usize).sum();
        r.decode_kv_blocks = blocks
            .iter()
            .filter(|(role, _)| *role == "decode")
            .map(|(_, b)| *b as usize)
            .sum();
        measured.push("KV blocks from the workers' /metrics");
    }
    let mut differs = Vec::new();
    if r.processes != declared.processes {
        differs.push(format!("{} processes", declared.processes));
    }
    if r.compute_threads != declared.compute_threads {
        differs.push(format!("{} compute threads", declared.compute_threads));
    }
    if declared.kv_blocks > 0 && r.kv_blocks != declared.kv_blocks {
        differs.push(format!("{} KV blocks", declared.kv_blocks));
    }
    r.source = if measured.is_empty() {
        "from the flags only: the running fleet could not be read".into()
    } else {
        format!("measured: {}", measured.join("; "))
    };
    if !differs.is_empty() {
        r.source
            .push_str(&format!("; the flags said {}", differs.join(", ")));
    }
    r
}

/// Reads the running fleet under `pid` and the workers' metrics.
pub fn measure(declared: &Resources, pid: u32, workers: &[(String, String)]) -> Resources {
    let procs = fleet_processes(Path::new("/proc"), pid);
    let metrics: Vec<(String, String)> = workers
        .iter()
        .filter_map(|(role, url)| match crate::http::get(url) {
            Ok((200, body)) => Some((role.clone(), body)),
            _ => None,
        })
        .collect();
    measured(declared, &procs, &metrics)
}

/// `flags` without `--prefill`/`--decode` (either `--flag V` or `--flag=V`).
fn without_pd(flags: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for f in flags {
        if std::mem::take(&mut skip) {
            continue;
        }
        match f.as_str() {
            "--prefill" | "--decode" => skip = true,
            s if s.starts_with("--prefill=") || s.starts_with("--decode=") => {}
            _ => out.push(f.clone()),
        }
    }
    out
}

/// `--equal-compute`: an aggregated configuration with the compute of the first disaggregated
/// one (its prefill workers become decode workers; threads, groups, KV blocks per worker and
/// every other flag unchanged), or None when an aggregated one with that compute is given.
pub fn equal_compute_partner(
    configs: &[(String, Vec<String>)],
) -> anyhow::Result<Option<(String, Vec<String>)>> {
    let mut parsed = Vec::new();
    for (name, flags) in configs {
        parsed.push((
            name,
            flags,
            declared(flags).with_context(|| format!("--config {name}"))?,
        ));
    }
    let Some((name, flags, res)) = parsed
        .iter()
        .find(|(_, f, _)| parse_up_flags(f).is_ok_and(|u| u.prefill > 0))
    else {
        anyhow::bail!(
            "--equal-compute needs a disaggregated configuration (--prefill ≥ 1) to pair with"
        );
    };
    if parsed
        .iter()
        .any(|(_, f, r)| parse_up_flags(f).is_ok_and(|u| u.prefill == 0) && r.same_compute(res))
    {
        return Ok(None);
    }
    let up = parse_up_flags(flags)?;
    let mut agg = without_pd(flags);
    agg.extend([
        "--prefill".to_string(),
        "0".into(),
        "--decode".into(),
        (up.prefill + up.decode).to_string(),
    ]);
    let mut partner = format!("aggregated-as-{name}");
    while configs.iter().any(|(n, _)| *n == partner) {
        partner.push('\'');
    }
    Ok(Some((partner, agg)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn declared_resources_follow_cleave_up_defaults_and_flags() {
        // `cleave up`'s defaults: 1 prefill, 1 decode, 1 thread, pools the workers size.
        let d = declared(&[]).unwrap();
        assert_eq!(
            (
                d.processes,
                d.compute_threads,
                d.kv_blocks,
                d.decode_kv_blocks
            ),
            (3, 2, 0, 0)
        );
        assert!(d.layout.contains("disaggregated"), "{}", d.layout);
        assert!(d.layout.contains("--kv-memory auto"), "{}", d.layout);
        let agg = declared(&flags("--prefill 0 --decode 2 --kv-blocks 512")).unwrap();
        assert_eq!(
            (
                agg.processes,
                agg.compute_threads,
                agg.kv_blocks,
                agg.decode_kv_blocks
            ),
            (3, 2, 1024, 1024)
        );
        assert!(
            agg.layout.contains("512 KV blocks per worker"),
            "{}",
            agg.layout
        );
        assert!(agg.same_compute(&d));
        let one = declared(&flags("--prefill 0 --decode 1")).unwrap();
        assert_eq!(
            one.compute_difference(&d).unwrap(),
            "1 compute threads vs 2"
        );
        // Threads per worker and group ranks multiply.
        let big = declared(&flags(
            "--prefill 0 --decode 1 --threads 2 --tp 3 --kv-blocks 64",
        ))
        .unwrap();
        assert_eq!(
            (big.processes, big.compute_threads, big.kv_blocks),
            (4, 6, 64)
        );
        assert!(
            big.layout.contains("3 processes × 2 threads"),
            "{}",
            big.layout
        );
        // Bad flags are a clear error before anything starts.
        let e = declared(&flags("--prefil 1")).unwrap_err().to_string();
        assert!(e.contains("--prefil"), "{e}");
        assert!(declared(&flags("--decode 0")).is_err());
        assert!(declared(&flags("--tp 2 --ep 3")).is_err());
    }

    #[test]
    fn measured_resources_come_from_the_processes_and_metrics() {
        let d = declared(&flags("--prefill 1 --decode 1 --kv-blocks 512")).unwrap();
        let procs = [
            Proc {
                worker: true,
                matmul_threads: 0,
                cores: Some("0-1".into()),
            },
            Proc {
                worker: true,
                matmul_threads: 2,
                cores: Some("0-1".into()),
            },
            Proc {
                worker: false,
                matmul_threads: 0,
                cores: Some("0-1".into()),
            },
        ];
        let metrics = [
            (
                "prefill".to_string(),
                "cleave_kv_blocks_total 512\n".to_string(),
            ),
            (
                "decode".to_string(),
                "# HELP x\ncleave_kv_blocks_total 256\n".to_string(),
            ),
        ];
        let m = measured(&d, &procs, &metrics);
        assert_eq!((m.processes, m.compute_threads), (3, 3));
        assert_eq!((m.kv_blocks, m.decode_kv_blocks), (768, 256));
        assert_eq!(m.cores, "0-1");
        assert!(
            m.source.contains("/proc") && m.source.contains("/metrics"),
            "{}",
            m.source
        );
        assert!(
            m.source
                .contains("the flags said 2 compute threads, 1024 KV blocks"),
            "{}",
            m.source
        );
        // Nothing readable: the declaration stands, and says so.
        let f = measured(&d, &[], &[]);
        assert_eq!((f.compute_threads, f.kv_blocks), (2, 1024));
        assert!(f.source.contains("could not be read"));
    }

    #[test]
    fn fleet_processes_walks_descendants_in_a_proc_tree() {
        let root = std::env::temp_dir().join(format!("cleave-proc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let mk = |pid: u32, ppid: u32, argv: &[&str], threads: &[&str]| {
            let d = root.join(pid.to_string());
            std::fs::create_dir_all(d.join("task")).unwrap();
            std::fs::write(
                d.join("status"),
                format!("Name:\tx\nPPid:\t{ppid}\nCpus_allowed_list:\t0\n"),
            )
            .unwrap();
            std::fs::write(d.join("cmdline"), argv.join("\0") + "\0").unwrap();
            for (i, t) in threads.iter().enumerate() {
                std::fs::create_dir_all(d.join("task").join(i.to_string())).unwrap();
                std::fs::write(
                    d.join("task").join(i.to_string()).join("comm"),
                    format!("{t}\n"),
                )
                .unwrap();
            }
        };
        mk(10, 1, &["cleave", "up"], &["cleave"]);
        mk(
            11,
            10,
            &["cleave", "worker", "--role", "decode"],
            &[
                "cleave",
                "cleave-engine",
                "cleave-matmul-0",
                "cleave-matmul-1",
            ],
        );
        mk(
            12,
            10,
            &["cleave", "router"],
            &["cleave", "tokio-runtime-w"],
        );
        mk(
            13,
            11,
            &["cleave", "worker", "--role", "prefill"],
            &["cleave-engine"],
        );
        mk(20, 1, &["cleave", "worker"], &["cleave-matmul-0"]); // another fleet
        std::fs::create_dir_all(root.join("self")).unwrap(); // not a pid
        let mut procs = fleet_processes(&root, 10);
        procs.sort_by_key(|p| (p.worker, p.matmul_threads));
        assert_eq!(procs.len(), 3);
        assert_eq!(
            procs.iter().map(Proc::compute_threads).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert!(procs.iter().all(|p| p.cores.as_deref() == Some("0")));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn equal_compute_pairs_the_first_disaggregated_config() {
        let cfgs = vec![(
            "pd".to_string(),
            flags("--prefill=1 --decode 1 --threads 2 --disagg-min-uncached-blocks 8"),
        )];
        let (name, agg) = equal_compute_partner(&cfgs).unwrap().unwrap();
        assert_eq!(name, "aggregated-as-pd");
        assert_eq!(
            agg,
            flags("--threads 2 --disagg-min-uncached-blocks 8 --prefill 0 --decode 2")
        );
        assert!(declared(&agg)
            .unwrap()
            .same_compute(&declared(&cfgs[0].1).unwrap()));
        // An aggregated configuration with that compute is already there: nothing to add.
        let mut with = cfgs.clone();
        with.push(("agg".into(), flags("--prefill 0 --decode 4")));
        with.push(("agg2".into(), flags("--prefill 0 --decode 2 --threads 2")));
        assert_eq!(equal_compute_partner(&with).unwrap(), None);
        // Nothing disaggregated to pair with: an error that says so.
        let e = equal_compute_partner(&[("a".into(), flags("--prefill 0"))]).unwrap_err();
        assert!(e.to_string().contains("needs a disaggregated"), "{e}");
    }
}
