//! Bookkeeping of the paged KV cache.
//!
//! The key/value memory itself lives elsewhere (the model owns it); this module deals only in
//! block ids. The cache is cut into fixed-size blocks of [`DEFAULT_BLOCK_SIZE`] tokens by default,
//! and a [`BlockPool`] hands out ids of such blocks:
//!
//! - each block has a reference count; sequences that share a prefix share its blocks;
//! - a block that no sequence references goes back to the free list, unless it is *cached*;
//! - a full block can be *committed* under the chained hash of its tokens ([`block_hashes`],
//!   [`next_block_hash`]), after which [`BlockPool::match_prefix`] finds it for later requests
//!   with the same prefix (the prefix cache);
//! - a cached block nobody references is *idle*: it stays findable until
//!   [`BlockPool::allocate`] runs out of free blocks and evicts the least recently released one;
//! - every change to the set of cached hashes is recorded as a [`KvEvent`] that the router
//!   drains with [`BlockPool::drain_events`] to know which worker holds which prefixes.
//!
//! Block hashes follow NVIDIA Dynamo's scheme so that its router and ours agree on them; see
//! [`hash`] for the exact definition.

pub mod events;
pub mod memory;
pub mod pool;
pub mod tiers;

#[cfg(test)]
mod pool_tests;
#[cfg(test)]
mod proptests;

pub use events::{KvEvent, KvEventRecord, DEFAULT_EVENT_CAPACITY};
pub use pool::{BlockPool, PoolStats};

/// Block hashing, the block size and the hash type are defined in `cleave-types`, shared with
/// the router, which hashes prompts without linking the engine.
pub use cleave_types::kv::{block_hashes, hash, next_block_hash, BlockHash, DEFAULT_BLOCK_SIZE};

/// Index of a block in a [`BlockPool`] (`0..num_blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);
