//! The `Watch` stream: KV events (blocks stored in / removed from this worker's prefix cache)
//! and load, for the routers. A new watcher first gets a snapshot of every cached hash and the
//! id the next event will carry, then live updates; a watcher that falls behind is dropped and
//! reconnects (resync), rather than holding memory for it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_engine::engine::Engine;
use cleave_engine::kv::{KvEvent, KvEventRecord};
use cleave_proto::v1 as pb;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::WorkerState;

/// How often the engine's events and load are collected.
pub const POLL: Duration = Duration::from_millis(20);

struct State {
    cached: HashSet<u64>,
    next_id: u64,
}

/// Fans the engine's KV events and load out to every watcher.
pub struct WatchHub {
    state: Mutex<State>,
    tx: broadcast::Sender<pb::WorkerUpdate>,
    /// Cancelled when the worker stops serving: every Watch stream ends.
    stop: CancellationToken,
    /// The worker's tasks; each Watch stream's relay is one.
    tasks: TaskTracker,
}

fn wire_event(r: &KvEventRecord) -> pb::KvEvent {
    use pb::kv_event::Kind;
    let kind = match &r.event {
        KvEvent::Stored { parent, blocks } => Kind::Stored(pb::Stored {
            parent: parent.map(|p| p.0),
            blocks: blocks.iter().map(|b| b.0).collect(),
        }),
        KvEvent::Removed { hashes } => Kind::Removed(pb::Removed {
            hashes: hashes.iter().map(|h| h.0).collect(),
        }),
        KvEvent::Cleared => Kind::Cleared(true),
    };
    pb::KvEvent {
        id: r.id,
        kind: Some(kind),
    }
}

/// The load part of an update.
pub fn load(engine: &Engine) -> pb::Load {
    let s = engine.stats();
    pb::Load {
        queue_depth: s.waiting as u32,
        running: (s.running + s.parked) as u32,
        kv_blocks_used: s.pool.used as u32,
        kv_blocks_total: s.pool.total as u32,
    }
}

impl WatchHub {
    /// Starts collecting from `engine` until `shutdown`, which also ends every Watch stream; the
    /// collecting task and each Watch stream's relay belong to `tasks`.
    pub fn start(
        engine: Arc<Engine>,
        shutdown: CancellationToken,
        tasks: &TaskTracker,
    ) -> Arc<Self> {
        let (tx, _) = broadcast::channel(1024);
        let hub = Arc::new(WatchHub {
            state: Mutex::new(State {
                cached: HashSet::new(),
                next_id: 0,
            }),
            tx,
            stop: shutdown.clone(),
            tasks: tasks.clone(),
        });
        let h = hub.clone();
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(POLL);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tick.tick() => h.collect(&engine),
                }
            }
        });
        hub
    }

    fn collect(&self, engine: &Engine) {
        let records = engine.take_kv_events();
        let mut st = self.state.lock().expect("watch lock");
        for r in &records {
            match &r.event {
                KvEvent::Stored { blocks, .. } => st.cached.extend(blocks.iter().map(|b| b.0)),
                KvEvent::Removed { hashes } => {
                    for h in hashes {
                        st.cached.remove(&h.0);
                    }
                }
                KvEvent::Cleared => st.cached.clear(),
            }
            st.next_id = r.id + 1;
        }
        let update = pb::WorkerUpdate {
            snapshot: Vec::new(),
            events: records.iter().map(wire_event).collect(),
            load: Some(load(engine)),
            next_event_id: 0,
        };
        drop(st);
        let _ = self.tx.send(update);
    }

    /// A snapshot update followed by live updates.
    pub fn subscribe(
        &self,
        engine: &Engine,
    ) -> (pb::WorkerUpdate, broadcast::Receiver<pb::WorkerUpdate>) {
        let st = self.state.lock().expect("watch lock");
        let rx = self.tx.subscribe();
        let snapshot = pb::WorkerUpdate {
            snapshot: st.cached.iter().copied().collect(),
            events: Vec::new(),
            load: Some(load(engine)),
            next_event_id: st.next_id,
        };
        (snapshot, rx)
    }
}

/// What a `Watch` call streams back (each role's `WatchStream`).
pub type Stream = tokio_stream::wrappers::ReceiverStream<Result<pb::WorkerUpdate, tonic::Status>>;

/// The `Watch` RPC's answer, shared by both roles: `stream` from the worker's hub and engine.
pub fn response(state: &WorkerState) -> tonic::Response<Stream> {
    tonic::Response::new(stream(&state.watch, &state.engine))
}

/// The updates for one watcher of `hub`: a snapshot, then live updates until the watcher goes
/// away, falls behind or the worker stops serving.
fn stream(hub: &Arc<WatchHub>, engine: &Arc<Engine>) -> Stream {
    let (first, mut rx) = hub.subscribe(engine);
    let (tx, out) = tokio::sync::mpsc::channel(64);
    let stop = hub.stop.clone();
    hub.tasks.spawn(async move {
        if tx.send(Ok(first)).await.is_err() {
            return;
        }
        loop {
            let next = tokio::select! {
                _ = stop.cancelled() => {
                    let _ = tx
                        .send(Err(tonic::Status::unavailable("the worker stopped serving")))
                        .await;
                    return;
                }
                r = rx.recv() => r,
            };
            match next {
                Ok(u) => {
                    if tx.send(Ok(u)).await.is_err() {
                        return;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let _ = tx
                        .send(Err(tonic::Status::resource_exhausted(format!(
                            "watcher fell {n} updates behind; reconnect to resync"
                        ))))
                        .await;
                    return;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(out)
}
