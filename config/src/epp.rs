//! The endpoint picker's settings (`cleave-router --mode endpoint-picker`), flattened into
//! [`crate::router::RouterConfig`]; `--model`, `--served-model-name`, `--policy`,
//! `--kube-namespace` and `--kube-relist` are shared with the HTTP router.

use crate::ConfigError;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

use cleave_types::duration::parse_positive_duration;

/// The InferencePool API group (Gateway API Inference Extension).
pub const INFERENCE_POOL_GROUP: &str = "inference.networking.k8s.io";
/// Its version.
pub const INFERENCE_POOL_VERSION: &str = "v1";
/// Its kind.
pub const INFERENCE_POOL_KIND: &str = "InferencePool";
/// Its plural (the resource name).
pub const INFERENCE_POOL_PLURAL: &str = "inferencepools";

/// Endpoint picker settings.
#[derive(Clone, Debug, Args)]
pub struct EppConfig {
    /// Where the endpoint picker serves gRPC (ext_proc and grpc.health.v1).
    #[arg(long, env = "CLEAVE_EPP_LISTEN", default_value = "127.0.0.1:9002")]
    pub epp_listen: SocketAddr,
    /// The InferencePool (inference.networking.k8s.io/v1) to pick from, in --kube-namespace
    /// (in-cluster config in a pod, else KUBECONFIG).
    #[arg(long, env = "CLEAVE_EPP_POOL")]
    pub pool: Option<String>,
    /// A model server `ip:port` outside Kubernetes whose vLLM/SGLang metrics are scraped
    /// (repeatable; combinable with --pool).
    #[arg(long = "pool-endpoint")]
    pub pool_endpoints: Vec<SocketAddr>,
    /// The path of the model servers' Prometheus metrics.
    #[arg(long, env = "CLEAVE_EPP_METRICS_PATH", default_value = "/metrics")]
    pub metrics_path: String,
    /// How often the model servers' metrics are scraped (seconds).
    #[arg(long, env = "CLEAVE_EPP_SCRAPE_INTERVAL", value_parser = parse_positive_duration, default_value = "1s")]
    pub scrape_interval: Duration,
    /// KV cache capacity of one model server in blocks of 16 tokens (turns its KV cache usage
    /// ratio into blocks for the placement cost).
    #[arg(long, env = "CLEAVE_EPP_KV_CAPACITY_BLOCKS", default_value_t = 8192)]
    pub kv_capacity_blocks: u64,
    /// Shed requests (429) when every eligible endpoint has at least this many requests
    /// queued or running.
    #[arg(long, env = "CLEAVE_EPP_SHED_QUEUE_DEPTH", default_value_t = 128)]
    pub shed_queue_depth: u64,
    /// Fallback endpoints named after the picked one (Envoy tries them in order on retries).
    #[arg(long, env = "CLEAVE_EPP_FALLBACKS", default_value_t = 1)]
    pub fallbacks: usize,
    /// Largest request body the picker buffers; larger ones get a 413.
    #[arg(long, env = "CLEAVE_EPP_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
}

impl EppConfig {
    /// Checks that a pool is named.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let named = self.pool.as_deref().is_some_and(|p| !p.trim().is_empty());
        if !named && self.pool_endpoints.is_empty() {
            return Err(ConfigError::Needs {
                flag: "--mode endpoint-picker",
                needs: "--pool NAME (an InferencePool) or --pool-endpoint ip:port",
            });
        }
        if self.shed_queue_depth == 0 {
            return Err(ConfigError::BadValue {
                flag: "--shed-queue-depth",
                problem: "must be at least 1".into(),
            });
        }
        if !self.metrics_path.starts_with('/') {
            return Err(ConfigError::BadValue {
                flag: "--metrics-path",
                problem: format!("must start with '/', got {:?}", self.metrics_path).into(),
            });
        }
        Ok(())
    }
}
