//! The [`Transport`] trait and how a process picks its backend.

pub mod tcp;
#[cfg(have_ucx)]
pub mod ucx;

use crate::{Error, Region, RegionDescriptor, RegionHandle, TransferStats, WorkerAddress, WriteOp};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::{Arc, Once};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A backend that moves bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// UCX one-sided RMA into UCX-allocated memory.
    Ucx,
    /// Framed writes over TCP, copied into the region by the owner.
    Tcp,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Ucx => "ucx",
            Backend::Tcp => "tcp",
        })
    }
}

/// Which backend [`default_transport`] builds (defined with the other flag choices in
/// `cleave-types`).
pub use cleave_types::choices::KvBackendChoice as BackendChoice;

/// Transport settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TransportConfig {
    /// Which backend to build.
    pub backend: BackendChoice,
    /// Where the TCP listener binds (port 0 picks one).
    pub listen: SocketAddr,
    /// The IP peers dial to reach this transport (it is in its address and region
    /// descriptors); `None`: the bound IP, which must then not be unspecified (`0.0.0.0`).
    pub advertise: Option<std::net::IpAddr>,
    /// Longest a `write` or `read` may take before it fails with `TimedOut`.
    pub timeout: Duration,
    /// Longest connecting to a peer may take.
    pub connect_timeout: Duration,
    /// Mutual TLS on the TCP path (the TCP backend's data, the UCX backend's control and
    /// fallback): every connection, either way, presents this identity and requires the
    /// peer's. `None`: plain TCP.
    #[serde(skip)]
    pub tls: Option<cleave_tls::Mutual>,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            backend: BackendChoice::Auto,
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(5),
            tls: None,
        }
    }
}

/// Which way a transfer moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Local region → remote region.
    Write,
    /// Remote region → local region.
    Read,
}

/// Moves KV bytes between this process's regions and its peers'. One per process.
///
/// Implementations are `Send + Sync`; calls may come from any task. `transfer` (and so
/// `write`/`read`) must be called inside a tokio runtime.
#[async_trait::async_trait]
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// The backend moving bytes for peers that support it.
    fn backend(&self) -> Backend;

    /// How peers reach this transport.
    fn local_address(&self) -> WorkerAddress;

    /// Allocates a zeroed region of `bytes` bytes that peers can write into.
    fn allocate_region(&self, bytes: usize) -> Result<Region, Error>;

    /// Copies each op's `len` bytes between `local` at `local_offset` and the peer's region
    /// at `remote_offset`, the way `dir` says. Returns once the bytes are visible at the
    /// destination. Contiguous ops are coalesced. On error or cancellation the target ranges
    /// hold undefined bytes; the call is idempotent, so it can simply be retried.
    async fn transfer(
        &self,
        dir: Direction,
        peer: &WorkerAddress,
        remote: &RegionDescriptor,
        ops: &[WriteOp],
        local: &RegionHandle,
        cancel: CancellationToken,
    ) -> Result<TransferStats, Error>;

    /// [`Transport::transfer`] from `local` into the peer's region.
    async fn write(
        &self,
        peer: &WorkerAddress,
        remote: &RegionDescriptor,
        ops: &[WriteOp],
        local: &RegionHandle,
        cancel: CancellationToken,
    ) -> Result<TransferStats, Error> {
        self.transfer(Direction::Write, peer, remote, ops, local, cancel)
            .await
    }

    /// [`Transport::transfer`] from the peer's region into `local`.
    async fn read(
        &self,
        peer: &WorkerAddress,
        remote: &RegionDescriptor,
        ops: &[WriteOp],
        local: &RegionHandle,
        cancel: CancellationToken,
    ) -> Result<TransferStats, Error> {
        self.transfer(Direction::Read, peer, remote, ops, local, cancel)
            .await
    }
}

/// Whether this build was compiled with UCX (found by pkg-config at build time).
pub fn ucx_available() -> bool {
    cfg!(have_ucx)
}

/// For tests that need UCX: see [`cleave_ucx_sys::ucx_or_skip`] (a visible skip, or a failure
/// under `CLEAVE_REQUIRE_UCX=1`).
pub use cleave_ucx_sys::ucx_or_skip;

/// Builds the process's transport: UCX when available (and chosen), else TCP with one info log
/// line. Must be called inside a tokio runtime (the TCP listener is spawned on it).
pub fn default_transport(config: &TransportConfig) -> Result<Arc<dyn Transport>, Error> {
    static FALLBACK_LOGGED: Once = Once::new();
    match config.backend {
        BackendChoice::Tcp => Ok(Arc::new(tcp::TcpTransport::bind(config)?)),
        BackendChoice::Ucx => ucx_transport(config),
        BackendChoice::Auto => match ucx_transport(config) {
            Ok(t) => Ok(t),
            Err(e) => {
                FALLBACK_LOGGED.call_once(|| {
                    tracing::info!(reason = %e, "UCX unavailable, KV transfer falls back to TCP");
                });
                Ok(Arc::new(tcp::TcpTransport::bind(config)?))
            }
        },
    }
}

#[cfg(have_ucx)]
fn ucx_transport(config: &TransportConfig) -> Result<Arc<dyn Transport>, Error> {
    Ok(Arc::new(ucx::UcxTransport::new(config)?))
}

#[cfg(not(have_ucx))]
fn ucx_transport(_config: &TransportConfig) -> Result<Arc<dyn Transport>, Error> {
    Err(Error::UcxUnavailable)
}

/// Runs `fut` under the transport's timeout and the caller's cancellation token.
pub(crate) async fn bounded<T>(
    timeout: Duration,
    cancel: &CancellationToken,
    fut: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => Err(Error::Cancelled),
        r = tokio::time::timeout(timeout, fut) => r.unwrap_or(Err(Error::TimedOut(timeout))),
    }
}
