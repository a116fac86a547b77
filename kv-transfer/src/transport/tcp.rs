//! The TCP backend: every transport runs a small listener (`recv`) that accepts framed write,
//! read and ping requests for its regions; the sending side (`send`) keeps a pool of idle
//! connections per peer and pipelines one frame per coalesced run.
//!
//! The UCX backend embeds this transport too: as its control path (confirming that a peer is
//! alive and still knows a region) and as the fallback for peers without UCX.

mod recv;
mod send;
mod wire;

use crate::region::{alloc_heap, RegionMem};
use crate::transport::{Backend, Direction, Transport, TransportConfig};
use crate::{
    Error, Region, RegionDescriptor, RegionHandle, RegionId, TransferStats, WorkerAddress, WriteOp,
};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::{CancellationToken, DropGuard};

/// Plain-socket transport; always available.
pub struct TcpTransport {
    shared: Arc<Shared>,
    _stop: DropGuard,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("addr", &self.shared.addr)
            .finish()
    }
}

/// State shared by the listener and the sending side.
pub(crate) struct Shared {
    addr: SocketAddr,
    config: TransportConfig,
    /// Regions peers may access, by id. Weak: the region's owners decide its lifetime.
    regions: Mutex<HashMap<RegionId, Weak<RegionMem>>>,
    next_id: AtomicU64,
    /// Idle connections per peer, ready for the next transfer.
    idle: Mutex<HashMap<SocketAddr, Vec<Conn>>>,
}

/// Longest a peer may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A byte stream to a peer: plain TCP, or mutual TLS over it ([`TransportConfig::tls`]).
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// One connection of either kind.
type Conn = Box<dyn Stream>;

impl TcpTransport {
    /// Binds the listener at `config.listen` and starts serving on the current tokio runtime.
    pub fn bind(config: &TransportConfig) -> Result<Self, Error> {
        let bind_err = |source| Error::Bind {
            addr: config.listen.to_string(),
            source,
        };
        tokio::runtime::Handle::try_current()
            .map_err(|_| bind_err(std::io::Error::other("not inside a tokio runtime")))?;
        let std_listener = std::net::TcpListener::bind(config.listen).map_err(bind_err)?;
        std_listener.set_nonblocking(true).map_err(bind_err)?;
        let bound = std_listener.local_addr().map_err(bind_err)?;
        // The address peers dial (and name in region descriptors).
        let addr = match config.advertise {
            Some(ip) => SocketAddr::new(ip, bound.port()),
            None if bound.ip().is_unspecified() => {
                return Err(bind_err(std::io::Error::other(
                    "listening on every interface, but no address for peers to dial was \
                     given (TransportConfig::advertise; the workers' --kv-advertise)",
                )))
            }
            None => bound,
        };
        let listener = tokio::net::TcpListener::from_std(std_listener).map_err(bind_err)?;
        let shared = Arc::new(Shared {
            addr,
            config: config.clone(),
            regions: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(random_base()),
            idle: Mutex::new(HashMap::new()),
        });
        let stop = CancellationToken::new();
        tokio::spawn(recv::serve(listener, Arc::clone(&shared), stop.clone()));
        tracing::debug!(%bound, %addr, "kv-transfer TCP listener up");
        Ok(TcpTransport {
            shared,
            _stop: stop.drop_guard(),
        })
    }

    /// The listener's address as peers dial it (the advertised IP, the bound port).
    pub fn listen_addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Registers memory built by `make` (given the new region's id and this listener's address)
    /// so peers can reach it over TCP, and wraps it as a [`Region`].
    pub(crate) fn register(
        &self,
        make: impl FnOnce(RegionId, SocketAddr) -> Result<RegionMem, Error>,
    ) -> Result<Region, Error> {
        let id = RegionId(self.shared.next_id.fetch_add(1, Ordering::Relaxed));
        let mem = Arc::new(make(id, self.shared.addr)?);
        let mut regions = self
            .shared
            .regions
            .lock()
            .expect("region registry poisoned");
        regions.retain(|_, weak| weak.strong_count() > 0);
        regions.insert(id, Arc::downgrade(&mem));
        Ok(Region::new(mem))
    }

    /// Asks the region's owner whether it is alive and still has the region; the UCX backend
    /// calls this after its one-sided puts complete.
    #[cfg(have_ucx)]
    pub(crate) async fn confirm(&self, remote: &RegionDescriptor) -> Result<(), Error> {
        send::ping(&self.shared, remote).await
    }

    /// The configuration this transport was built with.
    #[cfg(have_ucx)]
    pub(crate) fn config(&self) -> &TransportConfig {
        &self.shared.config
    }
}

#[async_trait::async_trait]
impl Transport for TcpTransport {
    fn backend(&self) -> Backend {
        Backend::Tcp
    }

    fn local_address(&self) -> WorkerAddress {
        WorkerAddress {
            tcp: self.shared.addr,
            ucx: None,
        }
    }

    fn allocate_region(&self, bytes: usize) -> Result<Region, Error> {
        self.register(|id, owner| {
            let (ptr, release) = alloc_heap(bytes).ok_or_else(|| Error::Allocate {
                bytes,
                reason: "out of memory".into(),
            })?;
            let descriptor = RegionDescriptor {
                owner,
                id,
                len: bytes as u64,
                ucx: None,
            };
            // SAFETY: `alloc_heap` returned `bytes` zeroed bytes that only `release` frees.
            Ok(unsafe { RegionMem::new(ptr, bytes, descriptor, release) })
        })
    }

    async fn transfer(
        &self,
        dir: Direction,
        _peer: &WorkerAddress,
        remote: &RegionDescriptor,
        ops: &[WriteOp],
        local: &RegionHandle,
        cancel: CancellationToken,
    ) -> Result<TransferStats, Error> {
        send::transfer(&self.shared, dir, remote, ops, local, &cancel).await
    }
}

/// A per-process random starting point for region ids, so a restarted owner does not reuse the
/// ids its previous incarnation handed out.
fn random_base() -> u64 {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    std::collections::hash_map::RandomState::new().hash_one((nanos, std::process::id()))
        & !0xffff_ffff
}
