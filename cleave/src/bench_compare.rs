//! `cleave bench compare`: the same workload and loads against several local configurations,
//! each started with `cleave up` (a child process of this executable), then the ratios —
//! only between configurations with equal compute ([`resources`]) unless `--allow-unequal`.

mod llama;
pub mod resources;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use cleave_loadgen::client::Target;
use cleave_loadgen::report::{Header, Report};
use cleave_loadgen::resources::{compute_differences, unequal_banner, Resources};
use cleave_loadgen::runner::{PointResult, RunConfig};

use crate::bench_serve::{self, guess_quantization, LoadArgs};

/// Flags of `cleave bench compare`.
#[derive(Debug, Clone, Args)]
pub struct CompareArgs {
    /// A configuration as NAME=FLAGS, FLAGS being `cleave up` flags, e.g.
    /// `aggregated=--prefill 0 --decode 1`; repeat for each (the first is the baseline).
    #[arg(long = "config", required = true)]
    pub configs: Vec<String>,
    /// Print ratios even between configurations with different compute (threads or cores).
    #[arg(long)]
    pub allow_unequal: bool,
    /// Add, as the baseline, an aggregated configuration with the compute of the first
    /// disaggregated one (`--prefill P --decode D` → `--prefill 0 --decode P+D`, same threads).
    #[arg(long)]
    pub equal_compute: bool,
    /// Run each load point on every configuration in turn (order rotating per point, a fresh
    /// `cleave up` each time), so drifting machine load hits them alike; without it each
    /// configuration runs all its points before the next starts.
    #[arg(long)]
    pub interleave: bool,
    /// Add llama.cpp's server (this `llama-server` binary) as a configuration on the same model
    /// file, with the first configuration's compute threads.
    #[arg(long, env = "CLEAVE_LLAMA_SERVER")]
    pub llama_server: Option<PathBuf>,
    /// llama-server's parallel slots (default: the largest `--concurrency`, at least 1).
    #[arg(long)]
    pub llama_parallel: Option<usize>,
    /// llama-server's context per slot, tokens.
    #[arg(long, default_value_t = 2048)]
    pub llama_ctx_per_slot: usize,
    /// GGUF model for every configuration (default: the cached default model).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model_path: Option<PathBuf>,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// `NAME=FLAGS` → (name, flags split on whitespace).
pub fn parse_config(s: &str) -> anyhow::Result<(String, Vec<String>)> {
    let (name, flags) = s.split_once('=').with_context(|| {
        format!("--config {s:?}: expected NAME=FLAGS, e.g. aggregated=--prefill 0")
    })?;
    anyhow::ensure!(!name.trim().is_empty(), "--config {s:?}: empty name");
    let flags: Vec<String> = flags.split_whitespace().map(str::to_string).collect();
    if let Some(f) = flags.iter().find(|f| *f == "--port" || *f == "--model") {
        bail!("--config {s:?}: {f} is set by bench compare");
    }
    Ok((name.trim().to_string(), flags))
}

/// A running `cleave up`, stopped (SIGTERM, then SIGKILL) when dropped.
pub(crate) struct Up {
    pub(crate) child: Child,
    /// The API's base URL (`http://127.0.0.1:PORT/v1`).
    pub(crate) base: String,
    /// (role, metrics URL) of every worker.
    pub(crate) workers: Vec<(String, String)>,
    /// The fleet's output after start-up, line by line (`Err`: stderr, where the logs go).
    pub(crate) log: Option<mpsc::Receiver<Result<String, String>>>,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        for _ in 0..200 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            // Polling a child's exit with a deadline (std has no wait with timeout).
            #[allow(clippy::disallowed_methods)]
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `cleave up --port 0 --model MODEL FLAGS` and waits until it serves.
pub(crate) fn start(model: &str, flags: &[String]) -> anyhow::Result<Up> {
    let exe = std::env::current_exe().context("finding the cleave executable")?;
    let mut child = Command::new(exe)
        .args(["up", "--port", "0", "--model", model])
        .args(flags)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting cleave up")?;
    let (tx, rx) = mpsc::channel::<Result<String, String>>();
    let stdout = child.stdout.take().context("cleave up stdout")?;
    let stderr = child.stderr.take().context("cleave up stderr")?;
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(Ok(line));
        }
    });
    std::thread::spawn(move || {
        // Keep draining so the fleet never blocks on a full pipe; only the start matters.
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx2.send(Err(line));
        }
    });
    let mut up = Up {
        child,
        base: String::new(),
        workers: Vec::new(),
        log: None,
    };
    let mut log = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(180)) {
            Ok(Ok(line)) => {
                if let Some(rest) = line.strip_prefix("cleave is up: ") {
                    up.base = rest
                        .split_whitespace()
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    up.log = Some(rx);
                    return Ok(up);
                }
            }
            Ok(Err(line)) => {
                if let Some(i) = line.find("metrics http://") {
                    let role = line.split_whitespace().next().unwrap_or_default();
                    up.workers.push((
                        role.to_string(),
                        line[i + "metrics ".len()..].trim().to_string(),
                    ));
                }
                log.push(line);
            }
            Err(_) => bail!(
                "cleave up {} did not come up:\n{}",
                flags.join(" "),
                log.join("\n")
            ),
        }
    }
}

/// Entry point of `cleave bench compare`.
pub fn bench_compare(args: CompareArgs) -> anyhow::Result<()> {
    let mut configs: Vec<(String, Vec<String>)> = args
        .configs
        .iter()
        .map(|c| parse_config(c))
        .collect::<anyhow::Result<_>>()?;
    if args.equal_compute {
        match resources::equal_compute_partner(&configs)? {
            Some((name, flags)) => {
                eprintln!(
                    "--equal-compute: baseline {name}=cleave up {}",
                    flags.join(" ")
                );
                configs.insert(0, (name, flags));
            }
            None => eprintln!(
                "--equal-compute: an aggregated configuration with equal compute is already given"
            ),
        }
    }
    if let Some(path) = &args.llama_server {
        anyhow::ensure!(
            path.is_file(),
            "--llama-server {}: no such file (build llama.cpp's llama-server, or leave the flag out)",
            path.display()
        );
        let threads = resources::declared(&configs[0].1)?.compute_threads;
        let parallel = args
            .llama_parallel
            .or_else(|| args.load.concurrency.iter().copied().max())
            .unwrap_or(1)
            .max(1);
        let ctx = args.llama_ctx_per_slot * parallel;
        configs.push((
            llama::NAME.into(),
            llama::flags(path, threads, parallel, ctx),
        ));
    }
    let declared: Vec<Resources> = configs
        .iter()
        .map(|(name, flags)| {
            if llama::is_llama(flags) {
                llama::declared(flags, resources::own_cores())
            } else {
                resources::declared(flags)
            }
            .with_context(|| format!("--config {name}"))
        })
        .collect::<anyhow::Result<_>>()?;
    let named: Vec<(&str, Option<&Resources>)> = configs
        .iter()
        .zip(&declared)
        .map(|((n, _), r)| (n.as_str(), Some(r)))
        .collect();
    let diffs = compute_differences(&named);
    if !diffs.is_empty() {
        eprint!(
            "{}",
            unequal_banner(&configs[0].0, &diffs, args.allow_unequal)
        );
    }
    let model = match &args.model_path {
        Some(p) => p.clone(),
        None => crate::fetch::fetch_default_model(false)?,
    };
    let gguf = cleave_text::gguf::GgufFile::open(&model)
        .with_context(|| format!("reading {}", model.display()))?;
    let context = gguf
        .architecture()
        .ok()
        .and_then(|arch| gguf.get_u32(&format!("{arch}.context_length")).ok())
        .map(|c| format!("{c} tokens (from the GGUF)"))
        .unwrap_or_else(|| "unknown".into());
    drop(gguf);
    let loads = bench_serve::loads(&args.load)?;
    let (first, desc) = bench_serve::workload(&args.load, 0, &loads[0])?;
    let file = model
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    let rt = tokio::runtime::Runtime::new()?;
    let model_arg = model.display().to_string();
    // Starts one configuration, reads its resources, warms it up.
    let bring_up = |i: usize| -> anyhow::Result<(Up, RunConfig, Header)> {
        let (name, flags) = &configs[i];
        eprintln!("== {name}: cleave up {}", flags.join(" "));
        let llama = llama::is_llama(flags);
        let (up, res) = if llama {
            (llama::start(&model_arg, flags)?, declared[i].clone())
        } else {
            let up = start(&model_arg, flags)?;
            let res = resources::measure(&declared[i], up.child.id(), &up.workers);
            (up, res)
        };
        eprintln!("   resources: {}", res.to_text());
        let base = up.base.trim_end_matches('/').to_string();
        let root = base.strip_suffix("/v1").unwrap_or(&base).to_string();
        let (cfg, header) = rt.block_on(async {
            let served = bench_serve::served_model(&base).await?;
            let mut header = bench_serve::workload_header(&args.load, &loads, &first, desc.clone());
            header.endpoint = if llama {
                format!("{base} (llama-server {})", flags[1])
            } else {
                format!("{base} (cleave up {})", flags.join(" "))
            };
            header.model = served.clone();
            header.quantization = guess_quantization(&file);
            header.kv_dtype = if llama {
                "f16 (llama.cpp's default)".into()
            } else {
                "f16 (cleave's worker default)".into()
            };
            header.context_limit = context.clone();
            header.resources = Some(res);
            let target = Target {
                base: base.clone(),
                model: served,
                api: args.load.api,
                ignore_eos: !args.load.no_ignore_eos,
                timeout: args.load.timeout,
            };
            let cfg = bench_serve::run_config(
                &args.load,
                target,
                Some(format!("{root}/metrics")),
                up.workers.iter().map(|(_, u)| u.clone()).collect(),
            );
            let header = bench_serve::warm_up(&args.load, &cfg, header).await;
            anyhow::Ok((cfg, header))
        })?;
        Ok((up, cfg, header))
    };
    let mut reports: Vec<(String, Report)> = Vec::new();
    if args.interleave {
        // A fresh fleet per configuration and point: idle fleets are not kept up side by side
        // because they still use CPU (progress threads, watches), which would load the others.
        let mut headers: Vec<Option<Header>> = vec![None; configs.len()];
        let mut points: Vec<Vec<PointResult>> = vec![Vec::new(); configs.len()];
        for (p, load) in loads.iter().enumerate() {
            for k in 0..configs.len() {
                let c = (p + k) % configs.len();
                let (up, cfg, header) = bring_up(c)?;
                eprintln!("== {} @ {}", configs[c].0, load.label());
                points[c].push(rt.block_on(bench_serve::run_point(&args.load, &cfg, p, load))?);
                drop(up);
                headers[c].get_or_insert(header);
            }
        }
        for (((name, _), header), points) in configs.iter().zip(headers).zip(points) {
            let header = header.context("no load point ran")?;
            reports.push((name.clone(), Report { header, points }));
        }
    } else {
        for (i, (name, _)) in configs.iter().enumerate() {
            let (up, cfg, header) = bring_up(i)?;
            let mut points = Vec::new();
            for (p, load) in loads.iter().enumerate() {
                points.push(rt.block_on(bench_serve::run_point(&args.load, &cfg, p, load))?);
            }
            drop(up);
            reports.push((name.clone(), Report { header, points }));
        }
    }
    bench_serve::print_report(&args.load, &reports, args.allow_unequal)
}
