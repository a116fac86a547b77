//! Framed messages between ranks and the one primitive every algorithm is built from:
//! [`exchange`], which sends and receives a set of messages at once over non-blocking sockets
//! with `poll(2)`, so a rank never blocks on a send while its peer blocks on one too.
//!
//! Every message is a 16-byte header (operation, call sequence number, payload length) and the
//! payload. The receiver checks the header against the call it is in, so ranks that call
//! different collectives, or pass different sizes, get an `Invalid` error instead of garbage.

use std::io::{IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use cleave_types::collective::CollectiveError;

/// Header bytes before each payload.
pub(crate) const HEADER: usize = 16;
/// Largest payload a header may announce (guards allocations against a corrupt stream).
const MAX_PAYLOAD: u64 = 1 << 40;
/// Bytes read per syscall when reducing on arrival.
const ADD_SCRATCH: usize = 256 * 1024;

/// Which collective a message belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Op {
    AllReduce = 1,
    AllGather = 2,
    AllToAll = 3,
    Broadcast = 4,
    Barrier = 5,
    /// Exchanging transport addresses while the group forms.
    #[cfg_attr(not(have_ucx), allow(dead_code))]
    Setup = 6,
}

impl Op {
    fn name(code: u8) -> &'static str {
        match code {
            1 => "all_reduce_sum",
            2 => "all_gather",
            3 => "all_to_all_v",
            4 => "broadcast",
            5 => "barrier",
            6 => "group setup",
            _ => "an unknown operation",
        }
    }
}

fn header(op: Op, seq: u32, len: usize) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0] = op as u8;
    h[4..8].copy_from_slice(&seq.to_le_bytes());
    h[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    h
}

/// A message for `peer`.
pub(crate) struct Outgoing<'a> {
    pub peer: usize,
    pub data: &'a [u8],
}

/// Where a message from a peer goes.
pub(crate) enum Sink<'a> {
    /// Exactly this many bytes.
    Exact(&'a mut [u8]),
    /// Exactly `len` floats, added element-wise to the slice as they arrive.
    Add(&'a mut [f32]),
    /// Any number of floats; the vector is resized.
    F32s(&'a mut Vec<f32>),
    /// Any number of bytes; the vector is resized.
    Bytes(&'a mut Vec<u8>),
}

/// A message expected from `peer`.
pub(crate) struct Recv<'a> {
    pub peer: usize,
    pub into: Sink<'a>,
}

struct SendState<'a> {
    peer: usize,
    header: [u8; HEADER],
    data: &'a [u8],
    pos: usize,
}

impl SendState<'_> {
    fn done(&self) -> bool {
        self.pos == HEADER + self.data.len()
    }
}

struct RecvState<'a> {
    peer: usize,
    into: Sink<'a>,
    header: [u8; HEADER],
    hpos: usize,
    /// Payload length once the header is in.
    len: usize,
    /// Payload bytes consumed.
    pos: usize,
    /// `Add`: bytes read but not yet added (at most 3 carried between reads).
    scratch: Vec<u8>,
    fill: usize,
}

impl RecvState<'_> {
    fn done(&self) -> bool {
        self.hpos == HEADER && self.pos == self.len
    }
}

/// What the current call is, for checking incoming headers and naming errors.
pub(crate) struct Call<'s> {
    pub op: Op,
    pub seq: u32,
    pub links: &'s [Option<TcpStream>],
    pub deadline: Instant,
    pub timeout: Duration,
    /// Moves the call's messages instead of the TCP links (UCX tag messages).
    #[cfg(have_ucx)]
    pub ucx: Option<&'s dyn Exchanger>,
}

/// Another way to move one call's messages than the TCP links: the UCX transport implements
/// it, so this module needs to know nothing of UCX.
#[cfg(have_ucx)]
pub(crate) trait Exchanger {
    /// [`Call::exchange`]'s contract, over this transport.
    fn exchange(
        &self,
        call: &Call<'_>,
        sends: Vec<Outgoing<'_>>,
        recvs: Vec<Recv<'_>>,
    ) -> Result<(), CollectiveError>;
}

fn peer_failed(peer: usize, why: impl std::fmt::Display) -> CollectiveError {
    CollectiveError::PeerFailed {
        rank: peer,
        why: why.to_string(),
    }
}

impl Call<'_> {
    fn link(&self, peer: usize) -> Result<&TcpStream, CollectiveError> {
        self.links
            .get(peer)
            .and_then(Option::as_ref)
            .ok_or_else(|| CollectiveError::Invalid(format!("no connection to rank {peer}")))
    }

    /// Sends every message in `sends` and receives every message in `recvs`, interleaved, until
    /// all are complete, a peer fails, or the call's deadline passes. At most one send and one
    /// receive per peer.
    pub(crate) fn exchange(
        &self,
        sends: Vec<Outgoing<'_>>,
        recvs: Vec<Recv<'_>>,
    ) -> Result<(), CollectiveError> {
        #[cfg(have_ucx)]
        if let Some(u) = self.ucx {
            return u.exchange(self, sends, recvs);
        }
        let mut sends: Vec<SendState> = sends
            .into_iter()
            .map(|s| SendState {
                peer: s.peer,
                header: header(self.op, self.seq, s.data.len()),
                data: s.data,
                pos: 0,
            })
            .collect();
        let mut recvs: Vec<RecvState> = recvs
            .into_iter()
            .map(|r| RecvState {
                peer: r.peer,
                into: r.into,
                header: [0; HEADER],
                hpos: 0,
                len: 0,
                pos: 0,
                scratch: Vec::new(),
                fill: 0,
            })
            .collect();
        // Optimistic first pass: small messages usually go out (and often come in) without
        // waiting in poll.
        for s in sends.iter_mut() {
            self.write_some(s)?;
        }
        let mut fds: Vec<libc::pollfd> = Vec::new();
        let mut slots: Vec<(Option<usize>, Option<usize>)> = Vec::new();
        loop {
            fds.clear();
            slots.clear();
            for (i, s) in sends.iter().enumerate().filter(|(_, s)| !s.done()) {
                fds.push(libc::pollfd {
                    fd: self.link(s.peer)?.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                });
                slots.push((Some(i), None));
            }
            for (i, r) in recvs.iter().enumerate().filter(|(_, r)| !r.done()) {
                let fd = self.link(r.peer)?.as_raw_fd();
                match fds.iter().position(|p| p.fd == fd) {
                    Some(at) => {
                        fds[at].events |= libc::POLLIN;
                        slots[at].1 = Some(i);
                    }
                    None => {
                        fds.push(libc::pollfd {
                            fd,
                            events: libc::POLLIN,
                            revents: 0,
                        });
                        slots.push((None, Some(i)));
                    }
                }
            }
            if fds.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= self.deadline {
                let peer = recvs
                    .iter()
                    .find(|r| !r.done())
                    .map(|r| r.peer)
                    .or_else(|| sends.iter().find(|s| !s.done()).map(|s| s.peer))
                    .unwrap_or(0);
                return Err(CollectiveError::Timeout(self.timeout, peer));
            }
            let wait = (self.deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: `fds` is a valid, initialised array of `fds.len()` pollfd structs.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(CollectiveError::Aborted(format!("poll failed: {err}")));
            }
            for (p, (si, ri)) in fds.iter().zip(slots.iter()) {
                if p.revents == 0 {
                    continue;
                }
                // On HUP/ERR both directions are tried: the read or write names the failure.
                if let Some(ri) = *ri {
                    self.read_some(&mut recvs[ri])?;
                }
                if let Some(si) = *si {
                    self.write_some(&mut sends[si])?;
                }
            }
        }
    }

    fn write_some(&self, s: &mut SendState) -> Result<(), CollectiveError> {
        let mut stream = self.link(s.peer)?;
        while !s.done() {
            let res = if s.pos < HEADER {
                stream.write_vectored(&[IoSlice::new(&s.header[s.pos..]), IoSlice::new(s.data)])
            } else {
                stream.write(&s.data[s.pos - HEADER..])
            };
            match res {
                Ok(0) => return Err(peer_failed(s.peer, "connection closed while sending")),
                Ok(n) => s.pos += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(peer_failed(s.peer, format!("send failed: {e}"))),
            }
        }
        Ok(())
    }

    /// Reads what is available; `Ok` with the message incomplete means "would block".
    fn read_some(&self, r: &mut RecvState) -> Result<(), CollectiveError> {
        let mut stream = self.link(r.peer)?;
        while !r.done() {
            let res = if r.hpos < HEADER {
                stream.read(&mut r.header[r.hpos..])
            } else {
                let left = r.len - r.pos;
                match &mut r.into {
                    Sink::Exact(buf) => stream.read(&mut buf[r.pos..]),
                    Sink::Bytes(buf) => stream.read(&mut buf[r.pos..]),
                    Sink::F32s(v) => {
                        stream.read(&mut bytemuck::cast_slice_mut(v.as_mut_slice())[r.pos..])
                    }
                    Sink::Add(_) => {
                        let end = (r.fill + left).min(ADD_SCRATCH);
                        stream.read(&mut r.scratch[r.fill..end])
                    }
                }
            };
            let n = match res {
                Ok(0) => return Err(peer_failed(r.peer, "closed the connection")),
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(peer_failed(r.peer, format!("receive failed: {e}"))),
            };
            if r.hpos < HEADER {
                r.hpos += n;
                if r.hpos == HEADER {
                    self.accept_header(r)?;
                }
            } else {
                r.pos += n;
                if let Sink::Add(dst) = &mut r.into {
                    r.fill += n;
                    let whole = r.fill / 4 * 4;
                    let first = (r.pos - r.fill) / 4;
                    let got: &[u8] = &r.scratch[..whole];
                    for (d, c) in dst[first..first + whole / 4]
                        .iter_mut()
                        .zip(got.chunks_exact(4))
                    {
                        *d += f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                    }
                    r.scratch.copy_within(whole..r.fill, 0);
                    r.fill -= whole;
                }
            }
        }
        Ok(())
    }

    fn accept_header(&self, r: &mut RecvState) -> Result<(), CollectiveError> {
        let h = &r.header;
        let seq = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        let len = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        if h[0] != self.op as u8 || seq != self.seq {
            return Err(CollectiveError::Invalid(format!(
                "rank {} is in {} (call {seq}) while this rank is in {} (call {})",
                r.peer,
                Op::name(h[0]),
                Op::name(self.op as u8),
                self.seq
            )));
        }
        if len > MAX_PAYLOAD {
            return Err(peer_failed(
                r.peer,
                format!("announced a {len}-byte message"),
            ));
        }
        let len = len as usize;
        self.fit(r.peer, len, &mut r.into)?;
        if let Sink::Add(_) = r.into {
            r.scratch = vec![0; ADD_SCRATCH.min(len.max(4))];
        }
        r.len = len;
        Ok(())
    }

    /// Checks that a `len`-byte message from `peer` fits `into`, resizing growable targets.
    fn fit(&self, peer: usize, len: usize, into: &mut Sink) -> Result<(), CollectiveError> {
        let mismatch = |want: usize| {
            CollectiveError::Invalid(format!(
                "{}: rank {peer} sent {len} bytes, this rank expected {want}",
                Op::name(self.op as u8),
            ))
        };
        match into {
            Sink::Exact(buf) if buf.len() != len => return Err(mismatch(buf.len())),
            Sink::Add(dst) if dst.len() * 4 != len => return Err(mismatch(dst.len() * 4)),
            Sink::F32s(v) => {
                if !len.is_multiple_of(4) {
                    return Err(mismatch(len / 4 * 4));
                }
                v.clear();
                v.resize(len / 4, 0.0);
            }
            Sink::Bytes(v) => {
                v.clear();
                v.resize(len, 0);
            }
            Sink::Exact(_) | Sink::Add(_) => {}
        }
        Ok(())
    }

    /// For transports that deliver whole messages: checks a `len`-byte message of operation
    /// `op` from `peer` against this call and returns where its bytes go (`Add` messages land
    /// in `scratch` and are added by the caller).
    #[cfg(have_ucx)]
    pub(crate) fn prepare(
        &self,
        peer: usize,
        op: u8,
        len: usize,
        into: &mut Sink,
        scratch: &mut Vec<u8>,
    ) -> Result<(*mut u8, usize), CollectiveError> {
        if op != self.op as u8 {
            return Err(CollectiveError::Invalid(format!(
                "rank {peer} is in {} while this rank is in {} (call {})",
                Op::name(op),
                Op::name(self.op as u8),
                self.seq
            )));
        }
        self.fit(peer, len, into)?;
        Ok(match into {
            Sink::Exact(buf) => (buf.as_mut_ptr(), len),
            Sink::Add(_) => {
                scratch.clear();
                scratch.resize(len, 0);
                (scratch.as_mut_ptr(), len)
            }
            Sink::F32s(v) => (v.as_mut_ptr() as *mut u8, len),
            Sink::Bytes(v) => (v.as_mut_ptr(), len),
        })
    }
}
