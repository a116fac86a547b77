//! The UCX worker thread: owns the `ucp` context and worker and makes every UCX call, so the
//! single-threaded worker is never touched from two threads. Async code talks to it through a
//! channel plus `ucp_worker_signal` (the one call documented as safe from any thread).
//!
//! While operations are in flight the thread spins on `ucp_worker_progress`; when idle it arms
//! the worker and sleeps in `poll` on the worker's event fd, which also wakes for incoming
//! traffic (transports that emulate RMA need the owner to progress) and for new commands.

use crate::transport::Direction;
use crate::{Error, RegionHandle, Run};
use cleave_ucx_sys as sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::ptr::{null_mut, NonNull};
use std::sync::mpsc;
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};
use sys::status::of_ptr as ptr_status;
use tokio::sync::oneshot;

/// Memory the worker allocated and registered.
pub(super) struct Allocated {
    pub base: NonNull<u8>,
    pub len: usize,
    pub rkey: Vec<u8>,
}

// SAFETY: `base` is plain memory owned by the region built from it.
unsafe impl Send for Allocated {}

/// What the async side asks the thread to do.
pub(super) enum Command {
    Allocate {
        bytes: usize,
        reply: mpsc::Sender<Result<Allocated, Error>>,
    },
    Free {
        base: usize,
    },
    Transfer {
        dir: Direction,
        peer: Vec<u8>,
        rkey: Vec<u8>,
        remote_base: u64,
        runs: Vec<Run>,
        /// Keeps the local memory alive until the operation completes, even if the caller
        /// gave up on it.
        local: RegionHandle,
        reply: oneshot::Sender<Result<(), Error>>,
    },
    DropEndpoint {
        peer: Vec<u8>,
    },
    Shutdown,
}

/// The handle async code holds; dropping the last one stops the thread.
pub(super) struct Worker {
    tx: mpsc::Sender<Command>,
    raw: RawWorker,
    address: Vec<u8>,
    thread: Option<JoinHandle<()>>,
    thread_id: ThreadId,
}

#[derive(Clone, Copy)]
struct RawWorker(sys::ucp_worker_h);
// SAFETY: the pointer is only used from other threads for `ucp_worker_signal`, which UCX
// documents as callable from any thread; it stays valid until the thread exits, which happens
// only after `Worker` (the only holder of the sender) is dropped.
unsafe impl Send for RawWorker {}
// SAFETY: as above.
unsafe impl Sync for RawWorker {}

impl Worker {
    /// Creates the context and worker on a new thread.
    pub fn start() -> Result<Worker, Error> {
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("kv-transfer-ucx".into())
            .spawn(move || match State::new() {
                Ok((state, address)) => {
                    let raw = RawWorker(state.worker);
                    let _ = ready_tx.send(Ok((raw, address)));
                    state.run(rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            })
            .map_err(|e| Error::Ucx {
                call: "spawning the UCX thread",
                status: e.to_string(),
            })?;
        let thread_id = thread.thread().id();
        let (raw, address) = ready_rx.recv().map_err(|_| Error::Shutdown)??;
        Ok(Worker {
            tx,
            raw,
            address,
            thread: Some(thread),
            thread_id,
        })
    }

    /// The packed worker address peers connect to.
    pub fn address(&self) -> &[u8] {
        &self.address
    }

    /// Hands `cmd` to the thread and wakes it.
    pub fn send(&self, cmd: Command) -> Result<(), Error> {
        self.tx.send(cmd).map_err(|_| Error::Shutdown)?;
        // SAFETY: the worker outlives `self` (see `RawWorker`); signal is thread-safe.
        unsafe { sys::ucp_worker_signal(self.raw.0) };
        Ok(())
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.send(Command::Shutdown);
        // The last handle can be dropped on the thread itself (a region released there).
        if std::thread::current().id() != self.thread_id {
            if let Some(thread) = self.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

struct Endpoint {
    ep: sys::ucp_ep_h,
    rkeys: HashMap<Vec<u8>, sys::ucp_rkey_h>,
    /// The last transfer on it started then.
    last_used: Instant,
}

/// An endpoint unused this long is closed and its remote keys destroyed. Over shared memory a
/// remote key maps the peer's whole region into this process: a peer that went away (a decode
/// worker restarted elsewhere) would otherwise stay mapped, and counted in this process's RSS,
/// for good. Far longer than any transfer may take (the transport's timeout), so no transfer
/// is in flight on an endpoint that expires; one that comes back is reconnected on use.
const ENDPOINT_IDLE: Duration = Duration::from_secs(120);
/// How often idle endpoints are looked for.
const EXPIRY_PERIOD: Duration = Duration::from_secs(10);

/// The peers whose endpoint was last used `idle` or longer before `now`.
fn idle_peers<'a>(
    last_used: impl Iterator<Item = (&'a Vec<u8>, Instant)>,
    now: Instant,
    idle: Duration,
) -> Vec<Vec<u8>> {
    last_used
        .filter(|(_, t)| now.saturating_duration_since(*t) >= idle)
        .map(|(p, _)| p.clone())
        .collect()
}

struct InFlight {
    request: *mut c_void,
    reply: Option<oneshot::Sender<Result<(), Error>>>,
    _local: Option<RegionHandle>,
}

/// Everything the thread owns.
struct State {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    efd: i32,
    endpoints: HashMap<Vec<u8>, Endpoint>,
    memory: HashMap<usize, sys::ucp_mem_h>,
    in_flight: Vec<InFlight>,
    /// When idle endpoints were last looked for.
    expired_at: Instant,
}

fn status_error(call: &'static str, status: sys::ucs_status_t) -> Error {
    Error::Ucx {
        call,
        status: sys::status::text(status),
    }
}

fn check(call: &'static str, status: sys::ucs_status_t) -> Result<(), Error> {
    if status == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(status_error(call, status))
    }
}

impl State {
    fn new() -> Result<(State, Vec<u8>), Error> {
        let (context, worker) = sys::setup::context_and_worker(
            (sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_WAKEUP) as u64,
            sys::ucs_thread_mode_t::UCS_THREAD_MODE_SINGLE,
        )
        .map_err(|e| status_error(e.call, e.status))?;
        let mut state = State {
            context,
            worker,
            efd: -1,
            endpoints: HashMap::new(),
            memory: HashMap::new(),
            in_flight: Vec::new(),
            expired_at: Instant::now(),
        };
        // On error `state` drops and cleans up.
        let (efd, address) =
            sys::setup::efd_and_address(worker).map_err(|e| status_error(e.call, e.status))?;
        state.efd = efd;
        Ok((state, address))
    }

    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            loop {
                match rx.try_recv() {
                    Ok(Command::Shutdown) | Err(mpsc::TryRecvError::Disconnected) => return,
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::TryRecvError::Empty) => break,
                }
            }
            let mut progressed = false;
            // Bounded: a worker that never goes idle must not keep this thread from its
            // commands (a Shutdown that `Drop` waits for) and from reaping timed-out transfers.
            for _ in 0..256 {
                // SAFETY: the worker is live and only used on this thread.
                if unsafe { sys::ucp_worker_progress(self.worker) } == 0 {
                    break;
                }
                progressed = true;
            }
            self.reap();
            self.expire_idle();
            if progressed || !self.in_flight.is_empty() {
                continue;
            }
            // SAFETY: as above.
            let armed = unsafe { sys::ucp_worker_arm(self.worker) };
            if armed == sys::ucs_status_t::UCS_OK {
                let mut fd = libc::pollfd {
                    fd: self.efd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd; the timeout bounds a missed wake-up to 100 ms.
                unsafe { libc::poll(&mut fd, 1, 100) };
            } else if armed != sys::ucs_status_t::UCS_ERR_BUSY {
                // The worker could not arm its event fd (a transport without wake-ups): poll
                // progress every millisecond instead of spinning.
                #[allow(clippy::disallowed_methods)]
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Allocate { bytes, reply } => {
                let _ = reply.send(self.allocate(bytes));
            }
            Command::Free { base } => {
                if let Some(memh) = self.memory.remove(&base) {
                    // SAFETY: memh came from ucp_mem_map on this context; nothing uses the
                    // memory any more (the last region handle released it).
                    unsafe { sys::ucp_mem_unmap(self.context, memh) };
                }
            }
            Command::Transfer {
                dir,
                peer,
                rkey,
                remote_base,
                runs,
                local,
                reply,
            } => match self.transfer(dir, &peer, &rkey, remote_base, &runs, &local) {
                Ok(None) => {
                    let _ = reply.send(Ok(()));
                }
                Ok(Some(request)) => self.in_flight.push(InFlight {
                    request,
                    reply: Some(reply),
                    _local: Some(local),
                }),
                Err(e) => {
                    self.drop_endpoint(&peer);
                    let _ = reply.send(Err(e));
                }
            },
            Command::DropEndpoint { peer } => self.drop_endpoint(&peer),
            Command::Shutdown => {}
        }
    }

    fn allocate(&mut self, bytes: usize) -> Result<Allocated, Error> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: null_mut(),
            length: bytes.max(1),
            flags: sys::UCP_MEM_MAP_ALLOCATE as _,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = null_mut();
        // SAFETY: context is live; memh is an out-pointer.
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(self.context, &params, &mut memh)
        })?;
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        let mut rkey_buf: *mut c_void = null_mut();
        let mut rkey_len = 0usize;
        // SAFETY: memh is live; out-pointers to locals.
        let packed = check("ucp_mem_query", unsafe {
            sys::ucp_mem_query(memh, &mut attr)
        })
        .and_then(|()| {
            // SAFETY: as above.
            check("ucp_rkey_pack", unsafe {
                sys::ucp_rkey_pack(self.context, memh, &mut rkey_buf, &mut rkey_len)
            })
        });
        let base = NonNull::new(attr.address as *mut u8);
        let (Ok(()), Some(base)) = (packed, base) else {
            // SAFETY: memh came from ucp_mem_map above and is not used elsewhere.
            unsafe { sys::ucp_mem_unmap(self.context, memh) };
            return Err(Error::Allocate {
                bytes,
                reason: "UCX memory registration failed".into(),
            });
        };
        // SAFETY: UCX returned `rkey_len` readable bytes, released right after copying.
        let rkey = unsafe { std::slice::from_raw_parts(rkey_buf as *const u8, rkey_len).to_vec() };
        // SAFETY: the buffer came from ucp_rkey_pack.
        unsafe { sys::ucp_rkey_buffer_release(rkey_buf) };
        self.memory.insert(base.as_ptr() as usize, memh);
        Ok(Allocated {
            base,
            len: attr.length.min(bytes),
            rkey,
        })
    }

    /// Issues the puts (or gets) and a flush; returns the flush request when it did not
    /// complete at once.
    fn transfer(
        &mut self,
        dir: Direction,
        peer: &[u8],
        rkey_bytes: &[u8],
        remote_base: u64,
        runs: &[Run],
        local: &RegionHandle,
    ) -> Result<Option<*mut c_void>, Error> {
        let worker = self.worker;
        let local_base = local.mem().ptr();
        let memh = self.memory.get(&(local_base as usize)).copied();
        let endpoint = match self.endpoints.entry(peer.to_vec()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let params = sys::ucp_ep_params_t {
                    field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                        | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)
                        as u64,
                    address: peer.as_ptr() as *const sys::ucp_address_t,
                    // PEER mode would silently exclude shared memory: keep NONE.
                    err_mode: sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_NONE,
                    ..Default::default()
                };
                let mut ep: sys::ucp_ep_h = null_mut();
                // SAFETY: the address bytes outlive the call; ep is an out-pointer.
                check("ucp_ep_create", unsafe {
                    sys::ucp_ep_create(worker, &params, &mut ep)
                })?;
                v.insert(Endpoint {
                    ep,
                    rkeys: HashMap::new(),
                    last_used: Instant::now(),
                })
            }
        };
        endpoint.last_used = Instant::now();
        let ep = endpoint.ep;
        let rkey = match endpoint.rkeys.get(rkey_bytes) {
            Some(rkey) => *rkey,
            None => {
                let mut rkey: sys::ucp_rkey_h = null_mut();
                // SAFETY: ep is live; the packed key bytes outlive the call.
                check("ucp_ep_rkey_unpack", unsafe {
                    sys::ucp_ep_rkey_unpack(ep, rkey_bytes.as_ptr() as *const c_void, &mut rkey)
                })?;
                endpoint.rkeys.insert(rkey_bytes.to_vec(), rkey);
                rkey
            }
        };
        let mut param = sys::ucp_request_param_t::default();
        if let Some(memh) = memh {
            param.op_attr_mask = sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = memh;
        }
        for run in runs {
            // SAFETY: `plan` checked the run against the local region, which the command's
            // handle keeps alive until the flush completes; the engine leaves these blocks
            // alone meanwhile (region module docs). The remote range was checked against
            // the descriptor and the rkey enforces the owner's registration.
            let request = unsafe {
                let buf = local_base.add(run.local_offset) as *mut c_void;
                let remote = remote_base + run.remote_offset as u64;
                match dir {
                    Direction::Write => sys::ucp_put_nbx(ep, buf, run.len, remote, rkey, &param),
                    Direction::Read => sys::ucp_get_nbx(ep, buf, run.len, remote, rkey, &param),
                }
            };
            match ptr_status(request) {
                Some(status) => return Err(status_error("ucp_put_nbx", status)),
                // SAFETY: a live request without callback; freed requests complete on their own.
                None if !request.is_null() => unsafe { sys::ucp_request_free(request) },
                None => {}
            }
        }
        let flush_param = sys::ucp_request_param_t::default();
        // SAFETY: ep is live; the flush completes every put issued above.
        let request = unsafe { sys::ucp_ep_flush_nbx(ep, &flush_param) };
        match ptr_status(request) {
            Some(status) => Err(status_error("ucp_ep_flush_nbx", status)),
            None if request.is_null() => Ok(None),
            None => Ok(Some(request)),
        }
    }

    /// Completes finished in-flight requests.
    fn reap(&mut self) {
        self.in_flight.retain_mut(|op| {
            // SAFETY: the request is live until freed below.
            let status = unsafe { sys::ucp_request_check_status(op.request) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                return true;
            }
            // SAFETY: completed request, freed once.
            unsafe { sys::ucp_request_free(op.request) };
            if let Some(reply) = op.reply.take() {
                let _ = reply.send(check("ucp_ep_flush_nbx", status));
            }
            false
        });
    }

    /// Closes the endpoints unused for [`ENDPOINT_IDLE`] (checked every [`EXPIRY_PERIOD`]).
    fn expire_idle(&mut self) {
        let now = Instant::now();
        if now.saturating_duration_since(self.expired_at) < EXPIRY_PERIOD {
            return;
        }
        self.expired_at = now;
        let idle = idle_peers(
            self.endpoints.iter().map(|(p, e)| (p, e.last_used)),
            now,
            ENDPOINT_IDLE,
        );
        for peer in idle {
            tracing::debug!(peer_bytes = peer.len(), "closing an idle UCX endpoint");
            self.drop_endpoint(&peer);
        }
    }

    fn drop_endpoint(&mut self, peer: &[u8]) {
        let Some(endpoint) = self.endpoints.remove(peer) else {
            return;
        };
        for rkey in endpoint.rkeys.into_values() {
            // SAFETY: unpacked on this endpoint, destroyed once, before the endpoint closes.
            unsafe { sys::ucp_rkey_destroy(rkey) };
        }
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: the endpoint is live and removed from the map, so closed once.
        let request = unsafe { sys::ucp_ep_close_nbx(endpoint.ep, &param) };
        if ptr_status(request).is_none() && !request.is_null() {
            self.in_flight.push(InFlight {
                request,
                reply: None,
                _local: None,
            });
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        let peers: Vec<_> = self.endpoints.keys().cloned().collect();
        for peer in peers {
            self.drop_endpoint(&peer);
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
        while !self.in_flight.is_empty() && std::time::Instant::now() < deadline {
            // SAFETY: the worker is live and used only on this thread.
            unsafe { sys::ucp_worker_progress(self.worker) };
            self.reap();
        }
        for op in self.in_flight.drain(..) {
            // SAFETY: freeing an unfinished request lets UCX release it when it completes.
            unsafe { sys::ucp_request_free(op.request) };
        }
        for memh in self.memory.drain().map(|(_, m)| m) {
            // SAFETY: mapped on this context; regions still alive would be a bug in the owner
            // (they hold the `Worker`, so the thread cannot stop before them).
            unsafe { sys::ucp_mem_unmap(self.context, memh) };
        }
        // SAFETY: all endpoints closed; worker and context destroyed once, in order.
        unsafe {
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_endpoints_idle_past_the_limit_expire() {
        let now = Instant::now() + Duration::from_secs(1000);
        let (old, fresh) = (vec![1u8], vec![2u8]);
        let used = [
            (&old, now - Duration::from_secs(121)),
            (&fresh, now - Duration::from_secs(5)),
        ];
        assert_eq!(idle_peers(used.into_iter(), now, ENDPOINT_IDLE), vec![old]);
    }
}
