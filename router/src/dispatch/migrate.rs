//! Mid-stream migration: when the decode worker serving a stream fails after tokens were sent
//! (the stream breaks, ends without `Finished`, or finishes `aborted`), the request is placed
//! again with the tokens generated so far as `resume` and the client's stream goes on from the
//! new worker: nothing is streamed twice (the new worker feeds the resumed tokens to its
//! decoder, stop matcher, grammar and RNG without sending them) and its usage counts every
//! token once. After `migration_limit` moves, or with no worker left, the stream ends in an
//! error.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use cleave_kv_index::WorkerId;
use tokio_stream::Stream;

use super::{event, Inner, Opened, WorkerStream};
use crate::api::backend::{BackendError, BackendEvent, BackendRequest, FinishReason};
use crate::place::Reservation;

type Opening = Pin<Box<dyn Future<Output = Result<Opened, BackendError>> + Send>>;

enum State {
    Streaming {
        stream: WorkerStream,
        /// Held while the worker serves the stream (its load charge).
        reservation: Reservation,
        decode: WorkerId,
    },
    Opening(Opening),
    Done,
}

/// A request's events across the decode workers that served it.
pub(crate) struct Migrating {
    inner: Arc<Inner>,
    req: Arc<BackendRequest>,
    /// Every token streamed to the client so far.
    generated: Vec<u32>,
    migrations: usize,
    state: State,
}

impl Migrating {
    pub(crate) fn new(inner: Arc<Inner>, req: BackendRequest, opened: Opened) -> Self {
        Migrating {
            inner,
            req: Arc::new(req),
            generated: Vec::new(),
            migrations: 0,
            state: State::Streaming {
                stream: opened.stream,
                reservation: opened.reservation,
                decode: opened.decode,
            },
        }
    }

    /// The worker failed (`why`): place the request again, or end the stream in an error.
    fn migrate(&mut self, decode: WorkerId, why: String) -> Option<BackendEvent> {
        if self.generated.is_empty() || self.migrations >= self.inner.migration_limit {
            self.state = State::Done;
            if self.generated.is_empty() {
                return Some(BackendEvent::Error(format!("decode worker failed: {why}")));
            }
            tracing::warn!(request_id = %self.req.request_id, error = %why,
                "decode worker failed mid-stream: migration limit reached");
            return Some(BackendEvent::Lost(format!(
                "it was moved {} time(s) already, the limit (--migration-limit {}); last failure: {why}",
                self.migrations, self.inner.migration_limit
            )));
        }
        self.migrations += 1;
        tracing::warn!(worker = %decode, request_id = %self.req.request_id, generated = self.generated.len(),
            migration = self.migrations, error = %why, "decode worker failed mid-stream: migrating the request");
        self.inner.set_unhealthy(decode);
        if let Some(m) = &self.inner.metrics {
            m.migrations.inc();
        }
        let (inner, req, resume) = (self.inner.clone(), self.req.clone(), self.generated.clone());
        self.state = State::Opening(Box::pin(async move { inner.open(&req, &resume).await }));
        None
    }
}

impl Stream for Migrating {
    type Item = BackendEvent;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<BackendEvent>> {
        let this = &mut *self;
        loop {
            match &mut this.state {
                State::Done => return Poll::Ready(None),
                State::Opening(fut) => match ready!(fut.as_mut().poll(cx)) {
                    Ok(o) => {
                        this.state = State::Streaming {
                            stream: o.stream,
                            reservation: o.reservation,
                            decode: o.decode,
                        }
                    }
                    Err(e) => {
                        this.state = State::Done;
                        return Poll::Ready(Some(BackendEvent::Lost(format!(
                            "no other decode worker could take it ({e})"
                        ))));
                    }
                },
                State::Streaming {
                    stream,
                    decode,
                    reservation,
                } => {
                    let decode = *decode;
                    let failed = match ready!(stream.as_mut().poll_next(cx)) {
                        None => "the stream ended before the request finished".to_string(),
                        Some(Err(s)) => s.message().to_string(),
                        Some(Ok(ev)) => match event(ev) {
                            None => "empty event from the worker".to_string(),
                            Some(BackendEvent::Finished {
                                reason: FinishReason::Aborted,
                                ..
                            }) if !this.generated.is_empty() => {
                                "the worker aborted the request".to_string()
                            }
                            Some(ev) => {
                                match &ev {
                                    BackendEvent::Token { id, .. } => this.generated.push(*id),
                                    BackendEvent::Finished {
                                        completion_tokens,
                                        cached_tokens,
                                        ..
                                    } => {
                                        // The worker's count of what it had cached corrects
                                        // the router's guess (a prefill that ran only).
                                        if *completion_tokens > 0 {
                                            reservation.prefill_measured(*cached_tokens);
                                        }
                                        this.state = State::Done;
                                    }
                                    _ => this.state = State::Done,
                                }
                                return Poll::Ready(Some(ev));
                            }
                        },
                    };
                    if let Some(err) = this.migrate(decode, failed) {
                        return Poll::Ready(Some(err));
                    }
                }
            }
        }
    }
}
