//! Block hashes and the prefix cache's events: what a worker publishes and a router indexes.
//!
//! Every change to the set of cached block hashes of a worker's pool is a [`KvEventRecord`]: a
//! [`KvEvent`] with an id that starts at 0 and increases by exactly 1 per event of that pool, so
//! a consumer that sees the ids skip knows it has to resynchronise. [`hash`] defines how block
//! hashes are computed (Dynamo's scheme), so the router hashes a prompt as the workers do
//! without linking the engine. [`KvRegion`] is the memory a KV pool lives in: the engine reads
//! and writes it, the transport that moves blocks between processes provides it.

pub mod hash;

pub use hash::{block_hashes, next_block_hash};

/// Number of tokens in one KV block unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Memory that backs a KV pool. The transport that moves blocks between processes provides it
/// (UCX-allocated, registered memory); the engine's `HeapRegion` is plain memory for a single
/// process.
pub trait KvRegion: Send {
    /// The whole region.
    fn bytes(&self) -> &[u8];
    /// The whole region, writable.
    fn bytes_mut(&mut self) -> &mut [u8];
}

/// Chained hash of a full block: it identifies the block's tokens *and* every token before them.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct BlockHash(pub u64);

/// A change to the set of block hashes cached by one pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum KvEvent {
    /// `blocks` are now cached, each the child of the previous one; the first is the child of
    /// `parent` (`None`: the first block of a sequence).
    Stored {
        parent: Option<BlockHash>,
        blocks: Vec<BlockHash>,
    },
    /// `hashes` are no longer cached.
    Removed { hashes: Vec<BlockHash> },
    /// Nothing is cached any more.
    Cleared,
}

/// An event with its sequence number in its pool.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvEventRecord {
    /// 0 for a pool's first event, +1 for each next one.
    pub id: u64,
    /// What changed.
    pub event: KvEvent,
}
