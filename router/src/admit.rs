//! Admission: the router's bound on work in flight, the hop between `api` and `place`.
//!
//! At most `max_in_flight` requests run at once; up to `max_queue` more wait (FIFO, tokio's
//! fair semaphore) for at most `queue_timeout`. Anything beyond that is refused at once, so an
//! overload turns into 429s with `Retry-After` instead of an unbounded queue. A request that
//! would join the queue behind more waiters than the slots free up for within `queue_timeout`
//! (at the rate they were freed lately) is refused at once too, instead of after waiting out
//! the timeout: under overload the 429 comes in microseconds, not after `queue_timeout`. Each admitted
//! request gets a [`Permit`] (held until its response is fully sent or dropped) with the
//! deadline of the whole request.
//!
//! An API key's own limits ([`crate::keys`]) are checked before a request joins the queue
//! (concurrency, requests per minute) and once it is tokenized (tokens per minute); the
//! key's [`KeyLease`] then travels in the [`Permit`], which settles the token reservation to
//! the request's usage ([`Permit::settle`]) and frees the key's slot with its own.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use serde::{Deserialize, Serialize};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::keys::KeyLease;

/// Admission limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmitConfig {
    /// Requests that may run at once.
    pub max_in_flight: usize,
    /// Requests that may wait for a slot; beyond this a request is refused at once.
    pub max_queue: usize,
    /// Longest wait for a slot before a queued request is refused.
    #[serde(with = "secs")]
    pub queue_timeout: Duration,
    /// Deadline of the whole request from its arrival (queueing included); `None`: no limit.
    #[serde(with = "opt_secs")]
    pub request_timeout: Option<Duration>,
}

impl Default for AdmitConfig {
    fn default() -> Self {
        AdmitConfig {
            max_in_flight: 256,
            max_queue: 1024,
            queue_timeout: Duration::from_secs(30),
            request_timeout: Some(Duration::from_secs(600)),
        }
    }
}

/// Why admission refused a request (both become HTTP 429 with `Retry-After: 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// The queue was full.
    #[error("admission queue is full")]
    QueueFull,
    /// The request waited `queue_timeout` without getting a slot.
    #[error("timed out waiting for an in-flight slot")]
    QueueTimeout,
    /// At the rate slots are freed, the request would not get one within `queue_timeout`.
    #[error("the queue ahead would not drain within the queue timeout")]
    WouldTimeOut,
}

/// Slots must have been freed this many times before the rate is trusted.
const MIN_RELEASES: u32 = 8;

/// How fast slots are freed: an exponentially weighted mean of the gaps between releases.
#[derive(Debug, Default)]
struct ReleaseRate {
    last: Option<Instant>,
    mean_gap_s: f64,
    releases: u32,
}

impl ReleaseRate {
    fn released(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let gap = now.saturating_duration_since(last).as_secs_f64();
            self.mean_gap_s = if self.releases <= 1 {
                gap
            } else {
                0.8 * self.mean_gap_s + 0.2 * gap
            };
        }
        self.last = Some(now);
        self.releases = self.releases.saturating_add(1);
    }

    /// Expected wait of the `position`-th waiter (1-based), once the rate is known.
    fn expected_wait(&self, position: usize) -> Option<Duration> {
        (self.releases >= MIN_RELEASES)
            .then(|| Duration::from_secs_f64(self.mean_gap_s * position as f64))
    }
}

/// An in-flight slot; freed when dropped.
#[derive(Debug)]
pub struct Permit {
    _slot: OwnedSemaphorePermit,
    deadline: Option<Instant>,
    key: Option<KeyLease>,
    /// Told when the slot is freed.
    rate: Arc<std::sync::Mutex<ReleaseRate>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.rate
            .lock()
            .expect("release rate")
            .released(Instant::now());
    }
}

impl Permit {
    /// When the whole request must be done, if it has a deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// Attaches the request's API-key lease (held, and freed, with the permit).
    pub fn attach_key(&mut self, lease: KeyLease) {
        self.key = Some(lease);
    }

    /// The request's API-key lease, if its key has one.
    pub fn key_mut(&mut self) -> Option<&mut KeyLease> {
        self.key.as_mut()
    }

    /// The request ended with `tokens` used (prompt + completion): settles its key's token
    /// reservation, if any.
    pub fn settle(&mut self, tokens: u64) {
        if let Some(k) = self.key.as_mut() {
            k.settle(tokens);
        }
    }
}

/// Shared admission state; clones share the same limits.
#[derive(Clone, Debug)]
pub struct Admission {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    config: AdmitConfig,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    queue_depth: Gauge,
    rate: Arc<std::sync::Mutex<ReleaseRate>>,
}

/// Decrements the waiting count however the wait ends (success, timeout, or the request
/// future being dropped because the client left).
struct Waiting<'a>(&'a Inner);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.queue_depth.dec();
    }
}

impl Admission {
    /// Admission with `config`, reporting its queue depth into `queue_depth`.
    pub fn new(config: AdmitConfig, queue_depth: Gauge) -> Self {
        Admission {
            inner: Arc::new(Inner {
                slots: Arc::new(Semaphore::new(config.max_in_flight)),
                config,
                waiting: AtomicUsize::new(0),
                queue_depth,
                rate: Arc::default(),
            }),
        }
    }

    /// The limits in force.
    pub fn config(&self) -> &AdmitConfig {
        &self.inner.config
    }

    /// Requests waiting for a slot now.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Acquire)
    }

    /// Waits for an in-flight slot, or refuses when the queue is full or the wait too long.
    pub async fn admit(&self) -> Result<Permit, Rejected> {
        let inner = &*self.inner;
        let arrived = Instant::now();
        let deadline = inner.config.request_timeout.map(|t| arrived + t);
        let permit = |slot| Permit {
            _slot: slot,
            deadline,
            key: None,
            rate: inner.rate.clone(),
        };
        if let Ok(slot) = inner.slots.clone().try_acquire_owned() {
            return Ok(permit(slot));
        }
        let mut wait_limit = inner.config.queue_timeout;
        if let Some(d) = deadline {
            wait_limit = wait_limit.min(d.saturating_duration_since(arrived));
        }
        let claimed = inner
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < inner.config.max_queue).then_some(w + 1)
            });
        let Ok(ahead) = claimed else {
            return Err(Rejected::QueueFull);
        };
        inner.queue_depth.inc();
        let _waiting = Waiting(inner);
        let expected = inner
            .rate
            .lock()
            .expect("release rate")
            .expected_wait(ahead + 1);
        if expected.is_some_and(|w| w > wait_limit) {
            return Err(Rejected::WouldTimeOut);
        }
        match tokio::time::timeout(wait_limit, inner.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => Ok(permit(slot)),
            // The semaphore is never closed; treat it like a timeout if it ever is.
            Ok(Err(_)) | Err(_) => Err(Rejected::QueueTimeout),
        }
    }
}

/// `Duration` as (fractional) seconds in config files.
mod secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

/// `Option<Duration>` as (fractional) seconds in config files.
mod opt_secs {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&d.as_secs_f64()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        match Option::<f64>::deserialize(d)? {
            Some(v) => Duration::try_from_secs_f64(v)
                .map(Some)
                .map_err(serde::de::Error::custom),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(max_in_flight: usize, max_queue: usize) -> Admission {
        Admission::new(
            AdmitConfig {
                max_in_flight,
                max_queue,
                queue_timeout: Duration::from_secs(5),
                request_timeout: Some(Duration::from_secs(60)),
            },
            Gauge::default(),
        )
    }

    #[tokio::test(start_paused = true)]
    async fn queue_full_is_refused_at_once() {
        let a = admission(1, 1);
        let held = a.admit().await.unwrap();
        let a2 = a.clone();
        let queued = tokio::spawn(async move { a2.admit().await });
        tokio::task::yield_now().await;
        assert_eq!(a.waiting(), 1);
        assert_eq!(a.admit().await.unwrap_err(), Rejected::QueueFull);
        drop(held);
        let p = queued.await.unwrap().unwrap();
        assert_eq!(a.waiting(), 0);
        assert!(p.deadline().is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn queued_request_times_out() {
        let a = admission(1, 4);
        let _held = a.admit().await.unwrap();
        let gauge = a.inner.queue_depth.clone();
        let r = a.admit().await;
        assert_eq!(r.unwrap_err(), Rejected::QueueTimeout);
        assert_eq!(a.waiting(), 0);
        assert_eq!(gauge.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn dropped_waiter_leaves_the_queue() {
        let a = admission(1, 1);
        let _held = a.admit().await.unwrap();
        let a2 = a.clone();
        let queued = tokio::spawn(async move { a2.admit().await });
        tokio::task::yield_now().await;
        assert_eq!(a.waiting(), 1);
        queued.abort();
        let _ = queued.await;
        assert_eq!(a.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_queue_that_cannot_drain_in_time_is_refused_at_once() {
        // One slot, freed every second: the queue timeout (5 s) covers four waiters at most.
        let a = admission(1, 16);
        for _ in 0..MIN_RELEASES {
            let held = a.admit().await.unwrap();
            tokio::time::advance(Duration::from_secs(1)).await;
            drop(held);
        }
        let held = a.admit().await.unwrap();
        let mut waiters = Vec::new();
        // Waiters 1..=5 expect to wait 1..=5 s, within the timeout: they queue.
        for _ in 0..5 {
            let a2 = a.clone();
            waiters.push(tokio::spawn(async move { a2.admit().await }));
            tokio::task::yield_now().await;
        }
        assert_eq!(a.waiting(), 5);
        // The sixth would wait about 6 s: refused without waiting.
        let t0 = Instant::now();
        assert_eq!(a.admit().await.unwrap_err(), Rejected::WouldTimeOut);
        assert_eq!(t0.elapsed(), Duration::ZERO);
        assert_eq!(a.waiting(), 5);
        // The queued ones are served as slots free up.
        drop(held);
        let first = waiters.remove(0).await.unwrap().unwrap();
        drop(first);
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_known_release_rate_requests_wait() {
        let a = admission(1, 16);
        let _held = a.admit().await.unwrap();
        let t0 = Instant::now();
        assert_eq!(a.admit().await.unwrap_err(), Rejected::QueueTimeout);
        assert_eq!(t0.elapsed(), Duration::from_secs(5));
    }

    #[test]
    fn config_round_trips_through_json() {
        let c = AdmitConfig::default();
        let back: AdmitConfig = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }
}
