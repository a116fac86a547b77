//! The leader's side of a worker group: stopping the followers, failing the engine when the
//! group breaks, heartbeats while idle.

use crate::engine::group::{encode_control, encode_relay};
use crate::engine::FinishReason;
use cleave_types::collective::CollectiveError;

use super::Worker;

impl Worker {
    pub(super) fn shutdown(mut self) {
        if let Some(g) = &self.group {
            // Followers end their loop; if one is already gone there is nothing more to do.
            encode_control(true, &mut self.msg);
            if let Err(e) = g.collective.broadcast(0, &mut self.msg) {
                tracing::warn!(error = %e, "could not stop the group's followers");
            }
        }
        self.shutdown_with(FinishReason::Cancelled)
    }

    /// A step or heartbeat failed: a rank of the group is gone, the engine stops for good.
    pub(super) fn fail(mut self, e: CollectiveError) {
        tracing::error!(error = %e, "engine step failed; the engine stops");
        self.stats.failed = true;
        self.shutdown_with(FinishReason::Aborted)
    }

    /// Idle leader: every rank must still answer.
    pub(super) fn heartbeat(&mut self) -> Result<(), CollectiveError> {
        let Some(g) = &self.group else {
            return Ok(());
        };
        encode_control(false, &mut self.msg);
        g.collective.broadcast(0, &mut self.msg)?;
        g.collective.barrier()?;
        self.last_sync = std::time::Instant::now();
        Ok(())
    }

    /// Relays `payload` to the followers; with `reply`, the sum of their statuses.
    pub(super) fn relay(&mut self, payload: &[u8], reply: bool) -> Result<f32, CollectiveError> {
        let Some(g) = &self.group else {
            return Ok(0.0);
        };
        encode_relay(payload, reply, &mut self.msg);
        g.collective.broadcast(0, &mut self.msg)?;
        self.last_sync = std::time::Instant::now();
        if !reply {
            return Ok(0.0);
        }
        let mut status = [0.0f32];
        g.collective.all_reduce_sum(&mut status)?;
        Ok(status[0])
    }
}
