//! Cross-rank communication used inside the forward pass.
//!
//! A tensor- or expert-parallel group runs the same step on every rank and combines partial
//! results through this trait. [`SingleRank`] is the group of one, [`LocalGroup`] a group of
//! threads in one process (tests); groups of processes implement it over the network.
//!
//! Every call can fail: a rank that died or stopped answering fails the collective on every
//! other rank (no hang), and the caller stops the whole group.

use std::time::Duration;

/// Why a collective did not complete. After any error the group is unusable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    /// A peer closed its connection or reported a failure.
    #[error("rank {rank} failed: {why}")]
    PeerFailed {
        /// The rank that failed.
        rank: usize,
        /// What happened.
        why: String,
    },
    /// A peer did not answer in time.
    #[error("collective timed out after {0:?} waiting for rank {1}")]
    Timeout(Duration, usize),
    /// The group was aborted (locally or by another rank).
    #[error("group aborted: {0}")]
    Aborted(String),
    /// The call's arguments do not fit the group (sizes differ across ranks, bad root...).
    #[error("bad collective call: {0}")]
    Invalid(String),
}

/// The collectives the forward pass and the worker group need. All ranks call them in the same
/// order with compatible arguments.
pub trait Collective: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Element-wise sum of `buf` across ranks; every rank ends with the same total (bitwise).
    ///
    /// Implementations add in rank order, `((x0 + x1) + x2) + ...`, for every element and
    /// whatever the buffer's length, so an element's result depends only on the ranks' values
    /// at that element, never on the rest of the buffer (what a tensor-parallel step's batch
    /// invariance rests on).
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError>;
    /// Concatenation of every rank's `local` (equal lengths) in rank order, written to `out`.
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) -> Result<(), CollectiveError>;
    /// Personalised exchange: `send[r]` goes to rank `r` (any lengths, `send.len() == world`);
    /// on return `recv[r]` holds what rank `r` sent to this rank.
    fn all_to_all_v(
        &self,
        send: &[Vec<f32>],
        recv: &mut Vec<Vec<f32>>,
    ) -> Result<(), CollectiveError>;
    /// Root's `buf` (any length) copied to every rank's `buf`.
    fn broadcast(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), CollectiveError>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CollectiveError>;
}

/// The group of one: every collective is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_reduce_sum(&self, _buf: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) -> Result<(), CollectiveError> {
        out.clear();
        out.extend_from_slice(local);
        Ok(())
    }
    fn all_to_all_v(
        &self,
        send: &[Vec<f32>],
        recv: &mut Vec<Vec<f32>>,
    ) -> Result<(), CollectiveError> {
        check_send(send, 1)?;
        recv.resize_with(1, Vec::new);
        recv[0].clone_from(&send[0]);
        Ok(())
    }
    fn broadcast(&self, root: usize, _buf: &mut Vec<u8>) -> Result<(), CollectiveError> {
        check_root(root, 1)
    }
    fn barrier(&self) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// `send` must have one buffer per rank.
pub fn check_send(send: &[Vec<f32>], world: usize) -> Result<(), CollectiveError> {
    if send.len() == world {
        Ok(())
    } else {
        Err(CollectiveError::Invalid(format!(
            "all_to_all_v needs {world} send buffers, got {}",
            send.len()
        )))
    }
}

/// `root` must be a rank of the group.
pub fn check_root(root: usize, world: usize) -> Result<(), CollectiveError> {
    if root < world {
        Ok(())
    } else {
        Err(CollectiveError::Invalid(format!(
            "broadcast root {root} is not a rank of a group of {world}"
        )))
    }
}

/// Ranks that are threads of one process: buffers meet in shared memory, with a barrier per
/// phase. Sums are taken in rank order, so every rank gets bit-identical results. Used by the
/// tensor-parallel tests; multi-process groups use the transports instead.
pub struct LocalGroup {
    rank: usize,
    shared: std::sync::Arc<LocalShared>,
}

struct LocalShared {
    world: usize,
    barrier: std::sync::Barrier,
    slots: Vec<std::sync::Mutex<Vec<f32>>>,
    /// all_to_all_v: `matrix[from][to]`.
    matrix: Vec<std::sync::Mutex<Vec<Vec<f32>>>>,
    bytes: std::sync::Mutex<Vec<u8>>,
}

impl LocalGroup {
    /// One handle per rank of a group of `world`.
    pub fn new(world: usize) -> Vec<LocalGroup> {
        let shared = std::sync::Arc::new(LocalShared {
            world,
            barrier: std::sync::Barrier::new(world),
            slots: (0..world)
                .map(|_| std::sync::Mutex::new(Vec::new()))
                .collect(),
            matrix: (0..world)
                .map(|_| std::sync::Mutex::new(Vec::new()))
                .collect(),
            bytes: std::sync::Mutex::new(Vec::new()),
        });
        (0..world)
            .map(|rank| LocalGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn publish(&self, local: &[f32]) {
        let mut slot = self.shared.slots[self.rank].lock().expect("slot lock");
        slot.clear();
        slot.extend_from_slice(local);
        drop(slot);
        self.shared.barrier.wait();
    }
}

impl Collective for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world(&self) -> usize {
        self.shared.world
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.publish(buf);
        // `((x0 + x1) + x2) + ...`, the order of the network groups' every all-reduce path, so
        // threads and processes give the same bits.
        for (r, slot) in self.shared.slots.iter().enumerate() {
            let other = slot.lock().expect("slot lock");
            if r == 0 {
                buf.copy_from_slice(&other);
                continue;
            }
            for (b, o) in buf.iter_mut().zip(other.iter()) {
                *b += o;
            }
        }
        self.shared.barrier.wait();
        Ok(())
    }
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) -> Result<(), CollectiveError> {
        self.publish(local);
        out.clear();
        for slot in &self.shared.slots {
            out.extend_from_slice(&slot.lock().expect("slot lock"));
        }
        self.shared.barrier.wait();
        Ok(())
    }
    fn all_to_all_v(
        &self,
        send: &[Vec<f32>],
        recv: &mut Vec<Vec<f32>>,
    ) -> Result<(), CollectiveError> {
        let world = self.shared.world;
        check_send(send, world)?;
        *self.shared.matrix[self.rank].lock().expect("matrix lock") = send.to_vec();
        self.shared.barrier.wait();
        recv.resize_with(world, Vec::new);
        for (from, r) in recv.iter_mut().enumerate() {
            r.clone_from(&self.shared.matrix[from].lock().expect("matrix lock")[self.rank]);
        }
        self.shared.barrier.wait();
        Ok(())
    }
    fn broadcast(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), CollectiveError> {
        check_root(root, self.shared.world)?;
        if self.rank == root {
            self.shared
                .bytes
                .lock()
                .expect("bytes lock")
                .clone_from(buf);
        }
        self.shared.barrier.wait();
        if self.rank != root {
            buf.clone_from(&self.shared.bytes.lock().expect("bytes lock"));
        }
        self.shared.barrier.wait();
        Ok(())
    }
    fn barrier(&self) -> Result<(), CollectiveError> {
        self.shared.barrier.wait();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f(rank handle)` on a thread per rank and returns the results in rank order.
    fn on_ranks<T: Send + 'static>(
        world: usize,
        f: impl Fn(LocalGroup) -> T + Send + Sync + Copy + 'static,
    ) -> Vec<T> {
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .map(|g| std::thread::spawn(move || f(g)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn local_all_to_all_v_delivers_each_pair_in_order() {
        let got = on_ranks(3, |g| {
            let me = g.rank();
            // Rank `me` sends `to + 1` copies of `10 * me + to` to rank `to`.
            let send: Vec<Vec<f32>> = (0..3)
                .map(|to| vec![(10 * me + to) as f32; to + 1])
                .collect();
            let mut recv = Vec::new();
            g.all_to_all_v(&send, &mut recv).unwrap();
            recv
        });
        for (me, recv) in got.iter().enumerate() {
            for (from, r) in recv.iter().enumerate() {
                assert_eq!(r, &vec![(10 * from + me) as f32; me + 1], "{from} -> {me}");
            }
        }
    }

    #[test]
    fn local_broadcast_copies_the_roots_bytes() {
        let got = on_ranks(4, |g| {
            let mut buf = if g.rank() == 2 {
                b"step 7".to_vec()
            } else {
                vec![1; 40]
            };
            g.broadcast(2, &mut buf).unwrap();
            g.barrier().unwrap();
            buf
        });
        assert!(got.iter().all(|b| b == b"step 7"));
    }

    #[test]
    fn bad_arguments_are_errors_not_panics() {
        let one = SingleRank;
        assert!(matches!(
            one.all_to_all_v(&[], &mut Vec::new()),
            Err(CollectiveError::Invalid(_))
        ));
        assert!(matches!(
            one.broadcast(1, &mut Vec::new()),
            Err(CollectiveError::Invalid(_))
        ));
    }
}
