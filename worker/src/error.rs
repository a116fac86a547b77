//! Why a worker (leader or follower rank) could not start, or stopped with an error. Each
//! variant names the step that failed; the binaries print the chain.

use std::net::SocketAddr;
use std::path::PathBuf;

use cleave_config::ConfigError;

/// A worker's start-up or run failure.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The flags (group membership) are inconsistent.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `--kv-blocks`/`--kv-memory` give no usable pool for this model.
    #[error(transparent)]
    KvPool(#[from] cleave_config::kv_pool::KvPoolError),
    /// `run` was asked to serve as a follower rank.
    #[error("rank {0} of the group is a follower (no servers): run it with follower::run")]
    FollowerRank(usize),
    /// The internal mutual-TLS files do not load.
    #[error("internal TLS: {0}")]
    InternalTls(#[from] cleave_tls::TlsError),
    /// The worker group could not be joined.
    #[error("joining worker group at {leader} as rank {rank}: {source}")]
    JoinGroup {
        /// The leader's address.
        leader: String,
        /// This rank.
        rank: usize,
        /// Why.
        #[source]
        source: cleave_collective::GroupError,
    },
    /// The model (this rank's shard) does not load.
    #[error("loading rank {rank} of {world} of {}: {source}", path.display())]
    Load {
        /// This rank.
        rank: usize,
        /// Ranks in the group.
        world: usize,
        /// The model file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: cleave_engine::load::LoadError,
    },
    /// `--ep` on a model without experts.
    #[error("--ep {ep}: {} is a dense model (no experts to split); use --tp {ep}", path.display())]
    DenseEp {
        /// The requested expert-parallel size.
        ep: usize,
        /// The model.
        path: PathBuf,
    },
    /// The KV transport listens on every interface and no address for peers was found.
    #[error(
        "the KV transport listens on {listen} (every interface) and no address for peers was \
         found ({why}): set --kv-advertise (CLEAVE_KV_ADVERTISE) to this host's IP"
    )]
    NoAdvertise {
        /// The listen address.
        listen: SocketAddr,
        /// Why the default route gave none.
        why: std::io::Error,
    },
    /// The KV transport did not start.
    #[error("starting the KV transport: {0}")]
    Transport(#[source] cleave_kv_transfer::Error),
    /// The KV region could not be allocated.
    #[error("allocating the KV region: {0}")]
    Region(#[source] cleave_kv_transfer::Error),
    /// The KV tiers cannot be set up as the flags ask.
    #[error("KV tiers: {0}")]
    Tiers(String),
    /// The KV cache does not fit its region.
    #[error("the KV cache: {0}")]
    Cache(#[from] cleave_engine::kv::memory::KvMemoryError),
    /// The ranks' KV regions could not be exchanged.
    #[error("exchanging KV regions (rank {root}): {source}")]
    Exchange {
        /// The rank whose region was being broadcast.
        root: usize,
        /// Why.
        #[source]
        source: cleave_types::collective::CollectiveError,
    },
    /// A rank's KV region descriptor does not parse (or serialize).
    #[error("rank {root}'s KV region descriptor: {source}")]
    Descriptor {
        /// The rank.
        root: usize,
        /// Why.
        #[source]
        source: serde_json::Error,
    },
    /// A listener could not be bound.
    #[error("binding the {what} address {addr}: {source}")]
    Bind {
        /// `gRPC` or `HTTP`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The gRPC server's settings (TLS, listener) or the server itself failed.
    #[error("the gRPC server: {0}")]
    Grpc(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The HTTP server (health, readiness, metrics) failed.
    #[error("the HTTP server: {0}")]
    Http(#[source] std::io::Error),
    /// Registration in etcd failed.
    #[error("registering in etcd: {0}")]
    Register(#[from] crate::register::RegisterError),
    /// The async runtime could not start.
    #[error("starting the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A start-up or server task panicked.
    #[error("a worker task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The leader's group failed while serving.
    #[error(
        "the worker group failed (a rank died or stopped answering); exiting so the group is \
         restarted"
    )]
    GroupFailed,
    /// A follower rank's group failed.
    #[error("worker group failed on rank {rank}: {source}")]
    FollowerFailed {
        /// This rank.
        rank: usize,
        /// Why.
        #[source]
        source: cleave_engine::engine::FollowerError,
    },
}
