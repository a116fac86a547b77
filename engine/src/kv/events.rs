//! Stored/removed events of the prefix cache, consumed by the KV-aware router.
//!
//! Every change to the set of cached block hashes of a [`BlockPool`](super::BlockPool) is
//! recorded as a [`KvEventRecord`]: a [`KvEvent`] with an id that starts at 0 and increases by
//! exactly 1 per event of that pool. The router drains them with
//! [`BlockPool::drain_events`](super::BlockPool::drain_events).
//!
//! The log is bounded: if more than its capacity ([`DEFAULT_EVENT_CAPACITY`] by default) are
//! pending, the oldest are dropped and counted ([`EventLog::dropped`]). Dropped events keep their
//! ids, so a consumer sees the gap in ids and knows it has to resynchronise.

use std::collections::VecDeque;

/// Default bound on events pending between two drains.
pub const DEFAULT_EVENT_CAPACITY: usize = 65_536;

pub use cleave_types::kv::{KvEvent, KvEventRecord};

/// Bounded FIFO of pending events with contiguous ids.
#[derive(Debug)]
pub struct EventLog {
    pending: VecDeque<KvEventRecord>,
    next_id: u64,
    capacity: usize,
    dropped: u64,
}

impl EventLog {
    /// An empty log keeping at most `capacity` pending events (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            pending: VecDeque::new(),
            next_id: 0,
            capacity,
            dropped: 0,
        }
    }

    /// Appends `event` with the next id, dropping the oldest pending event if full.
    pub fn push(&mut self, event: KvEvent) {
        if self.pending.len() == self.capacity {
            self.pending.pop_front();
            self.dropped += 1;
        }
        self.pending.push_back(KvEventRecord {
            id: self.next_id,
            event,
        });
        self.next_id += 1;
    }

    /// Takes every pending event, oldest first.
    pub fn drain(&mut self) -> Vec<KvEventRecord> {
        self.pending.drain(..).collect()
    }

    /// Number of events pending.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether no event is pending.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// Events dropped because the log was full, since creation.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Id the next event will get (= number of events ever recorded).
    pub fn next_id(&self) -> u64 {
        self.next_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::BlockHash;

    fn removed(h: u64) -> KvEvent {
        KvEvent::Removed {
            hashes: vec![BlockHash(h)],
        }
    }

    #[test]
    fn ids_are_contiguous_across_drains() {
        let mut log = EventLog::new(8);
        log.push(KvEvent::Cleared);
        log.push(removed(1));
        let a = log.drain();
        assert_eq!(a.iter().map(|r| r.id).collect::<Vec<_>>(), vec![0, 1]);
        assert!(log.is_empty());
        log.push(removed(2));
        let b = log.drain();
        assert_eq!(b[0].id, 2);
        assert_eq!(b[0].event, removed(2));
        assert!(log.drain().is_empty());
    }

    #[test]
    fn full_log_drops_oldest_and_counts() {
        let mut log = EventLog::new(3);
        for h in 0..5 {
            log.push(removed(h));
        }
        assert_eq!(log.len(), 3);
        assert_eq!(log.dropped(), 2);
        let got = log.drain();
        assert_eq!(got.iter().map(|r| r.id).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(got[0].event, removed(2));
        assert_eq!(log.next_id(), 5);
    }

    #[test]
    fn serde_round_trip() {
        let rec = KvEventRecord {
            id: 7,
            event: KvEvent::Stored {
                parent: Some(BlockHash(3)),
                blocks: vec![BlockHash(4)],
            },
        };
        let json = serde_json::to_string(&rec).unwrap();
        let back: KvEventRecord = serde_json::from_str(&json).unwrap();
        assert_eq!(back, rec);
    }
}
