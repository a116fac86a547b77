//! The worker binaries' configuration (`cleave-worker`, `cleave-prefill-worker`,
//! `cleave-decode-worker`, `cleave worker`): flags or `CLEAVE_*` environment variables.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use cleave_types::choices::{KvBackendChoice, KvDtype};

use cleave_types::duration::parse_duration;

/// What a worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// Runs prefills for decode workers and writes the KV into their memory.
    Prefill,
    /// Decodes (and prefills locally when no prefill worker is given or it fails).
    Decode,
}

/// Worker settings (flags, or `CLEAVE_*` environment variables).
#[derive(Clone, Debug, Args)]
pub struct WorkerConfig {
    /// The model: a GGUF file or a Hugging Face directory (`config.json`, safetensors,
    /// `tokenizer.json`); both roles must load the same one.
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: PathBuf,
    /// gRPC listen address (port 0 picks a free port).
    #[arg(long, env = "CLEAVE_GRPC_ADDR", default_value = "127.0.0.1:0")]
    pub grpc_addr: SocketAddr,
    /// HTTP listen address for /health, /ready and /metrics.
    #[arg(long, env = "CLEAVE_HTTP_ADDR", default_value = "127.0.0.1:0")]
    pub http_addr: SocketAddr,
    /// KV blocks in this worker's pool (16 tokens each); overrides `--kv-memory`.
    #[arg(long, env = "CLEAVE_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// The KV pool's size when `--kv-blocks` is not given: `auto` (one sequence of the model's
    /// whole context, up to 32,768 tokens) or the bytes of the whole model's KV (`4GiB`,
    /// `512MiB`, `8G`; a group's ranks each hold their heads' share).
    #[arg(long, env = "CLEAVE_KV_MEMORY", default_value = "auto")]
    pub kv_memory: crate::kv_pool::KvMemory,
    /// KV element type: f16 (llama.cpp's default too), f32, or q8_0 (llama.cpp's 8.5-bit
    /// blocks). Prefill and decode workers must agree.
    #[arg(long, env = "CLEAVE_KV_DTYPE", value_enum, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Host-memory KV tier below the pool (`8GiB`; `0`, the default, for none): cached blocks
    /// the pool evicts are kept here and copied back on a prefix hit instead of recomputed.
    #[arg(long, env = "CLEAVE_KV_HOST_MEMORY", default_value = "0")]
    pub kv_host_memory: bytesize::ByteSize,
    /// Disk KV tier: a directory (a local SSD; a PVC, `hostPath` or `emptyDir` in Kubernetes)
    /// for blocks leaving the host tier that were used at least `--kv-disk-min-uses` times;
    /// every entry is checksummed and fingerprinted, and found again after a restart. Workers
    /// may share the directory: each claims a slot of its own.
    #[arg(long, env = "CLEAVE_KV_DISK_DIR")]
    pub kv_disk_dir: Option<PathBuf>,
    /// Bytes the disk tier may hold (least recently used entries go first).
    #[arg(long, env = "CLEAVE_KV_DISK_SIZE", default_value = "10GiB")]
    pub kv_disk_size: bytesize::ByteSize,
    /// Demotions plus restores a block needs before it is written to disk (1: every block
    /// leaving the host tier), so that one-off prompts do not wear the disk.
    #[arg(long, env = "CLEAVE_KV_DISK_MIN_USES", default_value_t = 2,
          value_parser = clap::builder::RangedU64ValueParser::<u32>::new().range(1..))]
    pub kv_disk_min_uses: u32,
    /// Compute threads.
    #[arg(long, env = "CLEAVE_THREADS", default_value_t = 1)]
    pub threads: usize,
    /// Async runtime threads (gRPC, HTTP, KV transfers), beside the compute threads.
    #[arg(long, env = "CLEAVE_RUNTIME_THREADS", default_value_t = crate::DEFAULT_RUNTIME_THREADS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub runtime_threads: usize,
    /// Tokens per engine step (decodes plus prefill chunks).
    #[arg(long, env = "CLEAVE_STEP_TOKENS", default_value_t = 256)]
    pub step_tokens: usize,
    /// Most prompt tokens in a step that also decodes (0: only `--step-tokens` limits them).
    /// Every running stream waits for each step, so this bounds the inter-token latency a new
    /// prompt adds to them, at the cost of that prompt's time to first token under load
    /// (README: at 16 concurrent streams on one CPU thread, 16 kept ITL p99 at 1.1× p50 where
    /// 0 let it reach 11.7×, for 8% less throughput).
    #[arg(
        long,
        env = "CLEAVE_PREFILL_TOKENS_WHILE_DECODING",
        default_value_t = 16
    )]
    pub prefill_tokens_while_decoding: usize,
    /// KV transport: ucx when available, else tcp.
    #[arg(long, env = "CLEAVE_TRANSPORT", value_enum, default_value = "auto")]
    pub transport: KvBackendChoice,
    /// Where the KV transport listens (peers write KV blocks and confirm transfers through
    /// it); default: the gRPC address's IP on a free port.
    #[arg(long, env = "CLEAVE_KV_LISTEN")]
    pub kv_listen: Option<SocketAddr>,
    /// The IP peers on other hosts dial to reach this worker's KV transport, needed when it
    /// listens on every interface (the operator sets the pod IP); default: the host of
    /// `--advertise-addr` when that is an IP, else this host's address on its default route.
    #[arg(long, env = "CLEAVE_KV_ADVERTISE")]
    pub kv_advertise: Option<std::net::IpAddr>,
    /// Decode role: how long to wait for a prefill worker before giving up on it.
    #[arg(long, env = "CLEAVE_PREFILL_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub prefill_timeout: Duration,
    /// Decode role: when the prefill worker fails, compute the prompt locally (else fail the
    /// request).
    #[arg(long, env = "CLEAVE_LOCAL_FALLBACK", default_value_t = true, action = clap::ArgAction::Set)]
    pub local_fallback: bool,
    /// Decode role: prefill locally (even when a prefill worker is named) when fewer than this
    /// many prompt tokens are not already cached here.
    #[arg(long, env = "CLEAVE_LOCAL_PREFILL_BELOW_TOKENS", default_value_t = 0)]
    pub local_prefill_below_tokens: usize,
    /// etcd endpoints (comma-separated) to register this worker in, for routers' etcd
    /// discovery; unset: no registration.
    #[arg(long, env = "CLEAVE_ETCD")]
    pub etcd: Option<String>,
    /// Key prefix of worker registrations in etcd.
    #[arg(long, env = "CLEAVE_ETCD_PREFIX", default_value = "/cleave/workers/")]
    pub etcd_prefix: String,
    /// The host (or `host:port`) routers dial; default: the bound gRPC address.
    #[arg(long, env = "CLEAVE_ADVERTISE_ADDR")]
    pub advertise_addr: Option<String>,
    /// TTL of the etcd lease: a worker that dies without revoking it disappears after this.
    #[arg(long, env = "CLEAVE_ETCD_LEASE_TTL", value_parser = parse_duration, default_value = "10s")]
    pub etcd_lease_ttl: Duration,
    /// Worker-group membership (tensor-parallel ranks in several processes).
    #[command(flatten)]
    pub group: crate::group::GroupArgs,
    /// Mutual TLS for the gRPC server, the channels to prefill workers and the KV transport.
    #[command(flatten)]
    pub internal_tls: crate::internal_tls::InternalTlsArgs,
}

impl WorkerConfig {
    /// Every setting at its flag's default, serving `model` on loopback with free ports: the
    /// start of a worker run in-process (tests, benchmarks, the fuzzer), which then sets what
    /// it needs with struct-update syntax. The process's `CLEAVE_*` variables are not read.
    pub fn defaults(model: impl Into<PathBuf>) -> WorkerConfig {
        use clap::FromArgMatches;
        let cmd = <WorkerConfig as Args>::augment_args(clap::Command::new("cleave-worker"))
            .no_binary_name(true)
            .mut_args(|a| a.env(None));
        let args = [
            std::ffi::OsString::from("--model"),
            model.into().into_os_string(),
        ];
        // Every other flag has a default, and the defaults are valid (tested below).
        let matches = cmd
            .try_get_matches_from(args)
            .expect("the flags' defaults parse");
        WorkerConfig::from_arg_matches(&matches).expect("the flags' defaults parse")
    }
}

#[cfg(test)]
mod defaults_tests {
    use super::*;

    #[test]
    fn defaults_are_the_flags_defaults_on_loopback() {
        let c = WorkerConfig::defaults("m.gguf");
        assert_eq!(c.model, PathBuf::from("m.gguf"));
        assert!(c.grpc_addr.ip().is_loopback() && c.grpc_addr.port() == 0);
        assert!(c.http_addr.ip().is_loopback() && c.http_addr.port() == 0);
        assert_eq!(c.kv_blocks, None);
        assert_eq!(c.kv_memory, crate::kv_pool::KvMemory::Auto);
        assert_eq!(c.prefill_timeout, Duration::from_secs(30));
        assert!(c.local_fallback);
        assert!(c.etcd.is_none());
    }
}
