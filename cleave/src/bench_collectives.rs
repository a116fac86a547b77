//! `cleave bench collectives`: all-reduce and all-to-all bandwidth of a group of local rank
//! processes per message size, next to memcpy measured in the same run.
//!
//! The ranks are this binary re-executed (`cleave bench collectives-rank`, hidden): rank 0 binds
//! an ephemeral leader port and prints it, the parent then starts the other ranks with it. Rank 0
//! reports one JSON line per measurement. Bandwidths follow nccl-tests: algorithm bandwidth is
//! message bytes / time; bus bandwidth scales it by 2(n-1)/n for all-reduce and (n-1)/n for
//! all-to-all, comparable to what one link carries.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use cleave_collective::{GroupConfig, NetGroup, Pending, Transport};
use cleave_types::collective::Collective;
use serde::{Deserialize, Serialize};

#[derive(Debug, Args)]
pub struct CollectivesArgs {
    /// Group sizes (a group of local processes each).
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    pub world: Vec<usize>,
    /// Message sizes in KiB (per rank: the all-reduce buffer, the all-to-all send total).
    #[arg(long, value_delimiter = ',', default_value = "4,64,1024,16384,65536")]
    pub kib: Vec<usize>,
    /// Bytes to move per size and operation (sets the iteration count), in MiB.
    #[arg(long, default_value_t = 256)]
    pub mib_per_size: usize,
    /// Transports to measure (ucx is skipped in builds without UCX).
    #[arg(long, value_delimiter = ',', default_value = "tcp,ucx")]
    pub transport: Vec<String>,
}

/// One rank of the benchmark (started by `cleave bench collectives`).
#[derive(Debug, Args)]
pub struct RankArgs {
    #[arg(long)]
    pub rank: usize,
    #[arg(long)]
    pub world: usize,
    /// Rank 0's address; rank 0 binds an ephemeral port and prints it when absent.
    #[arg(long)]
    pub leader: Option<String>,
    #[arg(long, value_delimiter = ',')]
    pub kib: Vec<usize>,
    #[arg(long)]
    pub mib_per_size: usize,
    #[arg(long, default_value = "tcp")]
    pub transport: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Sample {
    op: String,
    bytes: usize,
    iters: usize,
    secs_per_iter: f64,
}

fn iters_for(bytes: usize, mib: usize) -> usize {
    ((mib << 20) / bytes.max(1)).clamp(3, 2000)
}

/// Runs the benchmark and prints the table.
pub fn bench_collectives(args: CollectivesArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("locating the cleave binary")?;
    println!("cleave bench collectives: local rank processes over loopback; GB/s = 1e9 bytes/s");
    println!("memcpy baseline (same run, one core):");
    let mut memcpy = Vec::new();
    for &kib in &args.kib {
        let gbs = memcpy_gbs(kib << 10, args.mib_per_size);
        println!("  {:>9}  {:>7.2} GB/s", human(kib << 10), gbs);
        memcpy.push(gbs);
    }
    for t in &args.transport {
        let transport: Transport = t.parse().map_err(anyhow::Error::msg)?;
        if !cleave_collective::transport_available(transport) {
            println!("\ntransport {t}: this build has no UCX; skipped");
            continue;
        }
        for &world in &args.world {
            if world < 2 {
                bail!("--world {world}: a group needs at least 2 ranks");
            }
            let samples = run_group(&exe, world, t, &args)?;
            println!("\ntransport {t}, world {world}:");
            println!(
                "  {:<11} {:>9} {:>7} {:>11} {:>12} {:>12} {:>9}",
                "op", "size", "iters", "time/call", "algbw GB/s", "busbw GB/s", "/memcpy"
            );
            for s in samples {
                let algbw = s.bytes as f64 / s.secs_per_iter / 1e9;
                let factor = match s.op.as_str() {
                    "all_reduce" => 2.0 * (world - 1) as f64 / world as f64,
                    _ => (world - 1) as f64 / world as f64,
                };
                let base = args
                    .kib
                    .iter()
                    .position(|&k| k << 10 == s.bytes)
                    .map_or(f64::NAN, |i| memcpy[i]);
                println!(
                    "  {:<11} {:>9} {:>7} {:>9.1}us {:>12.3} {:>12.3} {:>8.3}x",
                    s.op,
                    human(s.bytes),
                    s.iters,
                    s.secs_per_iter * 1e6,
                    algbw,
                    algbw * factor,
                    algbw * factor / base
                );
            }
        }
    }
    Ok(())
}

/// Starts `world` rank processes, collects rank 0's samples, and waits for all of them.
fn run_group(
    exe: &std::path::Path,
    world: usize,
    transport: &str,
    args: &CollectivesArgs,
) -> anyhow::Result<Vec<Sample>> {
    let kib: Vec<String> = args.kib.iter().map(|k| k.to_string()).collect();
    let spawn = |rank: usize, leader: Option<&str>| -> anyhow::Result<Child> {
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "collectives-rank", "--rank", &rank.to_string()])
            .args(["--world", &world.to_string(), "--kib", &kib.join(",")])
            .args(["--mib-per-size", &args.mib_per_size.to_string()])
            .args(["--transport", transport])
            .stdout(Stdio::piped());
        if let Some(l) = leader {
            cmd.args(["--leader", l]);
        }
        cmd.spawn().context("starting a rank process")
    };
    let mut children = vec![spawn(0, None)?];
    let mut lines = BufReader::new(children[0].stdout.take().context("rank 0 stdout")?).lines();
    let first = lines.next().context("rank 0 exited before binding")??;
    let leader = first
        .strip_prefix("LEADER ")
        .context("rank 0 did not print its address")?
        .to_string();
    for rank in 1..world {
        children.push(spawn(rank, Some(&leader))?);
    }
    let mut samples = Vec::new();
    for line in lines {
        samples.push(serde_json::from_str::<Sample>(&line?).context("rank 0 output")?);
    }
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait()?;
        if !status.success() {
            bail!("rank {rank} of {world} failed: {status}");
        }
    }
    Ok(samples)
}

/// The body of one rank process.
pub fn bench_rank(args: RankArgs) -> anyhow::Result<()> {
    let mut cfg = GroupConfig::new(
        args.rank,
        args.world,
        args.leader.clone().unwrap_or_else(|| "127.0.0.1:0".into()),
    );
    cfg.bind_addr = Some("127.0.0.1:0".parse().expect("literal"));
    cfg.timeout = Duration::from_secs(120);
    cfg.transport = args.transport.parse().map_err(anyhow::Error::msg)?;
    let pending = Pending::bind(cfg)?;
    if args.rank == 0 {
        println!("LEADER {}", pending.local_addr()?);
    }
    let g = pending.join()?;
    for &kib in &args.kib {
        let bytes = kib << 10;
        let iters = iters_for(bytes, args.mib_per_size);
        let mut buf = vec![1.0f32; bytes / 4];
        let secs = time(&g, iters, || g.all_reduce_sum(&mut buf))?;
        report(&g, "all_reduce", bytes, iters, secs);
        let w = g.world();
        let send: Vec<Vec<f32>> = (0..w).map(|_| vec![1.0f32; bytes / 4 / w]).collect();
        let mut recv = Vec::new();
        let secs = time(&g, iters, || g.all_to_all_v(&send, &mut recv))?;
        report(&g, "all_to_all", bytes / 4 / w * 4 * w, iters, secs);
    }
    Ok(())
}

fn time(
    g: &NetGroup,
    iters: usize,
    mut f: impl FnMut() -> Result<(), cleave_types::collective::CollectiveError>,
) -> anyhow::Result<f64> {
    f()?;
    g.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    g.barrier()?;
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

fn report(g: &NetGroup, op: &str, bytes: usize, iters: usize, secs_per_iter: f64) {
    if g.rank() == 0 {
        let s = Sample {
            op: op.into(),
            bytes,
            iters,
            secs_per_iter,
        };
        println!("{}", serde_json::to_string(&s).expect("serialisable"));
    }
}

/// GB/s of copying a `bytes`-sized buffer (best of a few rounds).
fn memcpy_gbs(bytes: usize, mib: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let iters = iters_for(bytes, mib);
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        for _ in 0..iters {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        best = best.min(start.elapsed().as_secs_f64() / iters as f64);
    }
    bytes as f64 / best / 1e9
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}
