//! `cleave-router`'s configuration (flags or `CLEAVE_*` environment variables), with the closed
//! sets its flags pick from. Behaviour behind them (placement policies, TLS, KV events) lives in
//! `cleave-router`, which re-exports these types.

use crate::ConfigError;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use cleave_types::duration::{parse_duration, parse_positive_duration};

/// Router settings.
#[derive(Clone, Debug, Args)]
pub struct RouterConfig {
    /// What the router serves: the OpenAI API (`http`), or the Gateway API Inference
    /// Extension's endpoint picker over Envoy ext_proc (`endpoint-picker`, docs/endpoint-picker.md).
    #[arg(long, env = "CLEAVE_MODE", value_enum, default_value = "http")]
    pub mode: Mode,
    /// Where the OpenAI API listens.
    #[arg(long, env = "CLEAVE_LISTEN", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// The model the workers serve, a GGUF file or a Hugging Face directory (the router reads
    /// its tokenizer, chat template and context length; it loads no weights).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: PathBuf,
    /// The model name clients send (default: the GGUF file name without `.gguf`, or
    /// the Hugging Face directory's name).
    #[arg(long, env = "CLEAVE_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// The chat template to serve `/v1/chat/completions` with, instead of the model's own (for a
    /// model that ships without one, or to replace it): a built-in name (`chatml`, `llama3`,
    /// `gemma`), a Jinja file, or the template text itself (when it contains `{{` or `{%`).
    #[arg(long, env = "CLEAVE_CHAT_TEMPLATE")]
    pub chat_template: Option<String>,
    /// Decode workers' gRPC endpoints (`http://host:port`, repeatable).
    #[arg(long = "decode")]
    pub decode: Vec<String>,
    /// Prefill workers' gRPC endpoints (repeatable).
    #[arg(long = "prefill")]
    pub prefill: Vec<String>,
    /// Placement policy.
    #[arg(
        long,
        env = "CLEAVE_POLICY",
        value_enum,
        default_value = "prefix-optimistic"
    )]
    pub policy: PolicyKind,
    /// Placement weights and the disaggregation threshold.
    #[command(flatten)]
    pub placement: crate::placement::PlacementArgs,
    /// Async runtime threads (HTTP, gRPC streams, discovery).
    #[arg(long, env = "CLEAVE_RUNTIME_THREADS", default_value_t = crate::DEFAULT_RUNTIME_THREADS,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub runtime_threads: usize,
    /// How many times one request may move to another decode worker when its worker fails
    /// mid-stream (the stream goes on from where it was; 0 turns migration off: the stream ends
    /// in an error).
    #[arg(long, env = "CLEAVE_MIGRATION_LIMIT", default_value_t = DEFAULT_MIGRATION_LIMIT)]
    pub migration_limit: usize,
    /// A file with one accepted API key per line, each optionally followed by its limits
    /// (`KEY rpm=N tpm=N concurrency=N name=LABEL`, docs/security.md); enables
    /// `Authorization: Bearer` checks. Reloaded when it changes.
    #[arg(long, env = "CLEAVE_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Per-API-key request, token and rate-limit counters (a `key` label per key: opt in only
    /// when the number of keys is bounded).
    #[arg(long, env = "CLEAVE_KEY_METRICS")]
    pub key_metrics: bool,
    /// Serve the OpenAI API over HTTPS with this PEM certificate chain (with `--tls-key`);
    /// default: plain HTTP. Reloaded when the file changes.
    #[arg(long, env = "CLEAVE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(long, env = "CLEAVE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Require client certificates issued by these PEM CA certificates (mutual TLS; needs
    /// `--tls-cert`).
    #[arg(long, env = "CLEAVE_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// How often the TLS files and the API keys file are read again for changes (a SIGHUP
    /// rereads them at once).
    #[arg(long, env = "CLEAVE_RELOAD_INTERVAL", value_parser = parse_positive_duration, default_value = "10s")]
    pub reload_interval: Duration,
    /// After SIGTERM or Ctrl-C, keep serving for this long before stopping: new connections are
    /// still accepted, every response carries `Connection: close` (clients move off their
    /// kept-alive connections) and `/ready` answers 503; then the server stops accepting and
    /// finishes what is in flight. The operator sets it so that kube-proxy can drop a
    /// terminating router from its Service meanwhile (docs/operator.md). Default: stop at once.
    #[arg(long, env = "CLEAVE_DRAIN_PERIOD", value_parser = parse_duration, default_value = "0s")]
    pub drain_period: Duration,
    /// Requests running at once.
    #[arg(long, env = "CLEAVE_MAX_IN_FLIGHT", default_value_t = 64)]
    pub max_in_flight: usize,
    /// Requests waiting for a slot; beyond this: 429.
    #[arg(long, env = "CLEAVE_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// Longest a request waits for a slot before it is refused with 429 (the admission SLO: an
    /// admitted request started within this of its arrival).
    #[arg(long, env = "CLEAVE_QUEUE_TIMEOUT", value_parser = parse_positive_duration, default_value = "30s")]
    pub queue_timeout: Duration,
    /// Longest time a request may take, queueing included.
    #[arg(long, env = "CLEAVE_REQUEST_TIMEOUT", value_parser = parse_positive_duration, default_value = "600s")]
    pub request_timeout: Duration,
    /// etcd endpoints (comma-separated) to discover workers from (combinable with
    /// `--decode`/`--prefill`).
    #[arg(long, env = "CLEAVE_ETCD")]
    pub etcd: Option<String>,
    /// Key prefix of worker registrations in etcd.
    #[arg(long, env = "CLEAVE_ETCD_PREFIX", default_value = "/cleave/workers/")]
    pub etcd_prefix: String,
    /// A discovery source besides `--decode`/`--prefill`: `etcd` (implied by `--etcd`) or
    /// `kubernetes` (ready pods found by `--kube-selector`; in-cluster config in a pod, else
    /// KUBECONFIG).
    #[arg(long, env = "CLEAVE_DISCOVERY", value_enum)]
    pub discovery: Option<DiscoveryKind>,
    /// Namespace of the worker pods (default: the client's, i.e. the router pod's own).
    #[arg(long, env = "CLEAVE_KUBE_NAMESPACE")]
    pub kube_namespace: Option<String>,
    /// Label selector of the worker pods, e.g. `app.kubernetes.io/instance=NAME`.
    #[arg(long, env = "CLEAVE_KUBE_SELECTOR")]
    pub kube_selector: Option<String>,
    /// How often all worker pods are listed again besides the watch (which can miss deletions).
    #[arg(long, env = "CLEAVE_KUBE_RELIST", value_parser = parse_positive_duration, default_value = "30s")]
    pub kube_relist: Duration,
    /// Route to a pool of vLLM or SGLang pods (`--kv-events-pod`) instead of cleave workers,
    /// keeping the prefix index from their ZMQ KV events (docs/kv-events.md).
    #[arg(long, env = "CLEAVE_KV_EVENTS", value_enum)]
    pub kv_events: Option<KvEventsKind>,
    /// An engine pod (repeatable): `http://HOST:PORT[,events=tcp://HOST:PORT]
    /// [,replay=tcp://HOST:PORT][,topic=T]`; the event endpoints default to the pod's host
    /// with `--kv-events-port` / `--kv-events-replay-port`.
    #[arg(long = "kv-events-pod")]
    pub kv_events_pods: Vec<String>,
    /// The engines' KV-event PUB port.
    #[arg(long, env = "CLEAVE_KV_EVENTS_PORT", default_value_t = 5557)]
    pub kv_events_port: u16,
    /// The engines' KV-event replay (ROUTER) port, if they run one.
    #[arg(long, env = "CLEAVE_KV_EVENTS_REPLAY_PORT")]
    pub kv_events_replay_port: Option<u16>,
    /// The KV-event topic to subscribe to (default: all).
    #[arg(long, env = "CLEAVE_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,
    #[command(flatten)]
    pub epp: crate::epp::EppConfig,
    /// Mutual TLS on the gRPC channels to the workers.
    #[command(flatten)]
    pub internal_tls: crate::internal_tls::InternalTlsArgs,
}

/// What `cleave-router` serves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The OpenAI-compatible HTTP API, dispatching to cleave workers.
    #[default]
    Http,
    /// An endpoint picker for an InferencePool behind an Envoy-based Gateway.
    EndpointPicker,
}

/// Where workers are discovered besides the static lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DiscoveryKind {
    /// Worker registrations in etcd (`--etcd`).
    Etcd,
    /// Ready pods of the Kubernetes API (`--kube-selector`).
    Kubernetes,
}

/// How many times one request may move to another decode worker by default.
pub const DEFAULT_MIGRATION_LIMIT: usize = 3;

/// Placement policy (`--policy`); `cleave_router::place` builds each.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    clap::ValueEnum,
    serde::Serialize,
    serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
#[clap(rename_all = "kebab-case")]
pub enum PolicyKind {
    /// Prefix affinity weighed against load, over the KV-event index's matches.
    PrefixLoad,
    /// Healthy workers in turn.
    RoundRobin,
    /// Least loaded worker, ignoring the cache.
    LeastLoad,
    /// A uniformly random healthy worker (seeded).
    Random,
    /// SGLang router's cache-aware policy (an anchor for comparison).
    SglangCacheAware,
    /// Dynamo KV router's cost function (an anchor for comparison).
    DynamoCost,
    /// `prefix-load` over matches that include the router's in-flight placements (the default).
    #[default]
    PrefixOptimistic,
}

impl PolicyKind {
    /// Every policy, default first.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::PrefixOptimistic,
        PolicyKind::PrefixLoad,
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
        PolicyKind::Random,
        PolicyKind::SglangCacheAware,
        PolicyKind::DynamoCost,
    ];

    /// The kebab-case name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::PrefixLoad => "prefix-load",
            PolicyKind::RoundRobin => "round-robin",
            PolicyKind::LeastLoad => "least-load",
            PolicyKind::Random => "random",
            PolicyKind::SglangCacheAware => "sglang-cache-aware",
            PolicyKind::DynamoCost => "dynamo-cost",
            PolicyKind::PrefixOptimistic => "prefix-optimistic",
        }
    }

    /// Where the policy's prefix matches come from when it runs as its anchor does: `true` for
    /// `sglang-cache-aware`, whose router matches against a tree of the requests *it routed*
    /// (no KV events); `false`: the KV-event-fed `cleave_kv_index::PrefixIndex`. The simulator
    /// follows this; the live router always passes the KV-event index's matches.
    pub fn matches_routed_requests(self) -> bool {
        matches!(self, PolicyKind::SglangCacheAware)
    }

    /// Whether the policy expects its matches to include the router's placements whose KV events
    /// have not arrived yet (on top of the KV-event index; `InFlight`, which the
    /// simulator and the live router's `dispatch::Cluster` both use): `prefix-optimistic`.
    pub fn matches_in_flight(self) -> bool {
        matches!(self, PolicyKind::PrefixOptimistic)
    }
}
/// Whose KV events the router consumes (`--kv-events`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum KvEventsKind {
    /// vLLM's `--kv-events-config` ZMQ publisher.
    Vllm,
    /// SGLang's `--kv-events-config` ZMQ publisher (the same wire format).
    Sglang,
}

/// Where the endpoint's TLS identity is read from (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA certificates client certificates must chain to; `None`: no client certificates.
    pub client_ca: Option<PathBuf>,
}

/// etcd endpoints from a comma-separated list (blanks dropped).
pub fn split_endpoints(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(String::from)
        .collect()
}

impl RouterConfig {
    /// Parses `args` (flags only, no program name) as `cleave-router` would, with the
    /// `CLEAVE_*` variables of this process filling the flags not given.
    pub fn from_flags<I, T>(args: I) -> Result<RouterConfig, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::FromArgMatches;
        let cmd = <RouterConfig as Args>::augment_args(clap::Command::new("cleave-router"))
            .no_binary_name(true);
        RouterConfig::from_arg_matches(&cmd.try_get_matches_from(args)?)
    }

    /// The etcd endpoints, empty when etcd discovery is off.
    pub fn etcd_endpoints(&self) -> Vec<String> {
        self.etcd
            .as_deref()
            .map(split_endpoints)
            .unwrap_or_default()
    }

    /// Whether Kubernetes discovery is on.
    pub fn kubernetes(&self) -> bool {
        self.discovery == Some(DiscoveryKind::Kubernetes)
    }

    /// The TLS files of the OpenAI endpoint, `None` for plain HTTP; an error when only part
    /// of them is given.
    pub fn tls_files(&self) -> Result<Option<TlsFiles>, ConfigError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca.clone(),
            })),
            (Some(_), None) => Err(ConfigError::Needs {
                flag: "--tls-cert",
                needs: "--tls-key",
            }),
            (None, Some(_)) => Err(ConfigError::Needs {
                flag: "--tls-key",
                needs: "--tls-cert",
            }),
            (None, None) if self.tls_client_ca.is_some() => Err(ConfigError::Needs {
                flag: "--tls-client-ca",
                needs: "--tls-cert and --tls-key",
            }),
            (None, None) => Ok(None),
        }
    }

    /// Checks that some source of decode workers is configured, and completely.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tls_files()?;
        self.internal_tls.files()?;
        if self.kv_events.is_some() {
            if self.kv_events_pods.is_empty() {
                return Err(ConfigError::Needs {
                    flag: "--kv-events",
                    needs: "at least one --kv-events-pod",
                });
            }
            if !self.decode.is_empty() || !self.prefill.is_empty() || self.etcd.is_some() {
                return Err(ConfigError::Conflict {
                    flag: "--kv-events",
                    why: "routes to engine pods only: drop --decode, --prefill and --etcd",
                });
            }
            if self.discovery.is_some() {
                return Err(ConfigError::Conflict {
                    flag: "--kv-events",
                    why: "takes its pods from --kv-events-pod, not --discovery",
                });
            }
            // The pods' specs are parsed where they are used (`cleave_router::config::validate`).
            return Ok(());
        }
        if !self.kv_events_pods.is_empty() {
            return Err(ConfigError::Needs {
                flag: "--kv-events-pod",
                needs: "--kv-events vllm|sglang",
            });
        }
        if self.mode == Mode::EndpointPicker {
            return self.epp.validate();
        }
        if self.discovery == Some(DiscoveryKind::Etcd) && self.etcd_endpoints().is_empty() {
            return Err(ConfigError::Needs {
                flag: "--discovery etcd",
                needs: "--etcd endpoints",
            });
        }
        if self.kubernetes()
            && self
                .kube_selector
                .as_deref()
                .unwrap_or("")
                .trim()
                .is_empty()
        {
            return Err(ConfigError::Needs {
                flag: "--discovery kubernetes",
                needs: "--kube-selector (e.g. app.kubernetes.io/instance=NAME)",
            });
        }
        if self.decode.is_empty() && self.etcd_endpoints().is_empty() && !self.kubernetes() {
            return Err(ConfigError::NoDecodeWorkers);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> RouterConfig {
        RouterConfig::from_flags([&["--model", "m.gguf"], args].concat()).expect("flags parse")
    }

    #[test]
    fn discovery_sources_are_validated() {
        let k = parse(&[
            "--discovery",
            "kubernetes",
            "--kube-namespace",
            "serving",
            "--kube-selector",
            "app.kubernetes.io/instance=svc",
            "--kube-relist",
            "5",
        ]);
        assert!(k.kubernetes());
        assert_eq!(k.kube_namespace.as_deref(), Some("serving"));
        assert_eq!(k.kube_relist, Duration::from_secs(5));
        assert_eq!(k.validate(), Ok(()));
        assert_eq!(
            parse(&["--discovery", "kubernetes"]).kube_relist,
            Duration::from_secs(30)
        );
        let no_selector = parse(&["--discovery", "kubernetes", "--kube-selector", " "]).validate();
        assert!(no_selector
            .unwrap_err()
            .to_string()
            .contains("--kube-selector"));
        let no_etcd = parse(&["--discovery", "etcd"]).validate();
        assert!(no_etcd.unwrap_err().to_string().contains("--etcd"));
        assert_eq!(
            parse(&["--etcd", "http://127.0.0.1:2379"]).validate(),
            Ok(())
        );
        assert!(parse(&[])
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--discovery kubernetes"));
        assert!(RouterConfig::from_flags(["--model", "m", "--discovery", "consul"]).is_err());
    }

    #[test]
    fn tls_flags_come_in_pairs() {
        let d = ["--decode", "http://d:1"];
        assert_eq!(parse(&d).tls_files(), Ok(None));
        let tls = parse(&[&d[..], &["--tls-cert", "c.pem", "--tls-key", "k.pem"]].concat());
        let files = tls.tls_files().unwrap().expect("TLS on");
        assert_eq!(files.cert, PathBuf::from("c.pem"));
        assert_eq!(files.client_ca, None);
        assert_eq!(tls.reload_interval, Duration::from_secs(10));
        let half = parse(&[&d[..], &["--tls-cert", "c.pem"]].concat()).validate();
        assert!(half.unwrap_err().to_string().contains("--tls-key"));
        let ca_only = parse(&[&d[..], &["--tls-client-ca", "ca.pem"]].concat()).validate();
        assert!(ca_only.unwrap_err().to_string().contains("--tls-cert"));
    }

    #[test]
    fn kv_events_mode_is_validated() {
        let pool = parse(&[
            "--kv-events",
            "vllm",
            "--kv-events-pod",
            "http://10.0.0.1:8000",
            "--kv-events-replay-port",
            "5558",
        ]);
        assert_eq!(pool.validate(), Ok(()));
        assert!(parse(&["--kv-events", "sglang"])
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--kv-events-pod"));
        assert!(
            parse(&["--kv-events-pod", "http://h:1", "--decode", "http://d:1"])
                .validate()
                .unwrap_err()
                .to_string()
                .contains("--kv-events vllm")
        );
        let mixed = parse(&[
            "--kv-events",
            "vllm",
            "--kv-events-pod",
            "http://h:1",
            "--decode",
            "http://d:1",
        ]);
        assert!(mixed
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--decode"));
        assert_eq!(
            parse(&[]).kv_events,
            None,
            "cleave workers stay the default"
        );
    }
}
