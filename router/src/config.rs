//! The router's configuration (flags or `CLEAVE_*` environment variables).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use crate::place::PolicyKind;

/// Router settings.
#[derive(Clone, Debug, Args)]
pub struct RouterConfig {
    /// Where the OpenAI API listens.
    #[arg(long, env = "CLEAVE_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// The GGUF the workers serve (the router reads its tokenizer, chat template and context
    /// length; it loads no weights).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: PathBuf,
    /// The model name clients send (default: the GGUF file name without `.gguf`).
    #[arg(long, env = "CLEAVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Decode workers' gRPC endpoints (`http://host:port`, repeatable).
    #[arg(long = "decode")]
    pub decode: Vec<String>,
    /// Prefill workers' gRPC endpoints (repeatable).
    #[arg(long = "prefill")]
    pub prefill: Vec<String>,
    /// Placement policy.
    #[arg(long, env = "CLEAVE_POLICY", value_enum, default_value = "prefix-load")]
    pub policy: PolicyKind,
    /// Disaggregate only when at least this many prompt blocks (16 tokens) are uncached on the
    /// decode worker; shorter prompts are prefilled where they decode.
    #[arg(long, env = "CLEAVE_DISAGG_MIN_UNCACHED_BLOCKS", default_value_t = 4)]
    pub disagg_min_uncached_blocks: usize,
    /// A file with one accepted API key per line (enables `Authorization: Bearer` checks).
    #[arg(long, env = "CLEAVE_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Requests running at once.
    #[arg(long, env = "CLEAVE_MAX_IN_FLIGHT", default_value_t = 64)]
    pub max_in_flight: usize,
    /// Requests waiting for a slot; beyond this: 429.
    #[arg(long, env = "CLEAVE_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// Longest time a request may take, queueing included.
    #[arg(long, env = "CLEAVE_REQUEST_TIMEOUT", value_parser = parse_secs, default_value = "600")]
    pub request_timeout: Duration,
    /// etcd endpoints (comma-separated) to discover workers from (combinable with
    /// `--decode`/`--prefill`).
    #[arg(long, env = "CLEAVE_ETCD")]
    pub etcd: Option<String>,
    /// Key prefix of worker registrations in etcd.
    #[arg(long, env = "CLEAVE_ETCD_PREFIX", default_value = "/cleave/workers/")]
    pub etcd_prefix: String,
}

impl RouterConfig {
    /// The etcd endpoints, empty when etcd discovery is off.
    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.etcd
            .as_deref()
            .map(crate::discovery::etcd::split_endpoints)
            .unwrap_or_default()
    }

    /// Checks that some source of decode workers is configured.
    pub fn validate(&self) -> Result<(), String> {
        if self.decode.is_empty() && self.etcd_endpoints().is_empty() {
            return Err("at least one decode worker source is required: --decode or --etcd".into());
        }
        Ok(())
    }
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    s.trim_end_matches('s')
        .parse::<f64>()
        .ok()
        .filter(|v| *v > 0.0 && v.is_finite())
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("invalid number of seconds {s:?}"))
}
