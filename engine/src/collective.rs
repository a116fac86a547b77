//! Cross-rank communication used inside the forward pass.
//!
//! A tensor-parallel group runs the same step on every rank and combines partial results through
//! this trait. Today only [`SingleRank`] exists (everything is local); a multi-rank
//! implementation over the KV transports comes with worker groups.

/// The collectives the forward pass needs. All ranks call them in the same order.
pub trait Collective: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn world(&self) -> usize;
    /// Element-wise sum of `buf` across ranks; every rank ends with the total.
    fn all_reduce_sum(&self, buf: &mut [f32]);
    /// Concatenation of every rank's `local` in rank order, written to `out`.
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>);
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
    fn all_reduce_sum(&self, _buf: &mut [f32]) {}
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) {
        out.clear();
        out.extend_from_slice(local);
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
    fn all_reduce_sum(&self, buf: &mut [f32]) {
        self.publish(buf);
        buf.fill(0.0);
        for slot in &self.shared.slots {
            let other = slot.lock().expect("slot lock");
            for (b, o) in buf.iter_mut().zip(other.iter()) {
                *b += o;
            }
        }
        self.shared.barrier.wait();
    }
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) {
        self.publish(local);
        out.clear();
        for slot in &self.shared.slots {
            out.extend_from_slice(&slot.lock().expect("slot lock"));
        }
        self.shared.barrier.wait();
    }
}
