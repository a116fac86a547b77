//! The algorithms, each a sequence of [`Call::exchange`] rounds.

use std::ops::Range;

use cleave_types::collective::{check_root, check_send, CollectiveError};

use crate::group::NetGroup;
use crate::wire::{Call, Op, Outgoing, Recv, Sink};
use crate::AllReduceOrder;

/// Element range of segment `i` when `n` elements are split into `parts` nearly equal parts.
fn segment(n: usize, parts: usize, i: usize) -> Range<usize> {
    (i * n / parts)..((i + 1) * n / parts)
}

/// A shared view of `a` and a mutable view of `b` in one buffer (`a` and `b` disjoint).
fn split<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    if a.start >= b.end {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    } else {
        debug_assert!(a.end <= b.start, "segments overlap");
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    }
}

/// Disjoint mutable pieces `buf[r]` for consecutive ranges covering `buf` in order.
fn pieces<T>(mut buf: &mut [T], lens: impl Iterator<Item = usize>) -> Vec<&mut [T]> {
    let mut out = Vec::new();
    for len in lens {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(len);
        out.push(head);
        buf = tail;
    }
    out
}

/// `out = ((parts[0] + parts[1]) + parts[2]) + ...` element-wise, where `parts` holds
/// `out.len()` values per rank in rank order. Every all-reduce path of
/// [`AllReduceOrder::RankOrder`] (and the engine's `LocalGroup`) adds in exactly this order.
fn sum_in_rank_order(parts: &[f32], out: &mut [f32]) {
    let n = out.len();
    out.copy_from_slice(&parts[..n]);
    for part in parts[n..].chunks_exact(n.max(1)) {
        for (o, x) in out.iter_mut().zip(part) {
            *o += x;
        }
    }
}

fn bytes(v: &[f32]) -> &[u8] {
    bytemuck::cast_slice(v)
}

fn bytes_mut(v: &mut [f32]) -> &mut [u8] {
    bytemuck::cast_slice_mut(v)
}

impl NetGroup {
    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }
    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }
    fn peers(&self) -> impl Iterator<Item = usize> + Clone + '_ {
        (0..self.world).filter(move |&p| p != self.rank)
    }

    /// The same `data` for every peer.
    fn send_to_every_peer<'a>(&self, data: &'a [f32]) -> Vec<Outgoing<'a>> {
        self.peers()
            .map(|peer| Outgoing {
                peer,
                data: bytes(data),
            })
            .collect()
    }

    /// One message from every peer, each into its own slot (`slots[peer]`; this rank's slot is
    /// left alone).
    fn recv_from_every_peer<'a>(&self, slots: &'a mut [&mut [f32]]) -> Vec<Recv<'a>> {
        slots
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| *p != self.rank)
            .map(|(peer, slot)| Recv {
                peer,
                into: Sink::Exact(bytes_mut(slot)),
            })
            .collect()
    }

    pub(crate) fn all_reduce_impl(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return self.run(Op::AllReduce, |_| Ok(()));
        }
        if buf.len() * 4 <= self.small_bytes {
            return self.run(Op::AllReduce, |c| self.all_reduce_direct(c, buf));
        }
        match self.all_reduce {
            AllReduceOrder::RankOrder => {
                self.run(Op::AllReduce, |c| self.all_reduce_segments(c, buf))
            }
            AllReduceOrder::Ring => self.run(Op::AllReduce, |c| self.all_reduce_ring(c, buf)),
        }
    }

    /// Everyone sends its whole buffer to everyone, then sums in rank order: one round trip,
    /// the same additions in the same order on every rank.
    fn all_reduce_direct(&self, c: &Call, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let n = buf.len();
        let mut all = vec![0f32; n * self.world];
        {
            let mut parts = pieces(&mut all, std::iter::repeat_n(n, self.world));
            c.exchange(
                self.send_to_every_peer(buf),
                self.recv_from_every_peer(&mut parts),
            )?;
        }
        all[self.rank * n..(self.rank + 1) * n].copy_from_slice(buf);
        sum_in_rank_order(&all, buf);
        Ok(())
    }

    /// Reduce-scatter by direct exchange, then all-gather: rank `r` receives every other
    /// rank's piece of segment `r`, adds the pieces in rank order (the direct path's order, so
    /// an element's sum does not depend on the message size or on where the element falls),
    /// and the finished segments go to every rank. Each rank sends and receives `2(w-1)/w · n`
    /// elements, as on the ring, in two rounds instead of `2(w-1)`.
    fn all_reduce_segments(&self, c: &Call, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        let mine = segment(n, w, r);
        let len = mine.len();
        let mut parts = vec![0f32; len * w];
        {
            let mut mine_from = pieces(&mut parts, std::iter::repeat_n(len, w));
            let sends = self
                .peers()
                .map(|peer| Outgoing {
                    peer,
                    data: bytes(&buf[segment(n, w, peer)]),
                })
                .collect();
            c.exchange(sends, self.recv_from_every_peer(&mut mine_from))?;
        }
        parts[r * len..(r + 1) * len].copy_from_slice(&buf[mine.clone()]);
        sum_in_rank_order(&parts, &mut buf[mine]);
        let mut segs = pieces(buf, (0..w).map(|i| segment(n, w, i).len()));
        let own: &[f32] = std::mem::take(&mut segs[r]) as &[f32];
        c.exchange(
            self.send_to_every_peer(own),
            self.recv_from_every_peer(&mut segs),
        )
    }

    /// Ring reduce-scatter (partial sums travel around the ring, added on arrival) then ring
    /// all-gather of the finished segments ([`AllReduceOrder::Ring`]: the order of additions
    /// depends on the element's segment, so results are not batch invariant).
    fn all_reduce_ring(&self, c: &Call, buf: &mut [f32]) -> Result<(), CollectiveError> {
        for step in 0..self.world - 1 {
            self.ring_step(c, buf, step, 0, true)?;
        }
        self.ring_gather(c, buf, 1)
    }

    /// Ring all-gather over `w` segments of `buf`: this rank starts with segment
    /// `rank + offset` complete and ends with all of them.
    fn ring_gather(&self, c: &Call, buf: &mut [f32], offset: usize) -> Result<(), CollectiveError> {
        for step in 0..self.world - 1 {
            self.ring_step(c, buf, step, offset, false)?;
        }
        Ok(())
    }

    /// Step `step` of a ring pass over `w` segments of `buf`: segment `rank + offset − step`
    /// goes to the next rank while segment `rank + offset − step − 1` comes from the previous
    /// one, added to this rank's (`add`, the reduce-scatter half) or replacing it.
    fn ring_step(
        &self,
        c: &Call,
        buf: &mut [f32],
        step: usize,
        offset: usize,
        add: bool,
    ) -> Result<(), CollectiveError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        let send = segment(n, w, (r + offset + w - step) % w);
        let recv = segment(n, w, (r + offset + 2 * w - step - 1) % w);
        let (s, d) = split(buf, send, recv);
        let into = if add {
            Sink::Add(d)
        } else {
            Sink::Exact(bytes_mut(d))
        };
        c.exchange(
            vec![Outgoing {
                peer: self.next(),
                data: bytes(s),
            }],
            vec![Recv {
                peer: self.prev(),
                into,
            }],
        )
    }

    pub(crate) fn all_gather_impl(
        &self,
        local: &[f32],
        out: &mut Vec<f32>,
    ) -> Result<(), CollectiveError> {
        let (w, r, n) = (self.world, self.rank, local.len());
        self.run(Op::AllGather, |c| {
            out.clear();
            out.resize(n * w, 0.0);
            out[r * n..(r + 1) * n].copy_from_slice(local);
            if w == 1 {
                return Ok(());
            }
            if n * 4 <= self.small_bytes {
                let mut parts = pieces(out.as_mut_slice(), std::iter::repeat_n(n, w));
                return c.exchange(
                    self.send_to_every_peer(local),
                    self.recv_from_every_peer(&mut parts),
                );
            }
            // Segment `i` of `out` split in `w` parts is exactly rank `i`'s contribution.
            self.ring_gather(c, out, 0)
        })
    }

    pub(crate) fn all_to_all_impl(
        &self,
        send: &[Vec<f32>],
        recv: &mut Vec<Vec<f32>>,
    ) -> Result<(), CollectiveError> {
        self.run(Op::AllToAll, |c| {
            check_send(send, self.world)?;
            recv.resize_with(self.world, Vec::new);
            recv.truncate(self.world);
            recv[self.rank].clone_from(&send[self.rank]);
            let sends = self
                .peers()
                .map(|peer| Outgoing {
                    peer,
                    data: bytes(&send[peer]),
                })
                .collect();
            let recvs = recv
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != self.rank)
                .map(|(peer, v)| Recv {
                    peer,
                    into: Sink::F32s(v),
                })
                .collect();
            c.exchange(sends, recvs)
        })
    }

    /// Binomial tree rooted at `root`: a rank receives once from its parent, then sends to its
    /// children (all at once).
    pub(crate) fn broadcast_impl(
        &self,
        root: usize,
        buf: &mut Vec<u8>,
    ) -> Result<(), CollectiveError> {
        let w = self.world;
        self.run(Op::Broadcast, |c| {
            check_root(root, w)?;
            let v = (self.rank + w - root) % w;
            let real = |rel: usize| (rel + root) % w;
            let mut mask = 1;
            while mask < w {
                if v & mask != 0 {
                    c.exchange(
                        vec![],
                        vec![Recv {
                            peer: real(v - mask),
                            into: Sink::Bytes(buf),
                        }],
                    )?;
                    break;
                }
                mask <<= 1;
            }
            // Children: v + m for every m below the bit this rank received on (all m for root).
            let mut children = Vec::new();
            let mut m = 1;
            while m < mask.min(w) {
                if v + m < w {
                    children.push(real(v + m));
                }
                m <<= 1;
            }
            let sends = children
                .into_iter()
                .map(|peer| Outgoing {
                    peer,
                    data: buf.as_slice(),
                })
                .collect();
            c.exchange(sends, vec![])
        })
    }
}
