//! `cleave up`: the whole system on this machine — prefill workers, decode workers and the
//! router as separate processes on loopback, the real model, the real KV transport.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use cleave_router::place::PolicyKind;
use cleave_types::choices::{CollectiveTransport, KvBackendChoice};

/// Flags of `cleave up`.
#[derive(Debug, Args)]
pub struct UpArgs {
    /// Prefill workers (0: aggregated — decode workers prefill locally).
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// The router's port (OpenAI API at http://127.0.0.1:PORT/v1).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// KV transport between workers (auto: UCX when available).
    #[arg(long, value_enum, default_value = "auto")]
    pub transport: KvBackendChoice,
    /// Placement policy (the router's).
    #[arg(long, value_enum, default_value = "prefix-optimistic")]
    pub policy: PolicyKind,
    /// Disaggregate only when at least this many prompt blocks (16 tokens each) are uncached
    /// on the decode worker.
    #[arg(long, default_value_t = 1)]
    pub disagg_min_uncached_blocks: usize,
    /// GGUF file or Hugging Face directory; default: the cached default model (fetched on
    /// first use).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: Option<PathBuf>,
    /// The chat template (passed to the router): a built-in name (`chatml`, `llama3`,
    /// `gemma`), a Jinja file, or the template text; default: the model's own.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// KV blocks per worker (16 tokens each); overrides `--kv-memory`.
    #[arg(long)]
    pub kv_blocks: Option<usize>,
    /// Each worker's KV pool when `--kv-blocks` is not given: `auto` (one sequence of the
    /// model's whole context, up to 32,768 tokens; the default model: 512 blocks) or a size
    /// (`4GiB`, `512MiB`).
    #[arg(long, default_value = "auto")]
    pub kv_memory: cleave_config::kv_pool::KvMemory,
    /// The element type of every worker's KV cache (prefill and decode must agree: the blocks
    /// move between them as bytes).
    #[arg(long, value_enum, default_value = "f16")]
    pub kv_dtype: cleave_types::choices::KvDtype,
    /// Each worker's host-memory KV tier below its pool (`2GiB`; `0`, the default, for none):
    /// evicted prefixes are kept there and copied back on a hit instead of recomputed.
    #[arg(long, default_value = "0")]
    pub kv_host_memory: bytesize::ByteSize,
    /// A directory for the workers' disk KV tiers: each worker claims a slot in it (`slot-N`),
    /// found again by the next `cleave up` on the same directory. Default: no disk tier.
    #[arg(long)]
    pub kv_disk_dir: Option<PathBuf>,
    /// Bytes each worker's disk tier may hold.
    #[arg(long, default_value = "10GiB")]
    pub kv_disk_size: bytesize::ByteSize,
    /// Demotions plus restores a block needs before it is written to disk.
    #[arg(long, default_value_t = 2)]
    pub kv_disk_min_uses: u32,
    /// Compute threads per worker.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Tensor-parallel size: each worker is a group of this many processes (rank 0 serves,
    /// the others compute its heads' share). A group whose rank dies is restarted whole.
    #[arg(long)]
    pub tp: Option<usize>,
    /// Expert-parallel size for an MoE model: each worker is a group of this many processes,
    /// each holding 1/N of the experts (tokens reach them by all-to-all; attention runs
    /// tensor-parallel over the same ranks, so `--tp`, if given, must be equal).
    #[arg(long)]
    pub ep: Option<usize>,
    /// Transport of the collectives inside each group.
    #[arg(long, value_enum, default_value = "tcp")]
    pub group_transport: CollectiveTransport,
    /// Serve the API over HTTPS with this PEM certificate chain (with `--tls-key`; passed to
    /// the router, docs/security.md). Default: plain HTTP on loopback.
    #[arg(long)]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long)]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates from these PEM CA certificates (mutual TLS).
    #[arg(long)]
    pub tls_client_ca: Option<PathBuf>,
    /// Admission (passed to the router): requests running at once.
    #[arg(long)]
    pub max_in_flight: Option<usize>,
    /// Admission: requests waiting for a slot; beyond this, 429.
    #[arg(long)]
    pub max_queue: Option<usize>,
    /// Admission: longest wait for a slot before a 429 (e.g. `2s`).
    #[arg(long)]
    pub queue_timeout: Option<String>,
    /// Restart a worker that exits, at the same address (as a group is restarted), instead of
    /// shutting everything down.
    #[arg(long)]
    pub restart_workers: bool,
    /// Mutual TLS between the processes (gRPC and the KV transport's TCP path), passed to each.
    #[command(flatten)]
    pub internal_tls: cleave_config::internal_tls::InternalTlsArgs,
}

impl UpArgs {
    /// Processes per worker, from `--tp` and `--ep`.
    fn group_size(&self) -> anyhow::Result<usize> {
        let n = cleave_worker::group::size_from_flags(self.tp, self.ep)?.unwrap_or(1);
        anyhow::ensure!(n >= 1, "--tp/--ep must be at least 1");
        Ok(n)
    }
}

/// Child processes, terminated (SIGTERM, then SIGKILL) when dropped.
struct Fleet(Vec<(String, Child)>);

impl Drop for Fleet {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(c.id().to_string())
                .status();
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        for (name, c) in &mut self.0 {
            loop {
                match c.try_wait() {
                    Ok(Some(_)) => break,
                    Ok(None) if Instant::now() < deadline => {
                        // Polling a child's exit with a deadline (std has no wait with timeout).
                        #[allow(clippy::disallowed_methods)]
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    _ => {
                        eprintln!("{name} did not stop in time: killing it");
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                }
            }
        }
    }
}

type FirstLine = mpsc::Receiver<Option<std::io::Result<String>>>;

/// Starts `args` as a child of this executable; the receiver yields its first stdout line.
fn start(fleet: &mut Fleet, name: &str, args: &[String]) -> anyhow::Result<FirstLine> {
    let (child, rx) = start_child(name, args)?;
    fleet.0.push((name.to_string(), child));
    Ok(rx)
}

fn start_child(name: &str, args: &[String]) -> anyhow::Result<(Child, FirstLine)> {
    let exe = std::env::current_exe().context("finding the cleave executable")?;
    let mut child = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = tx.send(first);
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    Ok((child, rx))
}

/// Waits for a started child's one-line JSON of addresses.
fn ready_line(name: &str, rx: FirstLine) -> anyhow::Result<serde_json::Value> {
    match rx.recv_timeout(Duration::from_secs(180)) {
        Ok(Some(Ok(line))) => {
            serde_json::from_str(&line).with_context(|| format!("{name} printed {line:?}"))
        }
        _ => bail!("{name} did not become ready (see its log above)"),
    }
}

/// Starts `args` as a child of this executable and waits for its one-line JSON of addresses.
fn spawn(fleet: &mut Fleet, name: &str, args: &[String]) -> anyhow::Result<serde_json::Value> {
    let rx = start(fleet, name, args)?;
    ready_line(name, rx)
}

/// A worker of `--tp` processes: the argv of each rank (fixed ports, so a restarted group
/// is found at the same address) and the ranks' indices in the fleet.
struct Group {
    name: String,
    argvs: Vec<Vec<String>>,
    members: Vec<usize>,
}

/// Starts every rank of a group (they wait for each other), returns the leader's addresses.
/// A restarted group takes its old places in the fleet.
fn start_group(fleet: &mut Fleet, g: &mut Group) -> anyhow::Result<serde_json::Value> {
    let mut pending = Vec::new();
    let restart = !g.members.is_empty();
    for (rank, argv) in g.argvs.iter().enumerate() {
        let name = format!("{} rank {rank}", g.name);
        let (child, rx) = start_child(&name, argv)?;
        if restart {
            fleet.0[g.members[rank]].1 = child;
        } else {
            fleet.0.push((name.clone(), child));
            g.members.push(fleet.0.len() - 1);
        }
        pending.push((name, rx));
    }
    let mut lines = Vec::new();
    for (name, rx) in pending {
        lines.push(ready_line(&name, rx)?);
    }
    Ok(lines.swap_remove(0))
}

/// Terminates the surviving ranks of a failed group and starts it again.
fn restart_group(fleet: &mut Fleet, g: &mut Group) -> anyhow::Result<()> {
    for &i in &g.members {
        let c = &mut fleet.0[i].1;
        let _ = c.kill();
        let _ = c.wait();
    }
    start_group(fleet, g)?;
    eprintln!("{} restarted", g.name);
    Ok(())
}

fn wait_ready(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if crate::http::get(url)
            .map(|(status, _)| status == 200)
            .unwrap_or(false)
        {
            return Ok(());
        }
        // Polling a child's readiness endpoint until its deadline.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("{url} did not report ready within {timeout:?}")
}

pub fn up(args: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.decode >= 1, "--decode must be at least 1");
    let group_size = args.group_size()?;
    let model = match &args.model {
        Some(p) => p.clone(),
        None => crate::fetch::fetch_default_model(false)?,
    };
    let model = model.display().to_string();
    let mut fleet = Fleet(Vec::new());
    let worker = |role: &str| -> Vec<String> {
        let mut a: Vec<String> = [
            "worker",
            "--role",
            role,
            "--model",
            &model,
            "--kv-memory",
            &args.kv_memory.to_string(),
            "--kv-dtype",
            args.kv_dtype.as_str(),
            "--threads",
            &args.threads.to_string(),
            "--transport",
            args.transport.as_str(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if let Some(n) = args.kv_blocks {
            a.extend(["--kv-blocks".to_string(), n.to_string()]);
        }
        a.extend([
            "--kv-host-memory".into(),
            args.kv_host_memory.as_u64().to_string(),
        ]);
        if let Some(dir) = &args.kv_disk_dir {
            a.extend([
                "--kv-disk-dir".into(),
                dir.display().to_string(),
                "--kv-disk-size".into(),
                args.kv_disk_size.as_u64().to_string(),
                "--kv-disk-min-uses".into(),
                args.kv_disk_min_uses.to_string(),
            ]);
        }
        // The workers refuse --ep for a dense model.
        if let Some(ep) = args.ep {
            a.extend(["--ep".to_string(), ep.to_string()]);
        }
        a.extend(args.internal_tls.flags());
        a
    };
    let mut router_args: Vec<String> = [
        "router",
        "--model",
        &model,
        "--listen",
        &format!("127.0.0.1:{}", args.port),
        "--policy",
        args.policy.name(),
        "--disagg-min-uncached-blocks",
        &args.disagg_min_uncached_blocks.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (flag, file) in [
        ("--tls-cert", &args.tls_cert),
        ("--tls-key", &args.tls_key),
        ("--tls-client-ca", &args.tls_client_ca),
    ] {
        if let Some(f) = file {
            router_args.extend([flag.to_string(), f.display().to_string()]);
        }
    }
    router_args.extend(args.internal_tls.flags());
    for (flag, value) in [
        ("--max-in-flight", args.max_in_flight.map(|n| n.to_string())),
        ("--max-queue", args.max_queue.map(|n| n.to_string())),
        ("--queue-timeout", args.queue_timeout.clone()),
        ("--chat-template", args.chat_template.clone()),
    ] {
        if let Some(v) = value {
            router_args.extend([flag.to_string(), v]);
        }
    }
    let tls = args.tls_cert.is_some();
    let mut groups = Vec::new();
    for (role, n) in [("prefill", args.prefill), ("decode", args.decode)] {
        for i in 0..n {
            let addrs = if group_size == 1 && !args.restart_workers {
                spawn(&mut fleet, &format!("{role}-{i}"), &worker(role))?
            } else {
                // A supervised worker (a "group" of one) or a group of ranks, at fixed ports.
                let argvs = if group_size == 1 {
                    vec![fixed_ports(worker(role))?]
                } else {
                    let base = [
                        worker(role),
                        vec![
                            "--group-transport".into(),
                            args.group_transport.as_str().into(),
                        ],
                    ]
                    .concat();
                    group_argvs(base, group_size)?
                };
                let mut g = Group {
                    name: format!("{role}-{i}"),
                    argvs,
                    members: Vec::new(),
                };
                let addrs = start_group(&mut fleet, &mut g)?;
                groups.push(g);
                addrs
            };
            let grpc = addrs["grpc"]
                .as_str()
                .context("worker printed no grpc address")?;
            eprintln!(
                "{role} worker {i}: grpc {grpc}, metrics http://{}/metrics",
                addrs["http"].as_str().unwrap_or("?")
            );
            router_args.push(format!("--{role}"));
            router_args.push(format!("http://{grpc}"));
        }
    }
    let addrs = spawn(&mut fleet, "router", &router_args)?;
    let http = addrs["http"]
        .as_str()
        .context("router printed no address")?
        .to_string();
    // The router answers once it listens; over HTTPS its readiness is not probed here (that
    // would need a client trusting its certificate), so the first requests may get a 503
    // until it has seen a decode worker.
    if !tls {
        wait_ready(&format!("http://{http}/ready"), Duration::from_secs(60))?;
    }
    let scheme = if tls { "https" } else { "http" };
    println!(
        "cleave is up: {scheme}://{http}/v1 (model {model}; {} prefill, {} decode, {} processes each \
         ({}); Ctrl-C stops it)",
        args.prefill,
        args.decode,
        group_size,
        if args.ep.is_some() { "EP" } else { "TP" }
    );
    // Wait for Ctrl-C / SIGTERM, or for a child to die.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let stop = tokio_util::sync::CancellationToken::new();
    rt.block_on(async {
        cleave_telemetry::cancel_on_signal(stop.clone());
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(Duration::from_millis(500)) => {
                    let mut failed_groups = Vec::new();
                    for (i, (name, c)) in fleet.0.iter_mut().enumerate() {
                        let Some(g) = groups.iter().position(|g| g.members.contains(&i)) else {
                            if let Ok(Some(status)) = c.try_wait() {
                                eprintln!("{name} exited ({status}); shutting down");
                                stop.cancel();
                            }
                            continue;
                        };
                        if let Ok(Some(status)) = c.try_wait() {
                            eprintln!("{name} exited ({status}); restarting its worker");
                            failed_groups.push(g);
                        }
                    }
                    failed_groups.dedup();
                    for g in failed_groups {
                        if let Err(e) = restart_group(&mut fleet, &mut groups[g]) {
                            eprintln!("restarting {}: {e:#}; shutting down", groups[g].name);
                            stop.cancel();
                        }
                    }
                }
            }
        }
    });
    eprintln!("stopping ...");
    drop(fleet);
    Ok(())
}

/// A free loopback port (a restarted process binds it again).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `base` with fixed gRPC and HTTP ports, so a restarted worker comes back where the router
/// knows it.
fn fixed_ports(mut base: Vec<String>) -> anyhow::Result<Vec<String>> {
    base.extend([
        "--grpc-addr".to_string(),
        format!("127.0.0.1:{}", free_port()?),
        "--http-addr".into(),
        format!("127.0.0.1:{}", free_port()?),
    ]);
    Ok(base)
}

/// The argv of each rank of a group: fixed gRPC/HTTP ports for the leader (a restarted group
/// comes back at the address the router knows), a fresh group port.
fn group_argvs(base: Vec<String>, tp: usize) -> anyhow::Result<Vec<Vec<String>>> {
    let leader = format!("127.0.0.1:{}", free_port()?);
    let (grpc, http) = (free_port()?, free_port()?);
    Ok((0..tp)
        .map(|rank| {
            let mut a = base.clone();
            a.extend([
                "--tp".to_string(),
                tp.to_string(),
                "--group-rank".into(),
                rank.to_string(),
                "--group-leader".into(),
                leader.clone(),
            ]);
            if rank == 0 {
                a.extend([
                    "--group-bind".to_string(),
                    leader.clone(),
                    "--grpc-addr".into(),
                    format!("127.0.0.1:{grpc}"),
                    "--http-addr".into(),
                    format!("127.0.0.1:{http}"),
                ]);
            }
            a
        })
        .collect())
}
