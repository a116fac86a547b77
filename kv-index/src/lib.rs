//! `cleave-kv-index`: the router's prefix index.
//!
//! Every worker publishes the block hashes its prefix cache gains and loses as a stream of
//! [`KvEventRecord`]s (`Stored` / `Removed` / `Cleared`, ids +1 per event). The router feeds each
//! stream into one [`PrefixIndex`], and on the placement hop (`router::place`) asks it, for a
//! prompt's chained block hashes, how many *leading* blocks each worker already holds
//! ([`PrefixIndex::find_matches`] → [`Matches`]).
//!
//! Main types:
//! - [`WorkerId`]: the id the router knows a worker by;
//! - [`PrefixIndex`]: hash → set-of-workers map plus per-worker bookkeeping (event sequence,
//!   insertion order for the memory cap);
//! - [`Gap`]: returned when a worker's event ids skip, so the caller resyncs
//!   ([`PrefixIndex::apply_snapshot`]);
//! - [`Matches`]: per worker, matched leading blocks and total blocks held.
//!
//! The index is a pure data structure: no locking, no I/O. The router wraps it as it needs.

#![forbid(unsafe_code)]

pub mod index;

pub use cleave_types::{BlockHash, KvEvent, KvEventRecord, WorkerId};
pub use index::{MatchEntry, Matches, PrefixIndex, DEFAULT_MAX_ENTRIES};

/// A worker's event ids skipped: the event was not applied, and the caller must resync the worker
/// ([`PrefixIndex::apply_snapshot`], or [`PrefixIndex::reset_worker`] and replay from a known id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("kv event gap for worker {worker}: expected id {expected}, got {got}")]
pub struct Gap {
    /// The worker whose stream skipped.
    pub worker: WorkerId,
    /// The id the index expected next.
    pub expected: u64,
    /// The id it got.
    pub got: u64,
}
