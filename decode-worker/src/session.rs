//! One `Generate` call's bookkeeping, apart from gRPC and tasks: it turns the engine's events
//! into what the handler does next (ask the prefill worker for the prompt's KV, prefill here,
//! or send a wire event) and measures the time to first token as it goes.

use std::time::Instant;

use cleave_engine::engine::SeqEvent;
use cleave_engine::kv::BlockId;
use cleave_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::import_kv::Timing;

/// What the handler does with one engine event.
#[derive(Debug)]
pub(crate) enum Step {
    /// The sequence is parked: ask the prefill worker to write the prompt's KV into `blocks`
    /// (the first `cached_tokens` are cached here) and hand the timing channel's receiver to
    /// [`DecodeSession::importing`].
    Import {
        blocks: Vec<BlockId>,
        cached_tokens: usize,
    },
    /// Too little of the prompt is uncached to be worth a transfer: prefill it here
    /// (conditional disaggregation on the decode worker's side).
    PrefillHere,
    /// Send `event` to the caller (when there is one); the stream ends after it when `done`.
    Send {
        event: Option<pb::GenerateEvent>,
        token: bool,
        done: bool,
    },
}

/// One request on this decode worker.
pub(crate) struct DecodeSession {
    arrival: Instant,
    prompt_tokens: usize,
    /// `--local-prefill-below-tokens`: uncached prompts shorter than this are prefilled here.
    local_prefill_below: usize,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    disaggregated: bool,
    timing: Option<oneshot::Receiver<Timing>>,
}

impl DecodeSession {
    /// A request of `prompt_tokens` that arrived at `arrival`.
    pub(crate) fn new(arrival: Instant, prompt_tokens: usize, local_prefill_below: usize) -> Self {
        DecodeSession {
            arrival,
            prompt_tokens,
            local_prefill_below,
            admitted: None,
            first_token: None,
            disaggregated: false,
            timing: None,
        }
    }

    /// The next step for `ev`, which the engine emitted at `now`.
    pub(crate) fn on_event(&mut self, ev: SeqEvent, now: Instant) -> Step {
        if let SeqEvent::KvNeeded {
            blocks,
            cached_tokens,
        } = ev
        {
            self.admitted = Some(now);
            if self.prompt_tokens.saturating_sub(cached_tokens) < self.local_prefill_below {
                return Step::PrefillHere;
            }
            self.disaggregated = true;
            return Step::Import {
                blocks,
                cached_tokens,
            };
        }
        let token = matches!(ev, SeqEvent::Token { .. });
        let done = matches!(ev, SeqEvent::Done { .. });
        if token && self.first_token.is_none() {
            self.first_token = Some(now);
        }
        let ttft = if done { self.ttft() } else { None };
        let event = cleave_worker::convert::generate_event(ev, self.disaggregated, ttft);
        Step::Send { event, token, done }
    }

    /// The import of [`Step::Import`] started; it reports its timing on `timing`.
    pub(crate) fn importing(&mut self, timing: oneshot::Receiver<Timing>) {
        self.timing = Some(timing);
    }

    /// Where the time to first token went, for a disaggregated request whose import reported
    /// its timing and that produced a token.
    fn ttft(&mut self) -> Option<pb::TtftBreakdown> {
        let t = self.timing.as_mut()?.try_recv().ok()?;
        let (admitted, first) = (self.admitted?, self.first_token?);
        Some(pb::TtftBreakdown {
            queue_seconds: (admitted - self.arrival).as_secs_f64(),
            prefill_seconds: t.compute_seconds,
            transfer_seconds: t.transfer_seconds,
            first_decode_seconds: first.saturating_duration_since(t.imported_at).as_secs_f64(),
            total_seconds: (first - self.arrival).as_secs_f64(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use cleave_engine::engine::{FinishReason, Usage};

    use super::*;

    fn token(id: u32) -> SeqEvent {
        SeqEvent::Token {
            id,
            text: format!("t{id}"),
            logprob: None,
        }
    }

    fn done() -> SeqEvent {
        SeqEvent::Done {
            reason: FinishReason::Length,
            usage: Usage {
                prompt_tokens: 100,
                completion_tokens: 1,
                cached_tokens: 32,
            },
            text: String::new(),
        }
    }

    fn needed(cached_tokens: usize) -> SeqEvent {
        SeqEvent::KvNeeded {
            blocks: vec![BlockId(0)],
            cached_tokens,
        }
    }

    fn finished(step: Step) -> pb::Finished {
        match step {
            Step::Send {
                event:
                    Some(pb::GenerateEvent {
                        event: Some(pb::generate_event::Event::Finished(f)),
                    }),
                done: true,
                ..
            } => f,
            other => panic!("not the last event: {other:?}"),
        }
    }

    #[test]
    fn a_short_uncached_part_is_prefilled_here() {
        let t0 = Instant::now();
        let mut s = DecodeSession::new(t0, 100, 16);
        assert!(matches!(s.on_event(needed(90), t0), Step::PrefillHere));
        assert!(matches!(
            s.on_event(token(7), t0),
            Step::Send {
                token: true,
                done: false,
                ..
            }
        ));
        let f = finished(s.on_event(done(), t0));
        assert!(!f.disaggregated);
        assert!(f.ttft.is_none(), "no breakdown without a remote prefill");
    }

    #[test]
    fn a_remote_prefill_reports_where_the_first_token_time_went() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut s = DecodeSession::new(t0, 100, 16);
        match s.on_event(needed(32), t0 + ms(10)) {
            Step::Import {
                blocks,
                cached_tokens,
            } => assert_eq!((blocks, cached_tokens), (vec![BlockId(0)], 32)),
            other => panic!("expected an import, got {other:?}"),
        }
        let (tx, rx) = oneshot::channel();
        s.importing(rx);
        tx.send(Timing {
            compute_seconds: 0.25,
            transfer_seconds: 0.05,
            imported_at: t0 + ms(400),
        })
        .unwrap();
        s.on_event(token(7), t0 + ms(450));
        s.on_event(token(8), t0 + ms(500));
        let f = finished(s.on_event(done(), t0 + ms(600)));
        assert!(f.disaggregated);
        let b = f.ttft.expect("a breakdown");
        assert_eq!(b.queue_seconds, 0.010);
        assert_eq!((b.prefill_seconds, b.transfer_seconds), (0.25, 0.05));
        assert_eq!(
            b.first_decode_seconds, 0.050,
            "from the import to the first token"
        );
        assert_eq!(b.total_seconds, 0.450, "from arrival to the first token");
    }

    #[test]
    fn a_failed_import_leaves_no_breakdown() {
        let t0 = Instant::now();
        let mut s = DecodeSession::new(t0, 100, 16);
        assert!(matches!(s.on_event(needed(0), t0), Step::Import { .. }));
        let (tx, rx) = oneshot::channel::<Timing>();
        s.importing(rx);
        drop(tx); // the import failed: the engine prefills locally
        s.on_event(token(1), t0);
        assert!(finished(s.on_event(done(), t0)).ttft.is_none());
    }
}
