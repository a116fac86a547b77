//! Chained block hashes of the prefix cache, compatible with NVIDIA Dynamo.
//!
//! For the blocks `b[0], b[1], ...` of a token sequence (each exactly `block_size` tokens; a
//! trailing partial block is never hashed):
//!
//! ```text
//! seed     = 1337                                  if salt == 0
//!          = XXH3-64(seed 1337, le_u64(salt))      otherwise
//! local[i] = XXH3-64(seed, le_u32(t) for t in b[i])
//! seq[0]   = local[0]
//! seq[i]   = XXH3-64(seed, le_u64(seq[i-1]) ‖ le_u64(local[i]))
//! ```
//!
//! `seq[i]` is the [`BlockHash`] of block `i`: it depends on every token up to the end of that
//! block, so two sequences share a block hash only if they share the whole prefix. The salt
//! separates caches that must not mix (e.g. different adapters or tenants).

use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::BlockHash;

/// Seed used when the salt is 0 (Dynamo's `XXH3_SEED`).
pub const BASE_SEED: u64 = 1337;

/// The XXH3 seed for `salt`.
pub fn seed_for_salt(salt: u64) -> u64 {
    if salt == 0 {
        BASE_SEED
    } else {
        xxh3_64_with_seed(&salt.to_le_bytes(), BASE_SEED)
    }
}

/// Hash of one block's tokens alone (`local[i]` above).
pub fn local_block_hash(block_tokens: &[u32], seed: u64) -> u64 {
    let mut bytes = Vec::with_capacity(block_tokens.len() * 4);
    for t in block_tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxh3_64_with_seed(&bytes, seed)
}

/// Chains a block's local hash onto its parent's block hash.
fn chain(parent: Option<BlockHash>, local: u64, seed: u64) -> BlockHash {
    match parent {
        None => BlockHash(local),
        Some(BlockHash(p)) => {
            let mut bytes = [0u8; 16];
            bytes[..8].copy_from_slice(&p.to_le_bytes());
            bytes[8..].copy_from_slice(&local.to_le_bytes());
            BlockHash(xxh3_64_with_seed(&bytes, seed))
        }
    }
}

/// Hashes of every full block of `tokens` (`tokens.len() / block_size` of them), chained.
///
/// # Panics
/// If `block_size` is 0.
pub fn block_hashes(tokens: &[u32], block_size: usize, salt: u64) -> Vec<BlockHash> {
    assert!(block_size > 0, "block_hashes: block_size must be positive");
    let seed = seed_for_salt(salt);
    let mut out = Vec::with_capacity(tokens.len() / block_size);
    let mut parent = None;
    for block in tokens.chunks_exact(block_size) {
        let h = chain(parent, local_block_hash(block, seed), seed);
        out.push(h);
        parent = Some(h);
    }
    out
}

/// Incremental form of [`block_hashes`]: the hash of one more full block after `parent` (`None`
/// for the first block). The caller passes exactly one full block of tokens.
pub fn next_block_hash(parent: Option<BlockHash>, block_tokens: &[u32], salt: u64) -> BlockHash {
    let seed = seed_for_salt(salt);
    chain(parent, local_block_hash(block_tokens, seed), seed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn le_bytes(tokens: &[u32]) -> Vec<u8> {
        tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
    }

    #[test]
    fn known_answer_first_block() {
        let tokens: Vec<u32> = (1..=16).collect();
        let expected = xxh3_64_with_seed(&le_bytes(&tokens), 1337);
        assert_eq!(local_block_hash(&tokens, 1337), expected);
        assert_eq!(block_hashes(&tokens, 16, 0), vec![BlockHash(expected)]);
        assert_eq!(next_block_hash(None, &tokens, 0), BlockHash(expected));
    }

    #[test]
    fn known_answer_chain_and_salt() {
        let tokens: Vec<u32> = (1..=32).collect();
        let l0 = xxh3_64_with_seed(&le_bytes(&tokens[..16]), 1337);
        let l1 = xxh3_64_with_seed(&le_bytes(&tokens[16..]), 1337);
        let mut pair = l0.to_le_bytes().to_vec();
        pair.extend_from_slice(&l1.to_le_bytes());
        let s1 = xxh3_64_with_seed(&pair, 1337);
        assert_eq!(
            block_hashes(&tokens, 16, 0),
            vec![BlockHash(l0), BlockHash(s1)]
        );

        let salt = 42u64;
        let seed = xxh3_64_with_seed(&salt.to_le_bytes(), 1337);
        assert_eq!(seed_for_salt(salt), seed);
        let l0s = xxh3_64_with_seed(&le_bytes(&tokens[..16]), seed);
        assert_eq!(block_hashes(&tokens[..16], 16, salt), vec![BlockHash(l0s)]);
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let tokens: Vec<u32> = (0..47).collect();
        assert_eq!(block_hashes(&tokens, 16, 0).len(), 2);
        assert_eq!(block_hashes(&tokens[..15], 16, 0).len(), 0);
        assert_eq!(
            block_hashes(&tokens[..32], 16, 0),
            block_hashes(&tokens, 16, 0)
        );
        assert!(block_hashes(&[], 16, 0).is_empty());
    }

    #[test]
    fn hash_depends_on_every_previous_block() {
        let a: Vec<u32> = (0..64).collect();
        let mut b = a.clone();
        b[3] = 999; // inside block 0
        let ha = block_hashes(&a, 16, 0);
        let hb = block_hashes(&b, 16, 0);
        for i in 0..4 {
            assert_ne!(ha[i], hb[i], "block {i} must depend on block 0");
        }
        let mut c = a.clone();
        c[40] = 999; // inside block 2
        let hc = block_hashes(&c, 16, 0);
        assert_eq!(ha[..2], hc[..2]);
        assert_ne!(ha[2], hc[2]);
        assert_ne!(ha[3], hc[3]);
    }

    #[test]
    fn same_block_different_parent_differs() {
        let block: Vec<u32> = (100..116).collect();
        let x = next_block_hash(Some(BlockHash(1)), &block, 0);
        let y = next_block_hash(Some(BlockHash(2)), &block, 0);
        let z = next_block_hash(None, &block, 0);
        assert_ne!(x, y);
        assert_ne!(x, z);
    }

    #[test]
    fn salt_changes_hashes() {
        let tokens: Vec<u32> = (0..32).collect();
        let h0 = block_hashes(&tokens, 16, 0);
        let h1 = block_hashes(&tokens, 16, 1);
        let h2 = block_hashes(&tokens, 16, 2);
        assert_ne!(h0[0], h1[0]);
        assert_ne!(h1[0], h2[0]);
        assert_ne!(h0[1], h1[1]);
        assert_eq!(h1, block_hashes(&tokens, 16, 1));
    }

    #[test]
    #[should_panic(expected = "block_size must be positive")]
    fn zero_block_size_panics() {
        block_hashes(&[1, 2, 3], 0, 0);
    }

    proptest::proptest! {
        #[test]
        fn block_hashes_equals_fold_of_next_block_hash(
            tokens in proptest::collection::vec(proptest::num::u32::ANY, 0..200),
            block_size in 1usize..20,
            salt in proptest::prop_oneof![proptest::strategy::Just(0u64), proptest::num::u64::ANY],
        ) {
            let mut parent = None;
            let mut folded = Vec::new();
            for block in tokens.chunks_exact(block_size) {
                let h = next_block_hash(parent, block, salt);
                folded.push(h);
                parent = Some(h);
            }
            proptest::prop_assert_eq!(block_hashes(&tokens, block_size, salt), folded);
        }
    }
}
