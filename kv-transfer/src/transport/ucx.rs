//! The UCX backend: regions are allocated by UCX (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`),
//! so a peer on the same host writes them with one-sided puts at memcpy speed while the owner
//! sleeps (shared memory); across hosts UCX picks its network transports.
//!
//! `write` = plan → puts + endpoint flush on the worker thread (`worker`) → a ping to the
//! owner's TCP listener. One-sided puts into a dead peer's shared memory "succeed", so the ping
//! is what proves the owner is alive and still has the region; it is also sent before the
//! first put to a new peer, so no endpoint is ever created towards a dead address. Endpoints are
//! cached per UCX worker address: a restarted peer has a new address and gets a new endpoint,
//! and an endpoint whose transfer or ping fails is dropped.
//!
//! Peers without UCX (no `ucx` part in their address or descriptor) are served over TCP.

mod worker;

use crate::region::RegionMem;
use crate::transport::tcp::TcpTransport;
use crate::transport::Direction;
use crate::transport::{bounded, Backend, Transport, TransportConfig};
use crate::{
    plan, Error, Region, RegionDescriptor, RegionHandle, TransferStats, UcxRegionDescriptor,
    WorkerAddress, WriteOp,
};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio_util::sync::CancellationToken;
use worker::{Command, Worker};

/// UCX transport with a TCP control path and fallback.
pub struct UcxTransport {
    tcp: TcpTransport,
    worker: Arc<Worker>,
    /// UCX peers whose endpoint has been confirmed by a ping.
    confirmed: Mutex<HashSet<Vec<u8>>>,
}

impl std::fmt::Debug for UcxTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxTransport")
            .field("tcp", &self.tcp.listen_addr())
            .finish()
    }
}

impl UcxTransport {
    /// Starts the UCX worker thread and the TCP listener (inside a tokio runtime).
    pub fn new(config: &TransportConfig) -> Result<Self, Error> {
        let worker = Arc::new(Worker::start()?);
        let tcp = TcpTransport::bind(config)?;
        Ok(UcxTransport {
            tcp,
            worker,
            confirmed: Mutex::new(HashSet::new()),
        })
    }

    fn forget(&self, peer: &[u8]) {
        self.confirmed
            .lock()
            .expect("peer set poisoned")
            .remove(peer);
        let _ = self.worker.send(Command::DropEndpoint {
            peer: peer.to_vec(),
        });
    }

    #[allow(clippy::too_many_arguments)]
    async fn rma(
        &self,
        dir: Direction,
        peer: &[u8],
        ucx: &UcxRegionDescriptor,
        remote: &RegionDescriptor,
        ops: &[WriteOp],
        local: &RegionHandle,
        cancel: CancellationToken,
    ) -> Result<TransferStats, Error> {
        let start = Instant::now();
        let runs = plan(ops, local.len(), remote.len as usize)?;
        let stats = TransferStats::planned(Backend::Ucx, ops.len(), &runs);
        if runs.is_empty() {
            return Ok(TransferStats {
                elapsed: start.elapsed(),
                ..stats
            });
        }
        let result = bounded(self.tcp.config().timeout, &cancel, async {
            let known = self
                .confirmed
                .lock()
                .expect("peer set poisoned")
                .contains(peer);
            if !known {
                self.tcp.confirm(remote).await?;
            }
            let (reply, done) = tokio::sync::oneshot::channel();
            self.worker.send(Command::Transfer {
                dir,
                peer: peer.to_vec(),
                rkey: ucx.rkey.clone(),
                remote_base: ucx.base,
                runs,
                local: local.clone(),
                reply,
            })?;
            done.await.map_err(|_| Error::Shutdown)??;
            self.tcp.confirm(remote).await?;
            self.confirmed
                .lock()
                .expect("peer set poisoned")
                .insert(peer.to_vec());
            Ok(())
        })
        .await;
        match result {
            Ok(()) => Ok(TransferStats {
                elapsed: start.elapsed(),
                ..stats
            }),
            // The operation finishes in the background; the endpoint is still good.
            Err(Error::Cancelled) => Err(Error::Cancelled),
            Err(e) => {
                self.forget(peer);
                Err(e)
            }
        }
    }
}

#[async_trait::async_trait]
impl Transport for UcxTransport {
    fn backend(&self) -> Backend {
        Backend::Ucx
    }

    fn local_address(&self) -> WorkerAddress {
        WorkerAddress {
            tcp: self.tcp.listen_addr(),
            ucx: Some(self.worker.address().to_vec()),
        }
    }

    fn allocate_region(&self, bytes: usize) -> Result<Region, Error> {
        let (reply, rx) = std::sync::mpsc::channel();
        self.worker.send(Command::Allocate { bytes, reply })?;
        let allocated = rx.recv().map_err(|_| Error::Shutdown)??;
        // SAFETY: UCX allocated at least `bytes` writable bytes at `base`; nothing else uses
        // them yet.
        unsafe { std::ptr::write_bytes(allocated.base.as_ptr(), 0, allocated.len) };
        let worker = Arc::clone(&self.worker);
        self.tcp.register(move |id, owner| {
            let descriptor = RegionDescriptor {
                owner,
                id,
                len: allocated.len as u64,
                ucx: Some(UcxRegionDescriptor {
                    base: allocated.base.as_ptr() as u64,
                    rkey: allocated.rkey,
                }),
            };
            let release = Box::new(move |ptr: std::ptr::NonNull<u8>, _len: usize| {
                let _ = worker.send(Command::Free {
                    base: ptr.as_ptr() as usize,
                });
            });
            // SAFETY: the memory stays mapped until the worker thread handles `Free`, which
            // only `release` sends (or the thread's shutdown, which the `Worker` Arc in
            // `release` prevents while the region lives).
            Ok(unsafe { RegionMem::new(allocated.base, allocated.len, descriptor, release) })
        })
    }

    async fn transfer(
        &self,
        dir: Direction,
        peer: &WorkerAddress,
        remote: &RegionDescriptor,
        ops: &[WriteOp],
        local: &RegionHandle,
        cancel: CancellationToken,
    ) -> Result<TransferStats, Error> {
        match (&peer.ucx, &remote.ucx) {
            (Some(addr), Some(ucx)) => self.rma(dir, addr, ucx, remote, ops, local, cancel).await,
            _ => {
                self.tcp
                    .transfer(dir, peer, remote, ops, local, cancel)
                    .await
            }
        }
    }
}
