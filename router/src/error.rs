//! Why the router (or its endpoint-picker mode) could not start, or stopped with an error.
//! Each variant names the step that failed; [`cleave_telemetry::error_chain`] prints the chain.

use std::net::SocketAddr;
use std::path::PathBuf;

/// A router start-up or serving failure.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// The flags are incomplete or contradictory.
    #[error(transparent)]
    Flags(#[from] cleave_config::ConfigError),
    /// The configuration does not validate (flags, `--kv-events-pod` specs).
    #[error(transparent)]
    Config(#[from] crate::config::ValidateError),
    /// The model's tokenizer and chat template do not load.
    #[error("reading {}", path.display())]
    Model {
        /// The model file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: cleave_text::TextError,
    },
    /// `--chat-template` names no template that compiles.
    #[error(transparent)]
    ChatTemplate(#[from] cleave_text::chat::ChatError),
    /// The API keys file does not load.
    #[error("--api-keys-file")]
    Keys(#[from] crate::keys::KeysError),
    /// The HTTPS certificate, key or client CA (or the internal mutual-TLS files) do not load.
    #[error("the TLS files do not load")]
    Tls(#[from] cleave_tls::TlsError),
    /// A configured worker endpoint.
    #[error("worker {0}")]
    Endpoint(#[from] crate::dispatch::BadEndpoint),
    /// etcd discovery did not start.
    #[error("etcd discovery at {endpoints}")]
    Etcd {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// Why (boxed: etcd's error is large and this is the cold path).
        #[source]
        source: Box<crate::discovery::etcd::EtcdError>,
    },
    /// Kubernetes discovery did not start.
    #[error("kubernetes discovery of pods {selector:?}")]
    Kube {
        /// The label selector.
        selector: String,
        /// Why (boxed, as for etcd).
        #[source]
        source: Box<crate::discovery::kube::KubeError>,
    },
    /// The `--kv-events` pool of engine pods did not start.
    #[error(transparent)]
    EnginePool(#[from] crate::events::PoolError),
    /// No Kubernetes client (in-cluster config or KUBECONFIG) for the endpoint picker.
    #[error("a Kubernetes client (in-cluster config or KUBECONFIG)")]
    KubeClient(#[source] kube::Error),
    /// The endpoint picker's InferencePool could not be followed.
    #[error("following InferencePool {name:?} in {namespace:?}")]
    InferencePool {
        /// The pool's name.
        name: String,
        /// Its namespace.
        namespace: String,
        /// Why.
        #[source]
        source: crate::epp::inference_pool::PoolError,
    },
    /// A listener could not be bound.
    #[error("binding the {what} address {addr}")]
    Bind {
        /// Which listener.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The HTTP(S) server failed.
    #[error("serving HTTP")]
    Serve(#[source] std::io::Error),
    /// The endpoint picker's gRPC server failed.
    #[error("the gRPC server")]
    Grpc(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The async runtime could not start.
    #[error("starting the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The server task panicked.
    #[error("the server task")]
    Task(#[from] tokio::task::JoinError),
}
