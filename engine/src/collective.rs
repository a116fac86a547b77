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
