//! The tiers without a model: host capacity and the admission filter, the disk format's checks
//! (corrupt, truncated, foreign entries are refused), and a restart on the same directory.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use super::disk::HEADER;
use super::*;
use crate::kv::memory::KvDtype;

/// A fresh directory under the system's temporary one, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("cleave-tiers-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn layout(dtype: KvDtype) -> KvLayout {
    KvLayout {
        n_layers: 2,
        n_kv_heads: 1,
        head_dim: 32,
        block_size: 4,
        dtype,
    }
}

fn block(seed: u8, bytes: usize) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn config(
    host_blocks: usize,
    dir: Option<&TempDir>,
    disk_blocks: u64,
    min_uses: u32,
) -> TierConfig {
    let bb = layout(KvDtype::F16).block_bytes();
    TierConfig {
        host_bytes: host_blocks * bb,
        disk: dir.map(|d| DiskConfig {
            dir: d.0.clone(),
            max_bytes: disk_blocks * (HEADER + bb) as u64,
            min_uses,
        }),
        model_id: 7,
    }
}

fn open(c: &TierConfig) -> Tiers {
    Tiers::open(c, &layout(KvDtype::F16), 0, 1).expect("open tiers")
}

#[test]
fn host_tier_keeps_the_newest_blocks_and_drops_the_rest_without_disk() {
    let mut t = open(&config(2, None, 0, 1));
    let bb = t.block_bytes();
    for i in 0..3u8 {
        t.put(BlockHash(i as u64), None, block(i, bb));
    }
    assert_eq!(t.drain_dropped(), vec![BlockHash(0)]);
    assert!(!t.contains(BlockHash(0)));
    assert_eq!(t.take(BlockHash(2)).as_deref(), Some(&block(2, bb)[..]));
    // Restored entries leave the host tier (it is exclusive of the pool).
    assert!(!t.contains(BlockHash(2)));
    assert_eq!(t.take(BlockHash(9)), None);
    let s = t.stats();
    assert_eq!((s.host_stored, s.host_hits, s.host_entries), (3, 1, 1));
}

#[test]
fn the_admission_filter_writes_only_blocks_used_often_enough() {
    let dir = TempDir::new();
    let mut t = open(&config(1, Some(&dir), 8, 2));
    let bb = t.block_bytes();
    // Hash 1 is demoted once: when the host evicts it, it is dropped, not written.
    t.put(BlockHash(1), None, block(1, bb));
    t.put(BlockHash(2), None, block(2, bb));
    assert_eq!(t.drain_dropped(), vec![BlockHash(1)]);
    // Hash 2 is restored, then demoted again: its third use passes the filter.
    assert!(t.take(BlockHash(2)).is_some());
    t.put(BlockHash(2), Some(BlockHash(1)), block(2, bb));
    t.put(BlockHash(3), None, block(3, bb));
    assert_eq!(t.drain_dropped(), vec![]);
    t.flush();
    assert_eq!(t.stats().disk_written, 1);
    assert_eq!(t.take(BlockHash(2)).as_deref(), Some(&block(2, bb)[..]));
    // The disk tier is inclusive: the entry stays after a read.
    assert!(t.contains(BlockHash(2)));
    assert_eq!(t.stats().disk_hits, 1);
}

/// Writes blocks 1..=n straight to disk (no host tier, every block admitted), then reopens.
fn written(dir: &TempDir, n: u64) -> Tiers {
    let c = config(0, Some(dir), 16, 1);
    let mut t = open(&c);
    let bb = t.block_bytes();
    for i in 1..=n {
        t.put(
            BlockHash(i),
            (i > 1).then(|| BlockHash(i - 1)),
            block(i as u8, bb),
        );
    }
    drop(t); // the writer finishes its queue
    open(&c)
}

/// Where the first worker on `dir` keeps `hash`.
fn entry_path(dir: &TempDir, hash: u64) -> PathBuf {
    dir.0.join("slot-0").join(format!("{hash:016x}.kv"))
}

#[test]
fn a_restarted_worker_finds_its_disk_tier_again() {
    let dir = TempDir::new();
    let mut t = written(&dir, 3);
    let held = t.held();
    assert_eq!(held.len(), 3);
    assert!(held.contains(&(BlockHash(3), Some(BlockHash(2)))));
    assert!(held.contains(&(BlockHash(1), None)));
    let bb = t.block_bytes();
    assert_eq!(t.take(BlockHash(3)).as_deref(), Some(&block(3, bb)[..]));
    assert_eq!(t.stats().disk_refused, 0);
}

#[test]
fn a_corrupt_payload_is_refused_and_deleted_on_read() {
    let dir = TempDir::new();
    let mut t = written(&dir, 2);
    let path = entry_path(&dir, 2);
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    assert_eq!(t.take(BlockHash(2)), None);
    assert_eq!(t.drain_dropped(), vec![BlockHash(2)]);
    assert_eq!(t.stats().disk_refused, 1);
    assert!(!t.contains(BlockHash(2)));
    t.flush();
    assert!(!path.exists(), "the bad entry is deleted");
    // The good one still reads.
    assert!(t.take(BlockHash(1)).is_some());
}

#[test]
fn truncated_and_damaged_headers_are_refused_at_start() {
    let dir = TempDir::new();
    drop(written(&dir, 3));
    let truncated = entry_path(&dir, 1);
    let bytes = std::fs::read(&truncated).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() - 10]).unwrap();
    let damaged = entry_path(&dir, 2);
    let mut bytes = std::fs::read(&damaged).unwrap();
    bytes[33] ^= 0x40; // the hash field: the header checksum no longer matches
    std::fs::write(&damaged, &bytes).unwrap();
    // An entry renamed to another hash's name.
    std::fs::rename(entry_path(&dir, 3), entry_path(&dir, 4)).unwrap();
    let t = open(&config(0, Some(&dir), 16, 1));
    assert_eq!(t.stats().disk_refused, 3);
    assert_eq!(t.stats().disk_entries, 0);
    assert!(!truncated.exists() && !damaged.exists());
}

#[test]
fn entries_of_another_model_or_kv_type_are_never_used() {
    let dir = TempDir::new();
    drop(written(&dir, 2));
    // Another model on the same directory gets a slot of its own, and finds nothing.
    let other_model = TierConfig {
        model_id: 8,
        ..config(0, Some(&dir), 16, 1)
    };
    let mut t = open(&other_model);
    assert_eq!(t.stats().disk_entries, 0);
    let bb = t.block_bytes();
    t.put(BlockHash(9), None, block(9, bb));
    drop(t);
    // Its entry copied into the first model's slot is left alone and never indexed.
    let foreign = entry_path(&dir, 9);
    std::fs::copy(
        dir.0.join("slot-1").join(format!("{:016x}.kv", 9)),
        &foreign,
    )
    .unwrap();
    let c = config(0, Some(&dir), 16, 1);
    let t = open(&c);
    assert_eq!(t.stats().disk_entries, 2);
    assert_eq!(
        t.stats().disk_refused,
        0,
        "foreign entries are not ours to refuse"
    );
    assert!(!t.contains(BlockHash(9)));
    assert!(foreign.exists());
    drop(t);
    // Another KV type or rank layout is another fingerprint too.
    for (l, rank, world) in [(layout(KvDtype::F32), 0, 1), (layout(KvDtype::F16), 1, 2)] {
        let t = Tiers::open(&c, &l, rank, world).unwrap();
        assert_eq!(t.stats().disk_entries, 0);
    }
}

#[test]
fn workers_sharing_a_directory_get_their_own_slots_and_find_them_again() {
    let dir = TempDir::new();
    let c = config(0, Some(&dir), 16, 1);
    let mut a = open(&c);
    let mut b = open(&c);
    let bb = a.block_bytes();
    a.put(BlockHash(1), None, block(1, bb));
    b.put(BlockHash(2), None, block(2, bb));
    drop(a);
    // A worker starting now takes the free slot, with the entries its predecessor left.
    let c2 = open(&c);
    assert!(c2.contains(BlockHash(1)) && !c2.contains(BlockHash(2)));
    b.flush();
    assert!(dir.0.join("slot-1").join(format!("{:016x}.kv", 2)).exists());
}

#[test]
fn disk_capacity_evicts_the_least_recently_used() {
    let dir = TempDir::new();
    let c = config(0, Some(&dir), 2, 1);
    let mut t = open(&c);
    let bb = t.block_bytes();
    t.put(BlockHash(1), None, block(1, bb));
    t.put(BlockHash(2), None, block(2, bb));
    // A read makes 1 the most recently used, so 2 goes.
    assert!(t.take(BlockHash(1)).is_some());
    t.put(BlockHash(3), None, block(3, bb));
    assert_eq!(t.drain_dropped(), vec![BlockHash(2)]);
    drop(t);
    let t = open(&c);
    let mut held: Vec<u64> = t.held().iter().map(|h| h.0 .0).collect();
    held.sort();
    assert_eq!(held, vec![1, 3]);
}
