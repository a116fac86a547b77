//! The KV-transfer benchmark behind `cleave bench kv-transfer`: GB/s of KV-block-shaped
//! transfers between two transports of each backend in this process (separate UCX workers, so
//! UCX uses its shared-memory transports exactly as between processes), next to single-thread
//! memcpy measured in the same run and, when installed, `ucx_perftest`'s put bandwidth.

use crate::transport::{default_transport, ucx_available, Backend, BackendChoice, TransportConfig};
use crate::{Error, WriteOp};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// One block of the default model: 30 layers × (K, V) × 16 tokens × 3 KV heads × 64 dims, in
/// f16 (368,640 bytes; an f32 KV cache doubles it — set [`BenchConfig::block_bytes`]).
pub const DEFAULT_BLOCK_BYTES: usize = 30 * 2 * 16 * 3 * 64 * 2;

/// What to measure.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BenchConfig {
    /// Bytes in one KV block.
    pub block_bytes: usize,
    /// Bytes to move per shape and backend (more iterations for small shapes).
    pub bytes_per_shape: u64,
    /// Backends to measure; UCX is skipped when unavailable.
    pub backends: Vec<Backend>,
    /// Also run `ucx_perftest` (when it is on `PATH`).
    pub ucx_perftest: bool,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig {
            block_bytes: DEFAULT_BLOCK_BYTES,
            bytes_per_shape: 2 << 30,
            backends: vec![Backend::Ucx, Backend::Tcp],
            ucx_perftest: true,
        }
    }
}

/// One measurement.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResult {
    /// The backend.
    pub backend: Backend,
    /// The transfer shape (`block`, `run16`, `prompt2k`, `scattered128`).
    pub shape: String,
    /// Bytes per transfer.
    pub bytes: u64,
    /// Gigabytes (10^9) per second.
    pub gbps: f64,
}

/// The whole run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    /// Single-thread memcpy of a prompt-sized buffer, GB/s.
    pub memcpy_gbps: f64,
    /// `ucx_perftest -t ucp_put_bw` at prompt size over loopback, GB/s, when installed.
    pub ucx_perftest_gbps: Option<f64>,
    /// One row per backend and shape.
    pub results: Vec<BenchResult>,
}

impl BenchReport {
    /// A human-readable table, with each result as a fraction of memcpy.
    pub fn table(&self) -> String {
        let mut out = format!(
            "{:<8} {:<14} {:>12} {:>9} {:>9}\n",
            "backend", "shape", "bytes", "GB/s", "x memcpy"
        );
        for r in &self.results {
            out += &format!(
                "{:<8} {:<14} {:>12} {:>9.2} {:>9.2}\n",
                r.backend.to_string(),
                r.shape,
                r.bytes,
                r.gbps,
                r.gbps / self.memcpy_gbps
            );
        }
        out += &format!("memcpy (1 thread)              {:>9.2}\n", self.memcpy_gbps);
        match self.ucx_perftest_gbps {
            Some(g) => out += &format!("ucx_perftest ucp_put_bw        {g:>9.2}\n"),
            None => out += "ucx_perftest                   not installed or failed\n",
        }
        out
    }
}

/// The shapes: (name, ops in block units as (local block, remote block)).
fn shapes() -> Vec<(&'static str, Vec<(usize, usize)>)> {
    vec![
        ("block", vec![(0, 0)]),
        ("run16", (0..16).map(|i| (i, i)).collect()),
        ("prompt2k", (0..128).map(|i| (i, i)).collect()),
        (
            "scattered128",
            (0..128).map(|i| (i, (i * 37) % 256)).collect(),
        ),
    ]
}

/// Runs the benchmark. Call inside a tokio runtime.
pub async fn bench(config: &BenchConfig) -> Result<BenchReport, Error> {
    let prompt_bytes = 128 * config.block_bytes;
    let memcpy_gbps = tokio::task::spawn_blocking(move || memcpy_gbps(prompt_bytes))
        .await
        .map_err(|_| Error::Shutdown)?;
    let mut results = Vec::new();
    for &backend in &config.backends {
        if backend == Backend::Ucx && !ucx_available() {
            tracing::info!("UCX not available in this build, skipping its benchmark");
            continue;
        }
        let choice = match backend {
            Backend::Ucx => BackendChoice::Ucx,
            Backend::Tcp => BackendChoice::Tcp,
        };
        let cfg = TransportConfig {
            backend: choice,
            ..Default::default()
        };
        let (a, b) = (default_transport(&cfg)?, default_transport(&cfg)?);
        let src = a.allocate_region(128 * config.block_bytes)?.handle();
        let dst = b.allocate_region(256 * config.block_bytes)?.handle();
        for i in 0..128 {
            src.copy_in(i * config.block_bytes, &vec![i as u8; config.block_bytes]);
        }
        let (peer, desc) = (b.local_address(), dst.descriptor());
        for (shape, blocks) in shapes() {
            let ops: Vec<WriteOp> = blocks
                .iter()
                .map(|&(l, r)| WriteOp {
                    local_offset: l * config.block_bytes,
                    remote_offset: r * config.block_bytes,
                    len: config.block_bytes,
                })
                .collect();
            let bytes = (ops.len() * config.block_bytes) as u64;
            let iterations = (config.bytes_per_shape / bytes).clamp(3, 20_000);
            a.write(&peer, &desc, &ops, &src, CancellationToken::new())
                .await?; // warm-up
            let start = Instant::now();
            for _ in 0..iterations {
                a.write(&peer, &desc, &ops, &src, CancellationToken::new())
                    .await?;
            }
            let secs = start.elapsed().as_secs_f64();
            results.push(BenchResult {
                backend,
                shape: shape.into(),
                bytes,
                gbps: (bytes * iterations) as f64 / secs / 1e9,
            });
        }
    }
    let ucx_perftest_gbps = if config.ucx_perftest {
        tokio::task::spawn_blocking(move || ucx_perftest_gbps(prompt_bytes))
            .await
            .ok()
            .flatten()
    } else {
        None
    };
    Ok(BenchReport {
        memcpy_gbps,
        ucx_perftest_gbps,
        results,
    })
}

/// Single-thread memcpy between two prompt-sized buffers.
fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    dst.copy_from_slice(&src); // fault the pages in
    let iterations = ((1u64 << 30) / bytes as u64).max(3);
    let start = Instant::now();
    for _ in 0..iterations {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
    }
    (bytes as u64 * iterations) as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// `ucx_perftest -t ucp_put_bw` between a server and a client process on loopback.
fn ucx_perftest_gbps(bytes: usize) -> Option<f64> {
    use std::process::{Command, Stdio};
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .ok()?
        .local_addr()
        .ok()?
        .port()
        .to_string();
    let mut server = Command::new("ucx_perftest")
        .args(["-p", &port])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    // ucx_perftest's server says nothing when it listens, and a probe connection would be taken
    // as its client: the baseline waits a moment and is reported missing if the client fails.
    #[allow(clippy::disallowed_methods)]
    std::thread::sleep(Duration::from_millis(500));
    let output = Command::new("timeout")
        .args([
            "60",
            "ucx_perftest",
            "127.0.0.1",
            "-p",
            &port,
            "-t",
            "ucp_put_bw",
            "-s",
            &bytes.to_string(),
            "-n",
            "200",
        ])
        .stderr(Stdio::null())
        .output();
    let _ = server.kill();
    let _ = server.wait();
    let text = String::from_utf8_lossy(&output.ok()?.stdout).into_owned();
    // "Final:  iters  lat50  lat_avg  lat_overall  bw_avg  bw_overall  rate_avg  rate_overall"
    // with bandwidth in MB/s of 2^20 bytes.
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("Final:"))?;
    let numbers: Vec<f64> = line
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    Some(numbers.get(5)? * 1048576.0 / 1e9)
}
