//! The disk tier: one file per block in a directory, written by a background thread, read back
//! and checked on a hit, found again when a worker restarts on the same directory.
//!
//! # File format (version 1)
//! `{hash as 16 hex digits}.kv`, little-endian:
//!
//! | bytes  | field                                                              |
//! |--------|--------------------------------------------------------------------|
//! | 0..8   | magic `CLEAVEKV`                                                   |
//! | 8..12  | format version (1)                                                 |
//! | 12..16 | flags (bit 0: the block has a parent)                              |
//! | 16..32 | fingerprint (XXH3-128, see [`fingerprint`])                        |
//! | 32..40 | block hash                                                         |
//! | 40..48 | parent hash (0 without one)                                        |
//! | 48..56 | payload length                                                     |
//! | 56..72 | XXH3-128 of the payload                                            |
//! | 72..80 | XXH3-64 of bytes 0..72                                             |
//! | 80..   | the block's bytes, exactly as in the pool                          |
//!
//! An entry is used only if every field checks out: magic, version, header checksum, this
//! worker's fingerprint, the hash its name says, a payload of one block, a file of exactly
//! header + payload, and the payload checksum (verified on every read). At start, a file with
//! a bad header or length is deleted and counted as refused; a file with another fingerprint
//! (another model, KV type, block size or rank layout sharing the directory) is left alone and
//! never indexed. A file is written under a temporary name and renamed, so a crash mid-write
//! leaves no entry under a block's name (leftover temporary files are deleted at start).
//!
//! # Slots
//! Several workers may share one directory (the workers of a node on a `hostPath`, the prefill
//! and decode workers of `cleave up`): each claims a slot, `DIR/slot-N`, by holding an
//! exclusive lock on `slot-N/lock` for its lifetime, and writes its fingerprint in
//! `slot-N/fingerprint`. A worker takes the first free slot with its own fingerprint, else the
//! first free unmarked (or new) one, never a free slot of another fingerprint: so a worker
//! restarted, or replaced by a rolling update, finds the entries its predecessor left.
//!
//! Capacity is bounded in bytes; the least recently used entries (by last write or read, file
//! modification time at start) are deleted first.
//!
//! `foyer` (a hybrid memory/disk cache) was weighed: its API is async on tokio while the engine
//! thread is synchronous, it owns its on-disk format (no per-entry fingerprint checked against
//! this worker, no list of recovered keys to announce to the router at start), so this small
//! format and an LRU index are kept here instead.

use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

use super::{DiskConfig, Lru};
use crate::kv::memory::KvLayout;
use crate::kv::BlockHash;

const MAGIC: &[u8; 8] = b"CLEAVEKV";
/// The on-disk format's version; part of the fingerprint too.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes of an entry's header.
pub const HEADER: usize = 80;

/// Errors opening the disk tier or reading an entry.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("KV disk tier {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("KV disk entry {path} is invalid: {why}")]
    Invalid { path: PathBuf, why: &'static str },
}

/// What makes KV bytes differ: the format version, the model's weights, the layout (layers,
/// heads, head size, block size, element type) and the rank within its group.
pub fn fingerprint(model_id: u128, layout: &KvLayout, rank: usize, world: usize) -> u128 {
    let mut b = Vec::with_capacity(96);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.extend_from_slice(&model_id.to_le_bytes());
    for v in [
        layout.n_layers,
        layout.n_kv_heads,
        layout.head_dim,
        layout.block_size,
        rank,
        world,
    ] {
        b.extend_from_slice(&(v as u64).to_le_bytes());
    }
    b.extend_from_slice(layout.dtype.as_str().as_bytes());
    xxh3_128(&b)
}

/// An entry's header fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    fingerprint: u128,
    hash: BlockHash,
    parent: Option<BlockHash>,
    len: u64,
    checksum: u128,
}

impl Header {
    fn encode(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[0..8].copy_from_slice(MAGIC);
        h[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        h[12..16].copy_from_slice(&u32::from(self.parent.is_some()).to_le_bytes());
        h[16..32].copy_from_slice(&self.fingerprint.to_le_bytes());
        h[32..40].copy_from_slice(&self.hash.0.to_le_bytes());
        h[40..48].copy_from_slice(&self.parent.map_or(0, |p| p.0).to_le_bytes());
        h[48..56].copy_from_slice(&self.len.to_le_bytes());
        h[56..72].copy_from_slice(&self.checksum.to_le_bytes());
        let sum = xxh3_64(&h[..72]);
        h[72..80].copy_from_slice(&sum.to_le_bytes());
        h
    }

    fn decode(h: &[u8; HEADER]) -> Result<Header, &'static str> {
        let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
        let u128_at = |i: usize| u128::from_le_bytes(h[i..i + 16].try_into().expect("16 bytes"));
        if &h[0..8] != MAGIC {
            return Err("not a cleave KV entry (magic)");
        }
        if u32_at(8) != FORMAT_VERSION {
            return Err("unknown format version");
        }
        if u64_at(72) != xxh3_64(&h[..72]) {
            return Err("header checksum mismatch");
        }
        Ok(Header {
            fingerprint: u128_at(16),
            hash: BlockHash(u64_at(32)),
            parent: (u32_at(12) & 1 == 1).then(|| BlockHash(u64_at(40))),
            len: u64_at(48),
            checksum: u128_at(56),
        })
    }
}

fn file_name(hash: BlockHash) -> String {
    format!("{:016x}.kv", hash.0)
}

/// The hash a file name stands for (`None` for other files).
fn name_hash(name: &str) -> Option<BlockHash> {
    let hex = name.strip_suffix(".kv")?;
    (hex.len() == 16)
        .then(|| u64::from_str_radix(hex, 16).ok())
        .flatten()
        .map(BlockHash)
}

enum Job {
    Write {
        hash: BlockHash,
        parent: Option<BlockHash>,
        data: Arc<[u8]>,
    },
    Remove(BlockHash),
    Flush(mpsc::Sender<()>),
}

/// An indexed entry.
#[derive(Clone, Copy, Debug)]
struct Entry {
    parent: Option<BlockHash>,
}

/// Most slots one directory may hold.
const MAX_SLOTS: usize = 256;

/// Claims a slot of `base` for `fingerprint` (see the module docs): its directory and the
/// locked file that holds it.
fn claim_slot(base: &Path, fingerprint: u128) -> Result<(PathBuf, fs::File), DiskError> {
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DiskError::Io { path, source }
    };
    fs::create_dir_all(base).map_err(io_err(base))?;
    let ours = format!("{fingerprint:032x}\n");
    // First pass: free slots with our fingerprint; second: free unmarked (or new) slots.
    for pass in 0..2 {
        for n in 0..MAX_SLOTS {
            let dir = base.join(format!("slot-{n}"));
            let mark = fs::read_to_string(dir.join("fingerprint")).ok();
            let wanted = match pass {
                0 => mark.as_deref() == Some(ours.as_str()),
                _ => mark.is_none(),
            };
            if !wanted {
                continue;
            }
            fs::create_dir_all(&dir).map_err(io_err(&dir))?;
            let lock_path = dir.join("lock");
            let lock = fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&lock_path)
                .map_err(io_err(&lock_path))?;
            match lock.try_lock() {
                Ok(()) => {}
                Err(fs::TryLockError::WouldBlock) => continue,
                Err(fs::TryLockError::Error(e)) => return Err(io_err(&lock_path)(e)),
            }
            let mark_path = dir.join("fingerprint");
            fs::write(&mark_path, &ours).map_err(io_err(&mark_path))?;
            return Ok((dir, lock));
        }
    }
    Err(DiskError::Io {
        path: base.to_path_buf(),
        source: io::Error::other(format!(
            "all {MAX_SLOTS} slots are taken by running workers or another model"
        )),
    })
}

/// The disk tier of one worker (see the module docs).
#[derive(Debug)]
pub struct DiskTier {
    /// The claimed slot and its lock (released when the tier is dropped).
    dir: PathBuf,
    _lock: fs::File,
    fingerprint: u128,
    block_bytes: usize,
    max_bytes: u64,
    index: Lru<Entry>,
    refused: u64,
    jobs: Option<mpsc::Sender<Job>>,
    writer: Option<JoinHandle<()>>,
}

impl DiskTier {
    /// Claims a slot of `config.dir` (creating it) and indexes the slot's valid entries for
    /// this fingerprint.
    pub fn open(
        config: &DiskConfig,
        fingerprint: u128,
        block_bytes: usize,
    ) -> Result<Self, DiskError> {
        let (dir, lock) = claim_slot(&config.dir, fingerprint)?;
        let io_err = |source| DiskError::Io {
            path: dir.clone(),
            source,
        };
        let (tx, rx) = mpsc::channel();
        let writer_dir = dir.clone();
        let writer = std::thread::Builder::new()
            .name("cleave-kv-disk".into())
            .spawn(move || write_loop(&writer_dir, fingerprint, rx))
            .map_err(io_err)?;
        let mut t = DiskTier {
            dir,
            _lock: lock,
            fingerprint,
            block_bytes,
            max_bytes: config.max_bytes,
            index: Lru::default(),
            refused: 0,
            jobs: Some(tx),
            writer: Some(writer),
        };
        t.scan()?;
        Ok(t)
    }

    /// Indexes the directory's entries, oldest first; deletes bad ones and temporary files.
    fn scan(&mut self) -> Result<(), DiskError> {
        let rd = fs::read_dir(&self.dir).map_err(|source| DiskError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let mut found = Vec::new();
        for e in rd.flatten() {
            let path = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(hash) = name_hash(&name) else {
                continue;
            };
            match self.check_header(&path, hash) {
                Ok(Some(h)) => {
                    let mtime = e.metadata().and_then(|m| m.modified()).ok();
                    found.push((mtime, hash, h.parent));
                }
                Ok(None) => {} // another fingerprint's entry: not ours, left alone
                Err(why) => {
                    tracing::warn!(path = %path.display(), "KV disk entry refused: {why}");
                    self.refused += 1;
                    let _ = fs::remove_file(&path);
                }
            }
        }
        found.sort_by_key(|f| f.0);
        for (_, hash, parent) in found {
            self.index.insert(hash, Entry { parent });
        }
        while self.used() > self.max_bytes {
            let Some((h, _)) = self.index.pop_oldest() else {
                break;
            };
            let _ = fs::remove_file(self.dir.join(file_name(h)));
        }
        Ok(())
    }

    /// The header of `path` if it is a valid entry of this tier for `hash`; `Ok(None)` for an
    /// entry of another fingerprint.
    fn check_header(&self, path: &Path, hash: BlockHash) -> Result<Option<Header>, &'static str> {
        let mut f = fs::File::open(path).map_err(|_| "cannot open")?;
        let mut h = [0u8; HEADER];
        f.read_exact(&mut h).map_err(|_| "truncated header")?;
        let h = Header::decode(&h)?;
        if h.fingerprint != self.fingerprint {
            return Ok(None);
        }
        if h.hash != hash {
            return Err("hash does not match the file name");
        }
        if h.len != self.block_bytes as u64 {
            return Err("payload is not one block");
        }
        let size = f.metadata().map_err(|_| "cannot stat")?.len();
        if size != (HEADER as u64) + h.len {
            return Err("file length does not match its header (truncated?)");
        }
        Ok(Some(h))
    }

    fn entry_bytes(&self) -> u64 {
        (HEADER + self.block_bytes) as u64
    }

    fn used(&self) -> u64 {
        self.index.len() as u64 * self.entry_bytes()
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.index.get(hash).is_some()
    }

    pub fn touch(&mut self, hash: BlockHash) {
        self.index.touch(hash);
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.len() == 0
    }

    /// Entries refused at start.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Indexed hashes with their parents, least recently used first.
    pub fn entries(&self) -> impl Iterator<Item = (BlockHash, Option<BlockHash>)> + '_ {
        self.index.iter().map(|(h, e)| (h, e.parent))
    }

    /// The checked bytes of `hash`; `Ok(None)` if not indexed. A bad entry is deleted and
    /// unindexed, and the error says why.
    pub fn read(&mut self, hash: BlockHash) -> Result<Option<Vec<u8>>, DiskError> {
        if !self.contains(hash) {
            return Ok(None);
        }
        let path = self.dir.join(file_name(hash));
        let mut got = fs::read(&path);
        if matches!(&got, Err(e) if e.kind() == io::ErrorKind::NotFound) {
            // Indexed when handed to the writer: it may not be written yet.
            self.flush();
            got = fs::read(&path);
        }
        let checked = match got {
            Ok(bytes) => self.check(&path, hash, bytes),
            Err(source) => Err(DiskError::Io { path, source }),
        };
        match checked {
            Ok(data) => {
                self.index.touch(hash);
                Ok(Some(data))
            }
            Err(e) => {
                self.index.remove(hash);
                self.send(Job::Remove(hash));
                Err(e)
            }
        }
    }

    /// The payload of a whole entry's `bytes` if every check passes.
    fn check(
        &self,
        path: &Path,
        hash: BlockHash,
        mut bytes: Vec<u8>,
    ) -> Result<Vec<u8>, DiskError> {
        let invalid = |why| DiskError::Invalid {
            path: path.to_path_buf(),
            why,
        };
        let head: &[u8; HEADER] = bytes
            .get(..HEADER)
            .and_then(|h| h.try_into().ok())
            .ok_or(invalid("truncated header"))?;
        let h = Header::decode(head).map_err(invalid)?;
        if h.fingerprint != self.fingerprint {
            return Err(invalid(
                "written for another model, KV type, block size or rank",
            ));
        }
        if h.hash != hash {
            return Err(invalid("hash does not match the file name"));
        }
        if h.len != self.block_bytes as u64 || bytes.len() != HEADER + self.block_bytes {
            return Err(invalid("length does not match one block (truncated?)"));
        }
        if xxh3_128(&bytes[HEADER..]) != h.checksum {
            return Err(invalid("payload checksum mismatch"));
        }
        bytes.drain(..HEADER);
        Ok(bytes)
    }

    /// Indexes `hash` and hands its bytes to the writer; returns the hashes evicted to stay
    /// within capacity (possibly `hash` itself, if one entry does not fit).
    pub fn write(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        data: Arc<[u8]>,
    ) -> Vec<BlockHash> {
        self.index.insert(hash, Entry { parent });
        self.send(Job::Write { hash, parent, data });
        let mut evicted = Vec::new();
        while self.used() > self.max_bytes {
            let Some((h, _)) = self.index.pop_oldest() else {
                break;
            };
            self.send(Job::Remove(h));
            evicted.push(h);
        }
        evicted
    }

    fn send(&self, job: Job) {
        if let Some(tx) = &self.jobs {
            let _ = tx.send(job);
        }
    }

    /// Waits for the writer to finish every job sent so far.
    pub fn flush(&self) {
        let (tx, rx) = mpsc::channel();
        self.send(Job::Flush(tx));
        let _ = rx.recv();
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // The writer finishes its queue, then exits.
        drop(self.jobs.take());
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// The writer thread: writes (temporary name, then rename) and removes entries in order.
fn write_loop(dir: &Path, fingerprint: u128, jobs: mpsc::Receiver<Job>) {
    for job in jobs {
        match job {
            Job::Write { hash, parent, data } => {
                let header = Header {
                    fingerprint,
                    hash,
                    parent,
                    len: data.len() as u64,
                    checksum: xxh3_128(&data),
                };
                if let Err(e) = write_entry(dir, &header, &data) {
                    tracing::warn!(hash = hash.0, "KV disk write failed: {e}");
                }
            }
            Job::Remove(hash) => {
                let _ = fs::remove_file(dir.join(file_name(hash)));
            }
            Job::Flush(done) => {
                let _ = done.send(());
            }
        }
    }
}

fn write_entry(dir: &Path, header: &Header, data: &[u8]) -> io::Result<()> {
    let name = file_name(header.hash);
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = fs::File::create(&tmp)?;
    f.write_all(&header.encode())?;
    f.write_all(data)?;
    drop(f);
    fs::rename(&tmp, dir.join(name))
}
