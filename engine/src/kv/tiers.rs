//! KV tiers below the pool: a host tier in ordinary memory and a disk tier in a directory.
//!
//! The pool (tier 0) is the memory the forward pass and the transport use. With tiers on, a
//! cached block the pool evicts is not forgotten: its bytes are copied into the host tier
//! ([`Move::Out`], run by the engine between steps), and a later request whose prefix reaches
//! that hash gets a fresh pool block with the bytes copied back ([`Move::In`]) instead of
//! computing it. The host tier is exclusive of the pool (a restored entry leaves it); when it
//! is full its least recently stored entry goes to the disk tier if it was used often enough
//! (the admission filter: `min_uses` demotions or restores, counted per hash), else it is
//! dropped. The disk tier is inclusive (a restored entry stays on disk) and bounded in bytes,
//! least recently used first out; see [`disk`] for the file format and its integrity checks.
//!
//! Bytes move between tiers unchanged (no re-quantization), so restored KV is the KV that was
//! computed, and the engine's batch invariance makes it equal to recomputed KV.
//!
//! What the router sees: a hash is announced once when it is first committed to the pool and
//! removed only when it has left every tier ([`Tiers::drain_dropped`] → `BlockPool::forget`).
//! The events carry no tier yet.

pub mod disk;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use super::memory::KvLayout;
use super::{BlockHash, BlockId};
use disk::{DiskError, DiskTier};

/// A block copy between the pool and a tier, run by the engine before the next forward pass,
/// in the order recorded.
#[derive(Clone, Debug)]
pub enum Move {
    /// The pool evicted `block`, cached under `hash`: copy its bytes into the tiers.
    Out {
        block: BlockId,
        hash: BlockHash,
        parent: Option<BlockHash>,
    },
    /// Copy a tier's bytes into `block` (freshly allocated and cached).
    In { block: BlockId, data: Arc<[u8]> },
}

/// Which tiers a worker keeps and how large they are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// Bytes of the host tier (0: none).
    pub host_bytes: usize,
    /// The disk tier, if any.
    pub disk: Option<DiskConfig>,
    /// Identity of the model's weights (see `model_identity` in the worker); part of the
    /// fingerprint every disk entry must match.
    pub model_id: u128,
}

impl TierConfig {
    /// Whether any tier is configured.
    pub fn enabled(&self) -> bool {
        self.host_bytes > 0 || self.disk.is_some()
    }
}

/// The disk tier's directory and limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub dir: PathBuf,
    /// Bytes of entries kept (headers included).
    pub max_bytes: u64,
    /// Demotions plus restores a hash needs before it is written to disk (at least 1).
    pub min_uses: u32,
}

/// Counters of the tiers (since start).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Blocks copied from the pool into the host tier.
    pub host_stored: u64,
    /// Blocks restored from the host tier.
    pub host_hits: u64,
    /// Blocks restored from the disk tier.
    pub disk_hits: u64,
    /// Blocks handed to the disk writer.
    pub disk_written: u64,
    /// Disk entries refused: corrupt, truncated or foreign (at start or when read).
    pub disk_refused: u64,
    /// Entries now in the host tier and on disk.
    pub host_entries: usize,
    pub disk_entries: usize,
}

/// Least-recently-used order over hashes, with a value per hash.
#[derive(Debug)]
pub(crate) struct Lru<V> {
    map: HashMap<BlockHash, (u64, V)>,
    order: BTreeMap<u64, BlockHash>,
    tick: u64,
}

impl<V> Default for Lru<V> {
    fn default() -> Self {
        Lru {
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
        }
    }
}

impl<V> Lru<V> {
    /// Inserts (or replaces) `hash` as the most recently used; returns the old value.
    pub(crate) fn insert(&mut self, hash: BlockHash, v: V) -> Option<V> {
        self.tick += 1;
        self.order.insert(self.tick, hash);
        let old = self.map.insert(hash, (self.tick, v))?;
        self.order.remove(&old.0);
        Some(old.1)
    }

    /// Marks `hash` most recently used.
    pub(crate) fn touch(&mut self, hash: BlockHash) {
        if let Some(v) = self.remove(hash) {
            self.insert(hash, v);
        }
    }

    pub(crate) fn remove(&mut self, hash: BlockHash) -> Option<V> {
        let (tick, v) = self.map.remove(&hash)?;
        self.order.remove(&tick);
        Some(v)
    }

    /// Takes the least recently used entry out.
    pub(crate) fn pop_oldest(&mut self) -> Option<(BlockHash, V)> {
        let (_, hash) = self.order.pop_first()?;
        let (_, v) = self.map.remove(&hash)?;
        Some((hash, v))
    }

    pub(crate) fn get(&self, hash: BlockHash) -> Option<&V> {
        self.map.get(&hash).map(|(_, v)| v)
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Entries, least recently used first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (BlockHash, &V)> {
        self.order.values().map(|h| (*h, &self.map[h].1))
    }
}

/// A host-tier entry.
#[derive(Debug)]
struct HostEntry {
    parent: Option<BlockHash>,
    data: Arc<[u8]>,
}

/// Counts kept per hash for the admission filter, forgotten wholesale beyond this many.
const MAX_COUNTED: usize = 1 << 20;

/// The tiers of one worker (see the module docs).
#[derive(Debug)]
pub struct Tiers {
    block_bytes: usize,
    host_capacity: usize,
    host: Lru<HostEntry>,
    disk: Option<DiskTier>,
    min_uses: u32,
    uses: HashMap<BlockHash, u32>,
    /// Hashes that left every tier, for the pool to announce.
    dropped: Vec<BlockHash>,
    stats: TierStats,
}

impl Tiers {
    /// The tiers `config` asks for over blocks of `layout`, for rank `rank` of `world`; a disk
    /// directory is created if missing and its valid entries are found again (see
    /// [`Tiers::held`]).
    pub fn open(
        config: &TierConfig,
        layout: &KvLayout,
        rank: usize,
        world: usize,
    ) -> Result<Tiers, DiskError> {
        let block_bytes = layout.block_bytes();
        let fingerprint = disk::fingerprint(config.model_id, layout, rank, world);
        let disk = match &config.disk {
            Some(d) => Some(DiskTier::open(d, fingerprint, block_bytes)?),
            None => None,
        };
        let mut t = Tiers {
            block_bytes,
            host_capacity: config.host_bytes / block_bytes.max(1),
            host: Lru::default(),
            disk,
            min_uses: config.disk.as_ref().map_or(1, |d| d.min_uses.max(1)),
            uses: HashMap::new(),
            dropped: Vec::new(),
            stats: TierStats::default(),
        };
        t.stats.disk_refused = t.disk.as_ref().map_or(0, DiskTier::refused);
        Ok(t)
    }

    /// Whether a tier holds `hash`.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.host.get(hash).is_some() || self.disk.as_ref().is_some_and(|d| d.contains(hash))
    }

    /// The bytes of `hash` for a pool block: taken out of the host tier, or read from disk and
    /// checked (a bad entry is discarded and reported as dropped). `None` on a miss.
    pub fn take(&mut self, hash: BlockHash) -> Option<Arc<[u8]>> {
        if let Some(e) = self.host.remove(hash) {
            self.stats.host_hits += 1;
            self.count_use(hash);
            return Some(e.data);
        }
        let disk = self.disk.as_mut()?;
        match disk.read(hash) {
            Ok(Some(data)) => {
                self.stats.disk_hits += 1;
                self.count_use(hash);
                Some(data.into())
            }
            Ok(None) => None,
            Err(e) => {
                tracing::warn!(hash = hash.0, "KV disk entry refused: {e}");
                self.stats.disk_refused += 1;
                self.dropped.push(hash);
                None
            }
        }
    }

    /// Stores a block the pool evicted. The host tier's oldest entries make room, going to
    /// disk when the admission filter lets them.
    pub fn put(&mut self, hash: BlockHash, parent: Option<BlockHash>, data: Vec<u8>) {
        if data.len() != self.block_bytes {
            debug_assert!(false, "Tiers::put: {} bytes, not a block", data.len());
            return;
        }
        self.count_use(hash);
        let data: Arc<[u8]> = data.into();
        if self.host_capacity == 0 {
            self.demote_to_disk(hash, parent, data);
            return;
        }
        self.stats.host_stored += 1;
        self.host.insert(hash, HostEntry { parent, data });
        while self.host.len() > self.host_capacity {
            let Some((h, e)) = self.host.pop_oldest() else {
                break;
            };
            self.demote_to_disk(h, e.parent, e.data);
        }
    }

    /// Writes an entry leaving the host tier to disk if it is worth it, else drops it.
    fn demote_to_disk(&mut self, hash: BlockHash, parent: Option<BlockHash>, data: Arc<[u8]>) {
        let uses = self.uses.get(&hash).copied().unwrap_or(0);
        let Some(disk) = self.disk.as_mut() else {
            self.dropped.push(hash);
            return;
        };
        if disk.contains(hash) {
            disk.touch(hash);
            return;
        }
        if uses < self.min_uses {
            self.dropped.push(hash);
            return;
        }
        self.stats.disk_written += 1;
        let evicted = disk.write(hash, parent, data);
        self.dropped.extend(evicted);
    }

    fn count_use(&mut self, hash: BlockHash) {
        if self.uses.len() >= MAX_COUNTED {
            self.uses.clear();
        }
        *self.uses.entry(hash).or_insert(0) += 1;
    }

    /// Hashes that left every tier since the last call.
    pub fn drain_dropped(&mut self) -> Vec<BlockHash> {
        std::mem::take(&mut self.dropped)
    }

    /// Every hash the tiers hold with its parent (the disk's, oldest first, then the host's),
    /// to announce at start.
    pub fn held(&self) -> Vec<(BlockHash, Option<BlockHash>)> {
        let disk = self.disk.iter().flat_map(|d| d.entries());
        let host = self.host.iter().map(|(h, e)| (h, e.parent));
        disk.chain(host).collect()
    }

    /// Waits until the disk writer has written everything handed to it so far.
    pub fn flush(&self) {
        if let Some(d) = &self.disk {
            d.flush();
        }
    }

    pub fn stats(&self) -> TierStats {
        TierStats {
            host_entries: self.host.len(),
            disk_entries: self.disk.as_ref().map_or(0, DiskTier::len),
            ..self.stats
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }
}
