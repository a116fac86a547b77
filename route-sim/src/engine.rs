//! The simulator's time model: an iteration-level continuous-batching worker.
//!
//! Each iteration of a worker runs one decode step for every sequence in its running batch and,
//! if its prefill queue is not empty, a chunk of at most `prefill_chunk_tokens` of the request at
//! the head of the queue (FIFO; with nothing decoding the whole remaining prompt goes in one
//! iteration, as nothing could join the batch before it is done). The iteration takes
//!
//! ```text
//! step(b) + chunk / prefill_tokens_per_s        (b = running sequences; step(0) = 0)
//! ```
//!
//! where `step(b)` is the time of one decode step of a batch of `b`, interpolated linearly
//! between calibration points `(batch, aggregate decode tokens/s)` (step = batch / aggregate),
//! and extended beyond the last point with the slope of the last segment (a compute-bound
//! batch). The defaults are `cleave bench engine`'s numbers on this machine (README): prefill
//! 830 tok/s; decode 176.9 tok/s at batch 1, 560.7 aggregate at batch 4, 653.0 at batch 16, so a
//! step costs 5.65 ms at batch 1, 7.13 ms at 4, 24.5 ms at 16 and +1.45 ms per sequence beyond.
//! Every sequence in the batch gets one token per iteration: its inter-token latency is the
//! iteration time, so prefill chunks show up in the ITL of the sequences decoding beside them.

use std::collections::VecDeque;

use cleave_kv_index::KvEventRecord;

use super::cache::LruCache;
use super::SimError;

/// How long simulated work takes (see the module docs).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TimeModel {
    /// Prefill throughput of one worker on uncached prompt tokens.
    pub prefill_tokens_per_s: f64,
    /// `(batch, aggregate decode tokens/s)` calibration points, batch ascending.
    pub decode_tokens_per_s: Vec<(usize, f64)>,
    /// Prefill tokens one iteration computes beside a running decode batch.
    pub prefill_chunk_tokens: u64,
}

impl Default for TimeModel {
    /// `cleave bench engine` on this machine (README, SmolLM2-135M Q4_1, 1 thread).
    fn default() -> Self {
        Self {
            prefill_tokens_per_s: 830.2,
            decode_tokens_per_s: vec![(1, 176.9), (4, 560.7), (16, 653.0)],
            prefill_chunk_tokens: 256,
        }
    }
}

impl TimeModel {
    /// Checks the model is usable.
    ///
    /// # Errors
    /// [`SimError::Config`] naming the bad field.
    pub fn validate(&self) -> Result<(), SimError> {
        if !(self.prefill_tokens_per_s.is_finite() && self.prefill_tokens_per_s > 0.0) {
            return Err(SimError::Config("prefill_tokens_per_s must be > 0"));
        }
        if self.prefill_chunk_tokens == 0 {
            return Err(SimError::Config("prefill_chunk_tokens must be > 0"));
        }
        let pts = &self.decode_tokens_per_s;
        if pts.is_empty() {
            return Err(SimError::Config("decode_tokens_per_s needs a point"));
        }
        if pts
            .iter()
            .any(|&(b, t)| b == 0 || !(t.is_finite() && t > 0.0))
            || pts.windows(2).any(|w| w[0].0 >= w[1].0)
        {
            return Err(SimError::Config(
                "decode_tokens_per_s: batches ascending and ≥ 1, rates > 0",
            ));
        }
        Ok(())
    }

    /// Seconds of one decode step for a batch of `batch` sequences (0 for an empty batch).
    pub fn decode_step_s(&self, batch: usize) -> f64 {
        if batch == 0 {
            return 0.0;
        }
        let step = |&(b, t): &(usize, f64)| (b as f64, b as f64 / t);
        let pts: Vec<(f64, f64)> = self.decode_tokens_per_s.iter().map(step).collect();
        let x = batch as f64;
        if pts.len() == 1 || x <= pts[0].0 {
            return if pts.len() == 1 {
                pts[0].1 * (x / pts[0].0).max(1.0)
            } else {
                pts[0].1
            };
        }
        let seg = pts
            .windows(2)
            .find(|w| x <= w[1].0)
            .unwrap_or(&pts[pts.len() - 2..]);
        let (x0, y0, x1, y1) = (seg[0].0, seg[0].1, seg[1].0, seg[1].1);
        y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    }
}

/// A request waiting for or in its prefill.
#[derive(Debug)]
pub(crate) struct Prefill {
    pub req: usize,
    pub arrival: f64,
    pub remaining_tokens: u64,
    /// KV events of its cache change, delivered to the index when its prefill is done.
    pub events: Vec<KvEventRecord>,
}

/// A sequence in the decode batch.
#[derive(Debug)]
pub(crate) struct Decoding {
    pub req: usize,
    pub remaining_tokens: u64,
    pub last_token: f64,
}

/// The iteration a worker is running.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Iteration {
    pub start: f64,
    pub prefill_tokens: u64,
}

/// A simulated worker.
#[derive(Debug)]
pub(crate) struct SimWorker {
    pub cache: LruCache,
    pub queue: VecDeque<Prefill>,
    pub running: Vec<Decoding>,
    pub busy_s: f64,
    pub iteration: Option<Iteration>,
}

/// What happened at the end of an iteration.
#[derive(Debug, Default)]
pub(crate) struct IterationDone {
    /// Inter-token gaps of the tokens this iteration produced.
    pub itl: Vec<f64>,
    /// Requests whose last token came out.
    pub finished: Vec<usize>,
    /// The request whose prefill completed (its first token came out), with its events.
    pub prefilled: Option<Prefill>,
}

impl SimWorker {
    pub fn new(capacity: usize) -> Self {
        Self {
            cache: LruCache::new(capacity),
            queue: VecDeque::new(),
            running: Vec::new(),
            busy_s: 0.0,
            iteration: None,
        }
    }

    /// Starts the next iteration at `now` if there is work and none is running; returns its
    /// end time.
    pub fn start(&mut self, now: f64, time: &TimeModel) -> Option<f64> {
        if self.iteration.is_some() {
            return None;
        }
        let b = self.running.len();
        let chunk = self.queue.front().map_or(0, |p| {
            if b == 0 {
                p.remaining_tokens
            } else {
                p.remaining_tokens.min(time.prefill_chunk_tokens)
            }
        });
        if b == 0 && self.queue.is_empty() {
            return None;
        }
        let dur = time.decode_step_s(b) + chunk as f64 / time.prefill_tokens_per_s;
        self.iteration = Some(Iteration {
            start: now,
            prefill_tokens: chunk,
        });
        Some(now + dur)
    }

    /// Ends the running iteration at `now`. `output_of(req)` is the request's output length.
    pub fn finish(&mut self, now: f64, output_of: impl Fn(usize) -> u64) -> IterationDone {
        let Some(it) = self.iteration.take() else {
            return IterationDone::default();
        };
        self.busy_s += now - it.start;
        let mut done = IterationDone::default();
        self.running.retain_mut(|d| {
            done.itl.push(now - d.last_token);
            d.last_token = now;
            d.remaining_tokens -= 1;
            if d.remaining_tokens == 0 {
                done.finished.push(d.req);
                false
            } else {
                true
            }
        });
        if it.prefill_tokens > 0 {
            let head = self.queue.front_mut().expect("an iteration with prefill");
            head.remaining_tokens -= it.prefill_tokens;
            if head.remaining_tokens == 0 {
                let p = self.queue.pop_front().expect("head");
                let out = output_of(p.req);
                if out > 1 {
                    self.running.push(Decoding {
                        req: p.req,
                        remaining_tokens: out - 1,
                        last_token: now,
                    });
                } else {
                    done.finished.push(p.req);
                }
                done.prefilled = Some(p);
            }
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_step_interpolates_the_calibration() {
        let t = TimeModel::default();
        assert_eq!(t.decode_step_s(0), 0.0);
        assert!((t.decode_step_s(1) - 1.0 / 176.9).abs() < 1e-12);
        assert!((t.decode_step_s(4) - 4.0 / 560.7).abs() < 1e-12);
        assert!((t.decode_step_s(16) - 16.0 / 653.0).abs() < 1e-12);
        // Between 4 and 16: linear; beyond 16: the last slope.
        let mid = (4.0 / 560.7 + 16.0 / 653.0) / 2.0;
        assert!((t.decode_step_s(10) - mid).abs() < 1e-12);
        let slope = (16.0 / 653.0 - 4.0 / 560.7) / 12.0;
        assert!((t.decode_step_s(32) - (16.0 / 653.0 + 16.0 * slope)).abs() < 1e-12);
        // Aggregate throughput grows with the batch, per-token latency too.
        for b in 1..64 {
            assert!(t.decode_step_s(b + 1) > t.decode_step_s(b));
            assert!((b + 1) as f64 / t.decode_step_s(b + 1) >= b as f64 / t.decode_step_s(b));
        }
    }

    #[test]
    fn bad_models_are_rejected() {
        let mut t = TimeModel {
            decode_tokens_per_s: vec![(4, 1.0), (4, 2.0)],
            ..TimeModel::default()
        };
        assert!(t.validate().is_err());
        t.decode_tokens_per_s = vec![];
        assert!(t.validate().is_err());
        let t = TimeModel {
            prefill_tokens_per_s: 0.0,
            ..TimeModel::default()
        };
        assert!(t.validate().is_err());
        assert!(TimeModel::default().validate().is_ok());
    }

    #[test]
    fn prefill_chunks_interleave_with_decode_fifo() {
        let t = TimeModel {
            prefill_tokens_per_s: 100.0,
            decode_tokens_per_s: vec![(1, 100.0)],
            prefill_chunk_tokens: 10,
        };
        let mut w = SimWorker::new(8);
        for (req, tokens) in [(0, 50), (1, 20)] {
            w.queue.push_back(Prefill {
                req,
                arrival: 0.0,
                remaining_tokens: tokens,
                events: vec![],
            });
        }
        // Nothing decoding: request 0's whole prompt in one iteration (0.5 s).
        let end = w.start(0.0, &t).unwrap();
        assert!((end - 0.5).abs() < 1e-12);
        assert!(w.start(0.1, &t).is_none(), "one iteration at a time");
        let d = w.finish(end, |_| 3);
        assert_eq!(d.prefilled.as_ref().map(|p| p.req), Some(0));
        assert_eq!(w.running.len(), 1);
        // Now request 1 prefills in chunks of 10 beside request 0's decode: 0.01 + 0.1 s each.
        let end2 = w.start(end, &t).unwrap();
        assert!((end2 - end - 0.11).abs() < 1e-12);
        let d = w.finish(end2, |_| 3);
        assert!(d.prefilled.is_none());
        assert_eq!(d.itl.len(), 1);
        assert!((d.itl[0] - 0.11).abs() < 1e-12);
        let end3 = w.start(end2, &t).unwrap();
        let d = w.finish(end3, |_| 3);
        // Request 0 got its third (last) token; request 1 its first.
        assert_eq!(d.finished, vec![0]);
        assert_eq!(d.prefilled.map(|p| p.req), Some(1));
        assert!((w.busy_s - end3).abs() < 1e-12);
    }
}
