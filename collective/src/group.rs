//! [`NetGroup`]: one rank's handle on a formed group, with abort-on-first-error semantics.

use std::net::{Shutdown, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cleave_types::collective::{Collective, CollectiveError};

use crate::wire::{Call, Op};
use crate::{GroupConfig, GroupError, Pending};

/// One rank of a group of processes. Calls are serialised; after the first error every call
/// returns [`CollectiveError::Aborted`].
pub struct NetGroup {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) links: Vec<Option<TcpStream>>,
    pub(crate) timeout: Duration,
    pub(crate) small_bytes: usize,
    pub(crate) all_reduce: crate::AllReduceOrder,
    /// Call sequence number; the lock also serialises calls.
    seq: Mutex<u32>,
    #[cfg(have_ucx)]
    ucx: Option<crate::ucx::Ucx>,
    aborted: Mutex<Option<String>>,
}

impl std::fmt::Debug for NetGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetGroup")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("aborted", &self.aborted_reason())
            .finish()
    }
}

impl NetGroup {
    /// Forms the group (blocking until every rank has joined or `connect_timeout` passes).
    pub fn connect(cfg: GroupConfig) -> Result<NetGroup, GroupError> {
        Pending::bind(cfg)?.join()
    }

    /// Aborts the group: every later call on this rank fails with `Aborted(why)`, a call in
    /// progress on another thread fails promptly, and this rank's connections are shut down so
    /// the other ranks' calls fail too.
    pub fn abort(&self, why: &str) {
        {
            let mut a = self.aborted.lock().unwrap_or_else(|p| p.into_inner());
            if a.is_none() {
                tracing::warn!(rank = self.rank, why, "collective group aborted");
                *a = Some(why.to_string());
            }
        }
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Why the group was aborted, if it was.
    pub fn aborted_reason(&self) -> Option<String> {
        self.aborted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs one collective: checks for an earlier abort, numbers the call, and aborts the group
    /// on any error.
    pub(crate) fn run(
        &self,
        op: Op,
        f: impl FnOnce(&Call) -> Result<(), CollectiveError>,
    ) -> Result<(), CollectiveError> {
        let mut seq = self.seq.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = self.aborted_reason() {
            return Err(CollectiveError::Aborted(why));
        }
        *seq = seq.wrapping_add(1);
        let call = Call {
            op,
            seq: *seq,
            links: &self.links,
            deadline: Instant::now() + self.timeout,
            timeout: self.timeout,
            #[cfg(have_ucx)]
            ucx: self.ucx.as_ref().map(|u| u as &dyn crate::wire::Exchanger),
        };
        let res = f(&call);
        if let Err(e) = &res {
            if let Some(why) = self.aborted_reason() {
                // Aborted from another thread while the call ran: say so, not "peer closed".
                return Err(CollectiveError::Aborted(why));
            }
            self.abort(&format!("rank {}: {e}", self.rank));
        }
        res
    }
}

impl Pending {
    /// Joins the group this rank's listener was bound for.
    pub fn join(self) -> Result<NetGroup, GroupError> {
        let (rank, world, timeout, small_bytes) = (
            self.cfg.rank,
            self.cfg.world,
            self.cfg.timeout,
            self.cfg.small_bytes,
        );
        let transport = self.cfg.transport;
        let all_reduce = self.cfg.all_reduce;
        let links = self.mesh()?;
        #[allow(unused_mut)]
        let mut group = NetGroup {
            rank,
            world,
            links,
            timeout,
            small_bytes,
            all_reduce,
            seq: Mutex::new(0),
            #[cfg(have_ucx)]
            ucx: None,
            aborted: Mutex::new(None),
        };
        if transport == crate::Transport::Ucx {
            #[cfg(have_ucx)]
            group.start_ucx()?;
        }
        // Everyone connected to everyone before anyone returns.
        group
            .barrier()
            .map_err(|e| GroupError::Protocol(format!("first barrier: {e}")))?;
        tracing::debug!(rank, world, "collective group formed");
        Ok(group)
    }
}

#[cfg(have_ucx)]
impl NetGroup {
    /// Creates this rank's UCX worker, swaps worker addresses over TCP, and connects endpoints.
    fn start_ucx(&mut self) -> Result<(), GroupError> {
        use crate::wire::{Outgoing, Recv, Sink};
        let (mut ucx, mine) = crate::ucx::Ucx::new()?;
        let mut addrs: Vec<Vec<u8>> = vec![Vec::new(); self.world];
        self.run(Op::Setup, |c| {
            let sends = (0..self.world)
                .filter(|&p| p != self.rank)
                .map(|peer| Outgoing { peer, data: &mine })
                .collect();
            let recvs = addrs
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != self.rank)
                .map(|(peer, a)| Recv {
                    peer,
                    into: Sink::Bytes(a),
                })
                .collect();
            c.exchange(sends, recvs)
        })
        .map_err(|e| GroupError::Protocol(format!("exchanging UCX addresses: {e}")))?;
        ucx.connect(&addrs)?;
        self.ucx = Some(ucx);
        Ok(())
    }
}

impl Drop for NetGroup {
    fn drop(&mut self) {
        for s in self.links.iter().flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

impl Collective for NetGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.all_reduce_impl(buf)
    }
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) -> Result<(), CollectiveError> {
        self.all_gather_impl(local, out)
    }
    fn all_to_all_v(
        &self,
        send: &[Vec<f32>],
        recv: &mut Vec<Vec<f32>>,
    ) -> Result<(), CollectiveError> {
        self.all_to_all_impl(send, recv)
    }
    fn broadcast(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), CollectiveError> {
        self.broadcast_impl(root, buf)
    }
    fn barrier(&self) -> Result<(), CollectiveError> {
        self.run(Op::Barrier, |c| {
            let peers = (0..self.world).filter(|&p| p != self.rank);
            let sends = peers
                .clone()
                .map(|peer| crate::wire::Outgoing { peer, data: &[] })
                .collect();
            let mut empties: Vec<[u8; 0]> = vec![[]; self.world];
            let recvs = peers
                .zip(empties.iter_mut())
                .map(|(peer, e)| crate::wire::Recv {
                    peer,
                    into: crate::wire::Sink::Exact(e),
                })
                .collect();
            c.exchange(sends, recvs)
        })
    }
}
