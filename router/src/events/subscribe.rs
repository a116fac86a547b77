//! Following one pod's KV events over ZeroMQ: a SUB socket on its publisher and, when it has
//! one, DEALER requests to its replay endpoint.
//!
//! Replay protocol (vLLM's and SGLang's `ZmqEventPublisher`): the client sends `["", start]`
//! (an empty delimiter frame, then the first wanted sequence number as 8 bytes big-endian) to
//! the publisher's ROUTER socket; the publisher answers, for every batch it still buffers with
//! `seq >= start`, `["", seq, payload]`, then the end marker `["", -1 as 8 bytes, ""]`.
//!
//! The router asks for a replay when it sees a gap in the sequence numbers, and when its first
//! batch from a publisher is not batch 0 (to learn what was stored before it subscribed, as far
//! as the publisher's buffer reaches).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cleave_kv_index::WorkerId;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::chain::ChainConfig;
use super::feed::{FeedStats, PodFeed, SeqStep};
use super::wire::{self, Batch, WireError};
use crate::dispatch::Cluster;

/// The replay end marker's sequence frame (-1 as a signed 8-byte integer).
const END_SEQ: [u8; 8] = [0xff; 8];
/// Most batches taken from one replay (vLLM buffers 10,000 by default).
const MAX_REPLAY: usize = 1 << 20;

/// Where a pod publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The PUB endpoint, e.g. `tcp://10.0.0.7:5557`.
    pub events: String,
    /// The replay (ROUTER) endpoint, if the engine has one.
    pub replay: Option<String>,
    /// The topic subscribed to (`""`: every topic).
    pub topic: String,
    /// How long one replay answer may take.
    pub replay_timeout: Duration,
}

impl Source {
    /// A source with no replay endpoint and every topic.
    pub fn new(events: impl Into<String>) -> Self {
        Self {
            events: events.into(),
            replay: None,
            topic: String::new(),
            replay_timeout: Duration::from_secs(2),
        }
    }
}

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The socket failed.
    #[error("zmq")]
    Zmq(#[from] zeromq::ZmqError),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// An answer was not `[seq, payload]`.
    #[error("replay answer has {0} frames, expected [\"\", seq, payload]")]
    Frames(usize),
    /// An answer did not decode.
    #[error("replay answer")]
    Wire(#[from] WireError),
}

/// Asks `addr` for every batch it buffers from `start` on.
pub async fn replay(
    addr: &str,
    start: u64,
    timeout: Duration,
) -> Result<Vec<(u64, Batch)>, ReplayError> {
    let mut socket = DealerSocket::new();
    tokio::time::timeout(timeout, socket.connect(addr))
        .await
        .map_err(|_| ReplayError::Timeout(timeout))??;
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    socket.send(request).await?;
    let mut out = Vec::new();
    while out.len() < MAX_REPLAY {
        let msg = tokio::time::timeout(timeout, socket.recv())
            .await
            .map_err(|_| ReplayError::Timeout(timeout))??;
        let mut frames = msg.into_vec();
        if frames.len() == 3 && frames[0].is_empty() {
            frames.remove(0);
        }
        let [seq, payload] = frames.as_slice() else {
            return Err(ReplayError::Frames(frames.len()));
        };
        if seq.as_ref() == END_SEQ {
            break;
        }
        out.push((wire::decode_seq(seq)?, wire::decode_batch(payload)?));
    }
    let _ = socket.close().await;
    Ok(out)
}

/// Follows `source` for `worker` until `shutdown`, feeding the cluster's index; the returned
/// receiver sees the feed's counters after every message.
pub fn spawn(
    cluster: Arc<Cluster>,
    worker: WorkerId,
    source: Source,
    config: ChainConfig,
    shutdown: CancellationToken,
) -> watch::Receiver<FeedStats> {
    let (tx, rx) = watch::channel(FeedStats::default());
    let feed = PodFeed::new(worker, config);
    cluster
        .clone()
        .spawn(follow(cluster, source, feed, tx, shutdown));
    rx
}

async fn follow(
    cluster: Arc<Cluster>,
    source: Source,
    mut feed: PodFeed,
    tx: watch::Sender<FeedStats>,
    shutdown: CancellationToken,
) {
    let worker = feed.worker();
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut socket = SubSocket::new();
        let connected = async {
            socket.subscribe(&source.topic).await?;
            socket.connect(&source.events).await
        };
        let connected = tokio::select! {
            _ = shutdown.cancelled() => return,
            c = connected => c,
        };
        if let Err(e) = connected {
            tracing::warn!(%worker, events = %source.events, error = %e, "kv events: cannot subscribe");
        } else {
            tracing::info!(%worker, events = %source.events, "kv events: subscribed");
            backoff = Duration::from_millis(100);
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    m = socket.recv() => m,
                };
                match msg {
                    Ok(msg) => {
                        on_message(&cluster, &source, &mut feed, msg.into_vec()).await;
                        tx.send_replace(feed.stats());
                    }
                    Err(e) => {
                        // The publisher went away; the socket reconnects by itself.
                        tracing::debug!(%worker, error = %e, "kv events: receive failed");
                        break;
                    }
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn on_message(cluster: &Cluster, source: &Source, feed: &mut PodFeed, frames: Vec<Bytes>) {
    let worker = feed.worker();
    let msg = match wire::decode_message(&frames) {
        Ok(m) => m,
        Err(e) => {
            feed.note_bad();
            tracing::warn!(%worker, error = %e, "kv events: bad message skipped");
            return;
        }
    };
    match feed.check(msg.seq) {
        SeqStep::Next => {}
        SeqStep::First => {
            if msg.seq > 0 {
                if let Some(addr) = &source.replay {
                    fill(cluster, feed, addr, source.replay_timeout, 0, msg.seq).await;
                }
            }
        }
        SeqStep::Gap { from } => {
            let missing = msg.seq - from;
            let lost = match &source.replay {
                Some(addr) => {
                    missing - fill(cluster, feed, addr, source.replay_timeout, from, msg.seq).await
                }
                None => missing,
            };
            feed.note_gap(lost);
            tracing::warn!(%worker, from, to = msg.seq, lost, "kv events: sequence gap");
        }
        SeqStep::Restart => {
            tracing::info!(%worker, seq = msg.seq, "kv events: publisher restarted; pod's blocks dropped");
            cluster.placement().with_index(|index| feed.restart(index));
            if msg.seq > 0 {
                if let Some(addr) = &source.replay {
                    fill(cluster, feed, addr, source.replay_timeout, 0, msg.seq).await;
                }
            }
        }
    }
    cluster
        .placement()
        .with_index(|index| feed.apply(index, msg.seq, &msg.batch, false));
}

/// Applies the replayed batches of `from..to` in order (a hole in the publisher's buffer stays
/// lost); returns how many.
async fn fill(
    cluster: &Cluster,
    feed: &mut PodFeed,
    addr: &str,
    timeout: Duration,
    from: u64,
    to: u64,
) -> u64 {
    let batches = match replay(addr, from, timeout).await {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(worker = %feed.worker(), %addr, error = %e, "kv events: replay failed");
            return 0;
        }
    };
    cluster.placement().with_index(|index| {
        let mut applied = 0;
        for (seq, batch) in batches {
            if seq < from || seq >= to {
                continue;
            }
            // Already applied (the buffer answers from `from` on, but a duplicate does no good).
            if feed.expected().is_some_and(|e| seq < e) {
                continue;
            }
            feed.apply(index, seq, &batch, true);
            applied += 1;
        }
        applied
    })
}
