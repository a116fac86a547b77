//! UCX transport: the same framed exchanges as over TCP, carried by UCX tag-matched messages
//! (shared memory between processes on one host, RDMA or TCP across hosts, as UCX chooses).
//!
//! The TCP mesh stays up next to UCX as the control path: the workers' addresses are exchanged
//! over it, and while a UCX exchange waits it also watches the TCP connections, so a peer that
//! dies (its sockets close) or an `abort` (which shuts ours down) fails the call at once.
//!
//! A tag is `seq << 32 | op << 24 | source rank`. Receives probe by sequence number and source
//! only, so a peer in a different operation is reported as such instead of never matching.

use std::ffi::c_void;
use std::os::fd::AsRawFd;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use cleave_types::collective::CollectiveError;
use cleave_ucx_sys as sys;

use crate::wire::{Call, Outgoing, Recv, Sink};
use crate::GroupError;
use sys::status::of_ptr as ptr_status;
use sys::status::text as status_text;

const TAG_MATCH: u64 = 0xFFFF_FFFF_00FF_FFFF;
/// How long a call keeps going after a peer's control connection closed.
const CLOSE_GRACE: Duration = Duration::from_millis(500);
/// How long dropping a group waits for its last messages to leave.
const FLUSH_ON_DROP: Duration = Duration::from_secs(2);
/// Most worker progress passes between two looks at the clock and the control connections.
const PROGRESS_PASSES: usize = 256;

fn tag(seq: u32, op: u8, src: usize) -> u64 {
    (seq as u64) << 32 | (op as u64) << 24 | src as u64
}

fn call_error(call: &str, status: sys::ucs_status_t) -> GroupError {
    GroupError::Unsupported(format!("{call}: {}", status_text(status)))
}

fn check(call: &str, status: sys::ucs_status_t) -> Result<(), GroupError> {
    if status == sys::ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(call_error(call, status))
    }
}

/// Endpoint failures surface as failed requests (and the TCP control path); UCX only needs a
/// handler installed to report them that way instead of logging errors.
unsafe extern "C" fn on_ep_error(_arg: *mut c_void, _ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    tracing::debug!(status = %status_text(status), "UCX endpoint failed");
}

/// One rank's UCX context, worker and endpoints. Used only inside a call, which the group's
/// call lock serialises.
pub(crate) struct Ucx {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
    efd: i32,
    eps: Vec<sys::ucp_ep_h>,
    /// The endpoints were force-closed after a failed call.
    closed: std::sync::atomic::AtomicBool,
}

// SAFETY: the handles are only used under the group's call lock (one thread at a time), and the
// worker is created in serialised thread mode.
unsafe impl std::marker::Send for Ucx {}
// SAFETY: as above.
unsafe impl Sync for Ucx {}

impl crate::wire::Exchanger for Ucx {
    fn exchange(
        &self,
        call: &Call<'_>,
        sends: Vec<Outgoing<'_>>,
        recvs: Vec<Recv<'_>>,
    ) -> Result<(), CollectiveError> {
        Ucx::exchange(self, call, sends, recvs)
    }
}

impl Ucx {
    /// Creates the context and worker; returns them with the worker's packed address.
    pub(crate) fn new() -> Result<(Ucx, Vec<u8>), GroupError> {
        let (context, worker) = sys::setup::context_and_worker(
            (sys::UCP_FEATURE_TAG | sys::UCP_FEATURE_WAKEUP) as u64,
            sys::ucs_thread_mode_t::UCS_THREAD_MODE_SERIALIZED,
        )
        .map_err(|e| call_error(e.call, e.status))?;
        let mut ucx = Ucx {
            context,
            worker,
            efd: -1,
            eps: Vec::new(),
            closed: false.into(),
        };
        // On error `ucx` drops and cleans up.
        let (efd, packed) =
            sys::setup::efd_and_address(worker).map_err(|e| call_error(e.call, e.status))?;
        ucx.efd = efd;
        Ok((ucx, packed))
    }

    /// Creates an endpoint to every peer from their worker addresses (empty at this rank).
    pub(crate) fn connect(&mut self, addrs: &[Vec<u8>]) -> Result<(), GroupError> {
        for a in addrs {
            if a.is_empty() {
                self.eps.push(null_mut());
                continue;
            }
            let params = sys::ucp_ep_params_t {
                field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER) as u64,
                address: a.as_ptr() as *const sys::ucp_address_t,
                err_mode: sys::ucp_err_handling_mode_t::UCP_ERR_HANDLING_MODE_PEER,
                err_handler: sys::ucp_err_handler_t {
                    cb: Some(on_ep_error),
                    arg: null_mut(),
                },
                ..Default::default()
            };
            let mut ep: sys::ucp_ep_h = null_mut();
            // SAFETY: live worker; the address bytes are valid for the call.
            check("ucp_ep_create", unsafe {
                sys::ucp_ep_create(self.worker, &params, &mut ep)
            })?;
            self.eps.push(ep);
        }
        Ok(())
    }

    /// Progresses the worker until it is idle or [`PROGRESS_PASSES`] passes made progress;
    /// whether any did. Bounded so that the callers' loops get back to their deadlines even if
    /// the worker never goes idle.
    fn progress(&self) -> bool {
        let mut any = false;
        for _ in 0..PROGRESS_PASSES {
            // SAFETY: live worker, used by one thread at a time.
            if unsafe { sys::ucp_worker_progress(self.worker) } == 0 {
                break;
            }
            any = true;
        }
        any
    }

    /// [`Call::exchange`] over UCX.
    pub(crate) fn exchange(
        &self,
        c: &Call,
        sends: Vec<Outgoing<'_>>,
        recvs: Vec<Recv<'_>>,
    ) -> Result<(), CollectiveError> {
        // The buffers receives land in (the caller's, and `Add` scratch owned by `wants`) must
        // outlive every request that writes into them. `wants` is declared before `ops`, and
        // `ops` is dropped (cancelling and waiting out whatever is still in flight) before
        // `wants` on every path, unwinding included. Dropping the scratch first let a receive
        // still in flight after a failed call write into freed memory: heap corruption that
        // crashed the process later, and under UCX's crash handler hung it.
        let mut wants: Vec<Want> = recvs
            .into_iter()
            .map(|r| Want {
                peer: r.peer,
                into: r.into,
                scratch: Vec::new(),
                matched: false,
            })
            .collect();
        let mut ops = Pending {
            ucx: self,
            requests: Vec::new(),
        };
        let res = self.exchange_inner(c, &mut ops, &sends, &mut wants);
        drop(ops);
        res?;
        for w in wants {
            if let Sink::Add(dst) = w.into {
                for (d, b) in dst.iter_mut().zip(w.scratch.chunks_exact(4)) {
                    *d += f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
        Ok(())
    }

    fn exchange_inner(
        &self,
        c: &Call,
        ops: &mut Pending,
        sends: &[Outgoing<'_>],
        wants: &mut [Want<'_>],
    ) -> Result<(), CollectiveError> {
        let me = self.eps.iter().position(|e| e.is_null()).unwrap_or(0);
        let param = sys::ucp_request_param_t::default();
        for s in sends {
            let ep = self.eps[s.peer];
            // SAFETY: `s.data` outlives the request (`exchange` waits for it or cancels it
            // before returning).
            let req = unsafe {
                sys::ucp_tag_send_nbx(
                    ep,
                    s.data.as_ptr() as *const c_void,
                    s.data.len(),
                    tag(c.seq, c.op as u8, me),
                    &param,
                )
            };
            ops.track(req, s.peer, "send")?;
        }
        let mut closed: Option<(Instant, usize)> = None;
        loop {
            let progressed = self.progress();
            for w in wants.iter_mut().filter(|w| !w.matched) {
                let mut info = sys::ucp_tag_recv_info_t::default();
                // SAFETY: live worker; out-pointer to a local; `remove` = 1 hands us the message.
                let msg = unsafe {
                    sys::ucp_tag_probe_nb(
                        self.worker,
                        tag(c.seq, 0, w.peer),
                        TAG_MATCH,
                        1,
                        &mut info,
                    )
                };
                if msg.is_null() {
                    continue;
                }
                w.matched = true;
                let op = ((info.sender_tag >> 24) & 0xFF) as u8;
                let (ptr, len) = c.prepare(w.peer, op, info.length, &mut w.into, &mut w.scratch)?;
                // SAFETY: `ptr` points at `len` writable bytes (the caller's or `w.scratch`) that
                // outlive the request (see `exchange`).
                let req = unsafe {
                    sys::ucp_tag_msg_recv_nbx(self.worker, ptr as *mut c_void, len, msg, &param)
                };
                ops.track(req, w.peer, "receive")?;
            }
            ops.reap()?;
            let open = ops.requests.iter().any(|r| r.is_some());
            if !open && wants.iter().all(|w| w.matched) {
                break;
            }
            // Checked on every pass, not only when UCX is idle: a worker that keeps reporting
            // progress (data trickling in, an endpoint to a dead peer retrying) must not keep
            // the call going past its deadline.
            if Instant::now() >= c.deadline {
                let peer = wants
                    .iter()
                    .find(|w| !w.matched)
                    .map(|w| w.peer)
                    .or_else(|| ops.first_peer())
                    .unwrap_or(0);
                return Err(CollectiveError::Timeout(c.timeout, peer));
            }
            if !progressed {
                if let Some(peer) = self.wait(c) {
                    // A peer that finished its part and left closes its control connection
                    // while its last messages may still be on their way: give them a moment.
                    let since = *closed.get_or_insert((Instant::now(), peer));
                    if since.0.elapsed() > CLOSE_GRACE {
                        return Err(CollectiveError::PeerFailed {
                            rank: since.1,
                            why: "closed its connection".into(),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Sleeps until UCX has work, a TCP link reports something (a dead peer or our own abort),
    /// or the deadline (at most 100 ms). Returns a peer whose control connection closed.
    fn wait(&self, c: &Call) -> Option<usize> {
        let mut fds = vec![libc::pollfd {
            fd: self.efd,
            events: libc::POLLIN,
            revents: 0,
        }];
        let mut peers = vec![usize::MAX];
        for (p, l) in c.links.iter().enumerate() {
            if let Some(l) = l {
                fds.push(libc::pollfd {
                    fd: l.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                });
                peers.push(p);
            }
        }
        // SAFETY: live worker.
        let armed = unsafe { sys::ucp_worker_arm(self.worker) };
        let wait = if armed == sys::ucs_status_t::UCS_OK {
            c.deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_millis(100))
                .as_millis()
                .max(1) as i32
        } else {
            0
        };
        // SAFETY: a valid array of pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        for (f, &p) in fds.iter().zip(&peers).skip(1) {
            if f.revents != 0 {
                // Nothing is sent over TCP during a UCX call: readable means closed.
                return Some(p);
            }
        }
        None
    }
}

/// A message this rank expects in an exchange, and where it goes.
struct Want<'b> {
    peer: usize,
    into: Sink<'b>,
    /// `Add`: the bytes, added once everything arrived. Written by UCX while the receive is in
    /// flight, so it must outlive the request.
    scratch: Vec<u8>,
    matched: bool,
}

/// Requests in flight. Dropping it cancels what is left and waits until UCX is done with it,
/// so it must be dropped before the buffers the requests point at.
struct Pending<'u> {
    ucx: &'u Ucx,
    requests: Vec<Option<(*mut c_void, usize, &'static str)>>,
}

impl Pending<'_> {
    fn track(
        &mut self,
        req: *mut c_void,
        peer: usize,
        what: &'static str,
    ) -> Result<Option<usize>, CollectiveError> {
        if let Some(status) = ptr_status(req) {
            return Err(CollectiveError::PeerFailed {
                rank: peer,
                why: format!("UCX {what}: {}", status_text(status)),
            });
        }
        if req.is_null() {
            return Ok(None);
        }
        self.requests.push(Some((req, peer, what)));
        Ok(Some(self.requests.len() - 1))
    }

    fn first_peer(&self) -> Option<usize> {
        self.requests.iter().flatten().map(|r| r.1).next()
    }

    fn reap(&mut self) -> Result<(), CollectiveError> {
        for slot in self.requests.iter_mut() {
            let Some((req, peer, what)) = *slot else {
                continue;
            };
            // SAFETY: a live request of this worker.
            let status = unsafe { sys::ucp_request_check_status(req) };
            if status == sys::ucs_status_t::UCS_INPROGRESS {
                continue;
            }
            // SAFETY: completed; freed once.
            unsafe { sys::ucp_request_free(req) };
            *slot = None;
            if status != sys::ucs_status_t::UCS_OK {
                return Err(CollectiveError::PeerFailed {
                    rank: peer,
                    why: format!("UCX {what}: {}", status_text(status)),
                });
            }
        }
        Ok(())
    }

    /// Cancels what is still in flight and waits for it, closing the endpoints if cancelling
    /// is not enough: no request may outlive the buffers it points at.
    fn cancel(&mut self) {
        for (req, ..) in self.requests.iter().flatten() {
            // SAFETY: a live request of this worker.
            unsafe { sys::ucp_request_cancel(self.ucx.worker, *req) };
        }
        let mut closed = false;
        let start = Instant::now();
        loop {
            self.ucx.progress();
            while self.reap().is_err() {}
            if self.requests.iter().all(|r| r.is_none()) {
                return;
            }
            if !closed && start.elapsed() > Duration::from_millis(500) {
                closed = true;
                self.ucx
                    .closed
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                for ep in self.ucx.eps.iter().filter(|e| !e.is_null()) {
                    let p = sys::ucp_request_param_t {
                        op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
                        flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
                        ..Default::default()
                    };
                    // SAFETY: live endpoint; the group is unusable after this call anyway.
                    let r = unsafe { sys::ucp_ep_close_nbx(*ep, &p) };
                    if ptr_status(r).is_none() && !r.is_null() {
                        // SAFETY: releases our reference; UCX finishes the close itself.
                        unsafe { sys::ucp_request_free(r) };
                    }
                }
            }
            if start.elapsed() > Duration::from_secs(10) {
                eprintln!("cleave-collective: UCX requests still in flight after cancel; aborting the process");
                std::process::abort();
            }
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if self.requests.iter().any(Option::is_some) {
            self.cancel();
        }
    }
}

impl Drop for Ucx {
    fn drop(&mut self) {
        let closed = self.closed.load(std::sync::atomic::Ordering::Relaxed);
        // Messages handed to UCX may not have left yet: close in flush mode so they do
        // (bounded, the peers may be gone), unless the endpoints were force-closed already.
        let p = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: 0,
            ..Default::default()
        };
        let mut requests = Vec::new();
        for ep in self.eps.drain(..).filter(|e| !e.is_null() && !closed) {
            // SAFETY: live endpoint, closed once.
            let r = unsafe { sys::ucp_ep_close_nbx(ep, &p) };
            if ptr_status(r).is_none() && !r.is_null() {
                requests.push(r);
            }
        }
        let start = Instant::now();
        // SAFETY: live worker and requests; each request is freed once.
        unsafe {
            while start.elapsed() < FLUSH_ON_DROP
                && requests
                    .iter()
                    .any(|&r| sys::ucp_request_check_status(r) == sys::ucs_status_t::UCS_INPROGRESS)
            {
                sys::ucp_worker_progress(self.worker);
            }
            for r in requests {
                sys::ucp_request_free(r);
            }
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}

#[cfg(test)]
mod tests {
    //! Calls that fail while UCX is still moving their messages.

    use std::time::Duration;

    use cleave_types::collective::Collective;

    use crate::{GroupConfig, NetGroup, Pending, Transport};

    use crate::quarantine;

    /// Two UCX ranks as threads; `f` runs on each group after it formed. Panics if they are
    /// not both done within a minute.
    fn pair<T: std::marker::Send + 'static>(
        f: impl Fn(NetGroup) -> T + std::marker::Send + Copy + 'static,
    ) -> Vec<T> {
        let mut cfg = GroupConfig::new(0, 2, "127.0.0.1:0");
        cfg.bind_addr = Some("127.0.0.1:0".parse().unwrap());
        cfg.transport = Transport::Ucx;
        let pending = Pending::bind(cfg).unwrap();
        let addr = pending.local_addr().unwrap().to_string();
        let (tx, rx) = std::sync::mpsc::channel();
        let mut pending = Some(pending);
        for rank in 0..2 {
            let (tx, mine, addr) = (tx.clone(), pending.take(), addr.clone());
            std::thread::spawn(move || {
                let group = match mine {
                    Some(p) => p.join(),
                    None => {
                        let mut cfg = GroupConfig::new(rank, 2, addr);
                        cfg.bind_addr = Some("127.0.0.1:0".parse().unwrap());
                        cfg.transport = Transport::Ucx;
                        NetGroup::connect(cfg)
                    }
                };
                let _ = tx.send((rank, f(group.unwrap())));
            });
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let mut got: Vec<Option<T>> = vec![None, None];
        for _ in 0..2 {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let (rank, v) = rx.recv_timeout(left).expect("ranks hung or panicked");
            got[rank] = Some(v);
        }
        got.into_iter().map(Option::unwrap).collect()
    }

    #[test]
    fn a_call_that_times_out_mid_transfer_writes_into_no_freed_buffer() {
        let mut failed = 0;
        for _ in 0..8 {
            let got = pair(|mut g| {
                // Far too short for a 32 MiB ring all-reduce: the call fails while the 16 MiB
                // messages are still arriving.
                g.timeout = Duration::from_millis(1);
                let mut buf = vec![1.0f32; 8 << 20];
                g.all_reduce_sum(&mut buf).is_err()
            });
            failed += got.iter().filter(|&&e| e).count();
            assert_eq!(
                quarantine::writes_after_free(),
                0,
                "after {failed} failed calls"
            );
        }
        assert!(failed > 0, "no call failed: the test did not test anything");
    }
}
