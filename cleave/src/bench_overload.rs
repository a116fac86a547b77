//! `cleave bench overload`: open-loop load at a multiple of the measured capacity through a
//! local `cleave up`, then the same closed loop as before, to show that admission holds: the
//! requests it admits keep their TTFT within the admission SLO (`--queue-timeout` plus the
//! TTFT at capacity), the rest get a 429 quickly, the router's and workers' memory stays
//! bounded, and the fleet serves as before once the load is gone.
//!
//! Phases, all in one run: `capacity` (closed loop at `--max-in-flight` concurrency: the
//! successful requests per second are the capacity), `overload` (Poisson arrivals at
//! `--factor` × capacity for `--duration`), `recovery` (the capacity phase again).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use cleave_loadgen::arrival::Load;
use cleave_loadgen::client::{RequestResult, Target};
use cleave_loadgen::runner::{self, PointResult};
use cleave_loadgen::stats::percentile;
use cleave_types::duration::parse_positive_duration;

use crate::bench_compare::resources::{descendants, is_worker, rss_bytes};
use crate::bench_compare::{start, Up};
use crate::bench_serve::{self, LoadArgs};

/// Flags of `cleave bench overload`.
#[derive(Debug, Clone, Args)]
pub struct OverloadArgs {
    /// GGUF model (default: the cached default model).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model_path: Option<PathBuf>,
    /// The `cleave up` flags of the fleet (besides admission).
    #[arg(long, default_value = "--prefill 0 --decode 1 --threads 1")]
    pub up: String,
    /// The router's `--max-in-flight`; also the capacity phases' concurrency.
    #[arg(long, default_value_t = 8)]
    pub max_in_flight: usize,
    /// The router's `--max-queue`.
    #[arg(long, default_value_t = 16)]
    pub max_queue: usize,
    /// The router's `--queue-timeout`: the longest an admitted request waits for a slot.
    #[arg(long, value_parser = parse_positive_duration, default_value = "2s")]
    pub queue_timeout: Duration,
    /// Offered load of the overload phase, × the measured capacity.
    #[arg(long, default_value_t = 4.0)]
    pub factor: f64,
    /// Length of the overload phase.
    #[arg(long = "overload-duration", value_parser = parse_positive_duration, default_value = "60s")]
    pub overload_duration: Duration,
    /// Length of each capacity phase (before and after).
    #[arg(long, value_parser = parse_positive_duration, default_value = "20s")]
    pub capacity_duration: Duration,
    /// Prompt lengths, output lengths, API, seed, per-request timeout (`--rate`,
    /// `--concurrency` and `--duration` are set by the phases).
    #[command(flatten)]
    pub load: LoadArgs,
}

/// Peak resident memory seen, router and largest worker, per phase.
#[derive(Default)]
pub(crate) struct Peaks {
    phase: usize,
    router: [u64; 3],
    worker: [u64; 3],
}

impl Peaks {
    /// (router, largest worker) over every phase.
    pub(crate) fn peak(&self) -> (u64, u64) {
        let max = |v: &[u64; 3]| v.iter().copied().max().unwrap_or(0);
        (max(&self.router), max(&self.worker))
    }
}

/// Samples the fleet's RSS every 100 ms until dropped.
pub(crate) struct Sampler {
    pub(crate) peaks: Arc<Mutex<Peaks>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    /// Starts sampling the processes under `up_pid` (phase 0).
    pub(crate) fn start(up_pid: u32) -> Sampler {
        let peaks = Arc::new(Mutex::new(Peaks::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (peaks.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let proc_root = Path::new("/proc");
            while !s.load(Ordering::Relaxed) {
                for pid in descendants(proc_root, up_pid) {
                    let Some(rss) = rss_bytes(proc_root, pid) else {
                        continue;
                    };
                    let mut p = p.lock().expect("peaks");
                    let phase = p.phase;
                    let slot = if is_worker(proc_root, pid) {
                        &mut p.worker[phase]
                    } else {
                        &mut p.router[phase]
                    };
                    *slot = (*slot).max(rss);
                }
                // A sampling period on a plain thread (the load runs on the runtime).
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        Sampler {
            peaks,
            stop,
            thread: Some(thread),
        }
    }

    fn phase(&self, phase: usize) {
        self.peaks.lock().expect("peaks").phase = phase;
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One phase's numbers.
struct Phase {
    name: &'static str,
    offered_per_s: Option<f64>,
    point: PointResult,
}

impl Phase {
    fn refused(&self) -> Vec<&RequestResult> {
        let is_429 = |r: &&RequestResult| r.error.as_deref() == Some("http_429");
        self.point.results.iter().filter(is_429).collect()
    }

    fn other_errors(&self) -> usize {
        let e = &self.point.stats.errors;
        e.values().sum::<usize>() - e.get("http_429").copied().unwrap_or(0)
    }
}

fn ms(p: Option<f64>) -> String {
    p.map_or("-".into(), |v| format!("{:.0}", v * 1000.0))
}

fn mib(b: u64) -> String {
    format!("{:.0}", b as f64 / (1 << 20) as f64)
}

/// Entry point of `cleave bench overload`.
pub fn bench_overload(args: OverloadArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.factor > 0.0, "--factor must be > 0");
    let model = match &args.model_path {
        Some(p) => p.clone(),
        None => crate::fetch::fetch_default_model(false)?,
    };
    let mut flags: Vec<String> = args.up.split_whitespace().map(String::from).collect();
    flags.extend([
        "--max-in-flight".into(),
        args.max_in_flight.to_string(),
        "--max-queue".into(),
        args.max_queue.to_string(),
        "--queue-timeout".into(),
        format!("{}ms", args.queue_timeout.as_millis()),
    ]);
    eprintln!("== cleave up {}", flags.join(" "));
    let up: Up = start(&model.display().to_string(), &flags)?;
    let sampler = Sampler::start(up.child.id());
    let rt = tokio::runtime::Runtime::new()?;
    let base = up.base.trim_end_matches('/').to_string();
    let root = base.strip_suffix("/v1").unwrap_or(&base).to_string();
    let phases = rt.block_on(async {
        let target = Target {
            base: base.clone(),
            model: bench_serve::served_model(&base).await?,
            api: args.load.api,
            ignore_eos: !args.load.no_ignore_eos,
            timeout: args.load.timeout,
        };
        let config = |duration: Duration| {
            let mut cfg = bench_serve::run_config(
                &args.load,
                target.clone(),
                Some(format!("{root}/metrics")),
                up.workers.iter().map(|(_, u)| u.clone()).collect(),
            );
            cfg.duration = Some(duration);
            cfg.progress = false;
            cfg
        };
        let client = reqwest::Client::new();
        bench_serve::warm_up(
            &args.load,
            &config(args.capacity_duration),
            Default::default(),
        )
        .await;
        // Enough requests for the phase at its rate (closed loop: generous), fresh prompts each.
        let point = |i: usize, load: Load, duration: Duration, requests: usize| {
            let mut a = args.load.clone();
            a.requests = requests.max(1);
            let cfg = config(duration);
            let client = client.clone();
            async move {
                let (reqs, _) = bench_serve::workload(&a, i, &load)?;
                anyhow::Ok(runner::run_point(&client, &cfg, load, reqs).await)
            }
        };
        let closed = Load::Concurrency {
            concurrency: args.max_in_flight,
        };
        let generous = args.max_in_flight * 50 * args.capacity_duration.as_secs().max(1) as usize;
        eprintln!(
            "== capacity: closed loop at {} for {:?}",
            args.max_in_flight, args.capacity_duration
        );
        sampler.phase(0);
        let capacity = point(0, closed, args.capacity_duration, generous).await?;
        let rate = capacity.stats.requests_per_s * args.factor;
        anyhow::ensure!(rate > 0.0, "no request succeeded in the capacity phase");
        eprintln!(
            "== overload: {rate:.2} req/s ({}× capacity) for {:?}",
            args.factor, args.overload_duration
        );
        sampler.phase(1);
        let n = (rate * args.overload_duration.as_secs_f64() * 1.2).ceil() as usize + 10;
        let overload = point(1, Load::Rate { rate }, args.overload_duration, n).await?;
        eprintln!(
            "== recovery: closed loop at {} for {:?}",
            args.max_in_flight, args.capacity_duration
        );
        sampler.phase(2);
        let recovery = point(2, closed, args.capacity_duration, generous).await?;
        anyhow::Ok([
            Phase {
                name: "capacity",
                offered_per_s: None,
                point: capacity,
            },
            Phase {
                name: "overload",
                offered_per_s: Some(rate),
                point: overload,
            },
            Phase {
                name: "recovery",
                offered_per_s: None,
                point: recovery,
            },
        ])
    })?;
    let peaks = std::mem::take(&mut *sampler.peaks.lock().expect("peaks"));
    drop(sampler);
    drop(up);
    report(&args, &phases, &peaks);
    Ok(())
}

fn report(args: &OverloadArgs, phases: &[Phase; 3], peaks: &Peaks) {
    println!(
        "admission: --max-in-flight {} --max-queue {} --queue-timeout {:?}; prompts {} tokens, outputs {}",
        args.max_in_flight, args.max_queue, args.queue_timeout, args.load.input_len, args.load.output_len
    );
    println!(
        "{:<9} {:>9} {:>8} {:>6} {:>5} {:>5} {:>9} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "phase",
        "offered/s",
        "ok/s",
        "ok",
        "429",
        "other",
        "TTFT p50",
        "TTFT p99",
        "429 p50 ms",
        "429 p99 ms",
        "router MiB",
        "worker MiB"
    );
    for (i, p) in phases.iter().enumerate() {
        let s = &p.point.stats;
        let refused: Vec<f64> = p.refused().iter().map(|r| r.e2e_s).collect();
        println!(
            "{:<9} {:>9} {:>8.2} {:>6} {:>5} {:>5} {:>9.0} {:>9.0} {:>10} {:>10} {:>10} {:>10}",
            p.name,
            p.offered_per_s
                .map_or("closed".into(), |r| format!("{r:.2}")),
            s.requests_per_s,
            s.ok,
            refused.len(),
            p.other_errors(),
            s.ttft_ms.p50,
            s.ttft_ms.p99,
            ms(percentile(&refused, 50.0)),
            ms(percentile(&refused, 99.0)),
            mib(peaks.router[i]),
            mib(peaks.worker[i]),
        );
    }
    let [capacity, overload, recovery] = phases;
    let slo_ms = args.queue_timeout.as_secs_f64() * 1000.0 + capacity.point.stats.ttft_ms.p99;
    let (c, o, r) = (
        &capacity.point.stats,
        &overload.point.stats,
        &recovery.point.stats,
    );
    let check = |ok: bool| if ok { "yes" } else { "NO" };
    println!(
        "admitted TTFT p99 under overload: {:.0} ms vs SLO {:.0} ms (queue timeout + capacity TTFT p99): {:.2}× — within: {}",
        o.ttft_ms.p99, slo_ms, o.ttft_ms.p99 / slo_ms, check(o.ttft_ms.p99 <= slo_ms)
    );
    let refused = overload.refused().len();
    println!(
        "refused under overload: {refused} of {} with 429 ({:.0}%), other errors {}",
        o.requests,
        100.0 * refused as f64 / o.requests.max(1) as f64,
        overload.other_errors()
    );
    let grow = |i: usize| peaks.router[i].max(1) as f64 / peaks.router[0].max(1) as f64;
    let wgrow = |i: usize| peaks.worker[i].max(1) as f64 / peaks.worker[0].max(1) as f64;
    println!(
        "peak RSS under overload vs capacity: router {:.2}×, worker {:.2}×",
        grow(1),
        wgrow(1)
    );
    println!(
        "recovery vs capacity: {:.2}× requests/s, TTFT p50 {:.2}×, errors {} — recovered: {}",
        r.requests_per_s / c.requests_per_s.max(1e-9),
        r.ttft_ms.p50 / c.ttft_ms.p50.max(1e-9),
        recovery.point.stats.errors.values().sum::<usize>(),
        check(recovery.point.stats.errors.is_empty() && r.requests_per_s >= 0.8 * c.requests_per_s)
    );
}
