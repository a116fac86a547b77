//! From an engine's block chains to the router's own block hashes.
//!
//! The router does not recompute vLLM's block hash (it depends on the release's hash function,
//! a per-process random `NONE_HASH` unless `PYTHONHASHSEED` is set, LoRA names, multimodal
//! hashes and cache salts). Instead, like llm-d's indexer, it uses the token ids that every
//! `BlockStored` carries: each engine block's hash is an opaque id mapped to the *router's*
//! chained XXH3 hashes of the same tokens (`cleave_types::kv::next_block_hash`, router block
//! size, 16 by default), so requests are looked up with the hashes the router already computes.
//!
//! Per engine block the map keeps the chain state after it (the router hash of the last full
//! router block, and the tokens since then when the engine's block size is not a multiple of
//! the router's), the router hashes that complete inside it, and the media it is held in. A
//! router hash is held while any engine block completing it is held in any medium (reference
//! counts), so GPU and CPU copies, or a re-store, never remove a block early. A router block
//! spanning several engine blocks goes when the one that completes it goes: engines evict
//! leaf-first, so that is the first of them to go.
//!
//! Not indexed (their chains cannot be matched by a plain token prompt, and skipping them can
//! only under-report): blocks of a LoRA adapter, blocks with extra hash keys (multimodal inputs,
//! cache salt) and everything after them in their chain, blocks of another KV cache group than
//! the configured one, and blocks whose parent the router never saw (a chain it joined midway).

use std::collections::HashMap;

use cleave_types::kv::{next_block_hash, BlockHash};
use smallvec::SmallVec;

use super::wire::{BlockStored, EngineHash};

/// How engine blocks map to router hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChainConfig {
    /// Tokens per router block (the router's `BLOCK_SIZE`).
    pub block_size: usize,
    /// The salt of the router's block hashes (0: none).
    pub salt: u64,
    /// The KV cache group indexed (events without a group count as group 0).
    pub group: i64,
}

impl Default for ChainConfig {
    fn default() -> Self {
        Self {
            block_size: crate::dispatch::BLOCK_SIZE,
            salt: 0,
            group: 0,
        }
    }
}

/// Counts of blocks not indexed, by reason (for logs and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Skipped {
    /// Blocks whose parent was unknown.
    pub orphans: u64,
    /// Blocks of a LoRA adapter.
    pub adapter: u64,
    /// Blocks with extra hash keys, and the rest of their chain.
    pub extra_keys: u64,
    /// Blocks of another KV cache group.
    pub other_group: u64,
}

#[derive(Debug)]
struct EngineBlock {
    /// The router hash of the last full router block at the end of this block.
    seq: Option<BlockHash>,
    /// Tokens after that router block.
    tail: Box<[u32]>,
    /// Router hashes completed inside this block.
    completes: SmallVec<[BlockHash; 1]>,
    /// Media holding it (bit per interned medium).
    media: u8,
}

/// One pod's engine blocks, mapped to router hashes.
#[derive(Debug, Default)]
pub struct PodChains {
    config: ChainConfig,
    media: Vec<Option<String>>,
    blocks: HashMap<EngineHash, EngineBlock>,
    held: HashMap<BlockHash, u32>,
    /// What was not indexed.
    pub skipped: Skipped,
}

impl PodChains {
    /// An empty map with `config` (a zero block size is taken as 1).
    pub fn new(mut config: ChainConfig) -> Self {
        config.block_size = config.block_size.max(1);
        Self {
            config,
            ..Default::default()
        }
    }

    /// Router hashes held (distinct).
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Engine blocks known.
    pub fn engine_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The router hashes held.
    pub fn held_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.held.keys().copied()
    }

    /// Whether the router hash `h` is held.
    pub fn holds(&self, h: BlockHash) -> bool {
        self.held.contains_key(&h)
    }

    /// Applies a store; returns the router hashes that became held.
    pub fn stored(&mut self, ev: &BlockStored) -> Vec<BlockHash> {
        let n = ev.block_hashes.len() as u64;
        if ev.group_idx.unwrap_or(0) != self.config.group {
            self.skipped.other_group += n;
            return Vec::new();
        }
        if ev.lora_id.is_some() || ev.lora_name.is_some() {
            self.skipped.adapter += n;
            return Vec::new();
        }
        let (mut seq, mut tail): (Option<BlockHash>, Vec<u32>) = match &ev.parent {
            None => (None, Vec::new()),
            Some(p) => match self.blocks.get(p) {
                Some(b) => (b.seq, b.tail.to_vec()),
                None => {
                    self.skipped.orphans += n;
                    return Vec::new();
                }
            },
        };
        let bit = self.medium_bit(ev.medium.as_deref());
        let size = self.config.block_size;
        let mut out = Vec::new();
        for (i, (hash, tokens)) in ev
            .block_hashes
            .iter()
            .zip(ev.token_ids.chunks_exact(ev.block_size))
            .enumerate()
        {
            if ev.extra_keys.get(i).copied().unwrap_or(false) {
                self.skipped.extra_keys += n - i as u64;
                break;
            }
            if let Some(b) = self.blocks.get_mut(hash) {
                // Known already (another medium, or stored again): same chain state.
                b.media |= bit;
                seq = b.seq;
                tail = b.tail.to_vec();
                continue;
            }
            tail.extend_from_slice(tokens);
            let mut completes = SmallVec::new();
            let mut start = 0;
            while tail.len() - start >= size {
                let h = next_block_hash(seq, &tail[start..start + size], self.config.salt);
                seq = Some(h);
                completes.push(h);
                start += size;
            }
            tail.drain(..start);
            for &h in &completes {
                let count = self.held.entry(h).or_insert(0);
                *count += 1;
                if *count == 1 {
                    out.push(h);
                }
            }
            self.blocks.insert(
                hash.clone(),
                EngineBlock {
                    seq,
                    tail: tail.clone().into_boxed_slice(),
                    completes,
                    media: bit,
                },
            );
        }
        out
    }

    /// Applies a removal from `medium` (`None`: the engine did not say); returns the router
    /// hashes no longer held. Unknown hashes and other groups are ignored.
    pub fn removed(
        &mut self,
        hashes: &[EngineHash],
        medium: Option<&str>,
        group_idx: Option<i64>,
    ) -> Vec<BlockHash> {
        if group_idx.unwrap_or(0) != self.config.group {
            return Vec::new();
        }
        let bit = self.medium_bit(medium);
        let mut out = Vec::new();
        for h in hashes {
            let Some(b) = self.blocks.get_mut(h) else {
                continue;
            };
            b.media &= !bit;
            if b.media != 0 {
                continue;
            }
            let Some(b) = self.blocks.remove(h) else {
                continue;
            };
            for c in b.completes {
                if let Some(count) = self.held.get_mut(&c) {
                    *count -= 1;
                    if *count == 0 {
                        self.held.remove(&c);
                        out.push(c);
                    }
                }
            }
        }
        out
    }

    /// Forgets every block (`AllBlocksCleared`, or the engine restarted).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.held.clear();
    }

    /// The bit of `medium`; media beyond the eighth share the last bit.
    fn medium_bit(&mut self, medium: Option<&str>) -> u8 {
        let i = match self.media.iter().position(|m| m.as_deref() == medium) {
            Some(i) => i,
            None if self.media.len() < 8 => {
                self.media.push(medium.map(str::to_string));
                self.media.len() - 1
            }
            None => 7,
        };
        1 << i
    }
}

#[cfg(test)]
mod tests {
    use cleave_types::kv::block_hashes;

    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, size: usize) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
            parent: parent.map(EngineHash::Int),
            token_ids: tokens,
            block_size: size,
            medium: Some("GPU".into()),
            ..Default::default()
        }
    }

    fn ints(hs: &[u64]) -> Vec<EngineHash> {
        hs.iter().map(|&h| EngineHash::Int(h)).collect()
    }

    #[test]
    fn same_size_blocks_map_one_to_one_onto_router_hashes() {
        let tokens: Vec<u32> = (0..48).collect();
        let want = block_hashes(&tokens, 16, 0);
        let mut c = PodChains::new(ChainConfig::default());
        assert_eq!(
            c.stored(&stored(&[7, 8], None, tokens[..32].to_vec(), 16)),
            want[..2]
        );
        assert_eq!(
            c.stored(&stored(&[9], Some(8), tokens[32..].to_vec(), 16)),
            want[2..]
        );
        assert_eq!(c.removed(&ints(&[9]), Some("GPU"), None), want[2..]);
        assert_eq!(c.held(), 2);
    }

    #[test]
    fn engine_blocks_smaller_or_larger_than_router_blocks_chain_the_same() {
        let tokens: Vec<u32> = (1000..1064).collect();
        let want = block_hashes(&tokens, 16, 0);
        // SGLang-style pages of 4 tokens: a router block completes every 4th engine block.
        let mut small = PodChains::new(ChainConfig::default());
        let mut got = Vec::new();
        let mut parent = None;
        for (i, chunk) in tokens.chunks(4).enumerate() {
            got.extend(small.stored(&stored(&[i as u64], parent, chunk.to_vec(), 4)));
            parent = Some(i as u64);
        }
        assert_eq!(got, want);
        // Removing the leaf engine block drops the router block it completed.
        assert_eq!(small.removed(&ints(&[15]), Some("GPU"), None), want[3..]);
        // 64-token engine blocks: one engine block completes four router blocks.
        let mut big = PodChains::new(ChainConfig::default());
        assert_eq!(big.stored(&stored(&[1], None, tokens.clone(), 64)), want);
        assert_eq!(big.removed(&ints(&[1]), Some("GPU"), None), want);
        assert_eq!(big.held(), 0);
    }

    #[test]
    fn copies_in_two_media_are_held_until_both_go() {
        let tokens: Vec<u32> = (0..16).collect();
        let mut c = PodChains::new(ChainConfig::default());
        let gpu = stored(&[5], None, tokens.clone(), 16);
        let mut cpu = gpu.clone();
        cpu.medium = Some("CPU".into());
        assert_eq!(c.stored(&gpu).len(), 1);
        assert!(c.stored(&cpu).is_empty(), "already held");
        assert!(c.removed(&ints(&[5]), Some("GPU"), None).is_empty());
        assert_eq!(c.removed(&ints(&[5]), Some("CPU"), None).len(), 1);
        assert_eq!(c.engine_blocks(), 0);
    }

    #[test]
    fn unindexable_blocks_are_skipped_and_counted() {
        let tokens: Vec<u32> = (0..32).collect();
        let mut c = PodChains::new(ChainConfig::default());
        let mut lora = stored(&[1, 2], None, tokens.clone(), 16);
        lora.lora_name = Some("adapter".into());
        assert!(c.stored(&lora).is_empty());
        let mut mm = stored(&[3, 4], None, tokens.clone(), 16);
        mm.extra_keys = vec![false, true];
        assert_eq!(c.stored(&mm).len(), 1, "the block before the extra keys");
        let mut other = stored(&[5], None, tokens[..16].to_vec(), 16);
        other.group_idx = Some(1);
        assert!(c.stored(&other).is_empty());
        assert!(c
            .stored(&stored(&[6], Some(99), tokens[..16].to_vec(), 16))
            .is_empty());
        assert_eq!(
            c.skipped,
            Skipped {
                orphans: 1,
                adapter: 2,
                extra_keys: 1,
                other_group: 1
            }
        );
        // The child of a skipped block is an orphan too (its parent was never recorded).
        assert!(c
            .stored(&stored(&[7], Some(4), tokens[16..].to_vec(), 16))
            .is_empty());
        assert_eq!(c.skipped.orphans, 2);
    }
}
