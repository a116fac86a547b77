//! How large a worker's KV pool is: `--kv-blocks N` when given, else `--kv-memory` — a size
//! (`4GiB`, `512MiB`, `8G`; Kubernetes' binary and decimal suffixes) or `auto`: one sequence of
//! the model's whole context, up to [`AUTO_CONTEXT_CAP`] tokens (llama.cpp's `-c` sizes its
//! cache the same way: tokens of context, not a fixed count of blocks).
//!
//! The size is the whole model's KV: the ranks of a tensor- or expert-parallel group each hold
//! their heads' share of every block, so every rank computes the same block count.

use std::fmt;
use std::str::FromStr;

/// Most tokens `auto` reserves: the long-context target of the 8B shape (32 GiB of f32 KV at
/// 128k context would not fit beside the weights of the machines cleave runs on).
pub const AUTO_CONTEXT_CAP: usize = 32_768;

/// `--kv-memory`: `auto` or a byte size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvMemory {
    /// One sequence of the model's context, up to [`AUTO_CONTEXT_CAP`] tokens.
    Auto,
    /// This many bytes of KV for the whole model.
    Bytes(u64),
}

impl FromStr for KvMemory {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s.trim().eq_ignore_ascii_case("auto") {
            return Ok(KvMemory::Auto);
        }
        let size: bytesize::ByteSize = s.trim().parse().map_err(|_| {
            format!("invalid KV memory {s:?}: expected auto or a size such as 4GiB, 512MiB or 8G")
        })?;
        Ok(KvMemory::Bytes(size.as_u64()))
    }
}

impl fmt::Display for KvMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvMemory::Auto => f.write_str("auto"),
            KvMemory::Bytes(b) => write!(f, "{b}"),
        }
    }
}

/// The model's KV geometry that sizing needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Bytes of one block of the whole model (all layers, keys and values, every KV head).
    pub block_bytes: usize,
    /// Tokens per block.
    pub block_tokens: usize,
    /// The longest sequence the model serves (its context length, or a lower limit).
    pub context_tokens: usize,
}

/// Why a pool size was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvPoolError {
    /// `--kv-blocks 0`.
    #[error("--kv-blocks must be at least 1")]
    NoBlocks,
    /// A `--kv-memory` smaller than one block.
    #[error(
        "--kv-memory {bytes} bytes holds no KV block of this model ({block_bytes} bytes per block \
         of {block_tokens} tokens)"
    )]
    TooSmall {
        bytes: u64,
        block_bytes: usize,
        block_tokens: usize,
    },
}

/// The pool's block count from `--kv-blocks` (wins when given) or `--kv-memory`.
pub fn pool_blocks(
    kv_blocks: Option<usize>,
    memory: KvMemory,
    shape: KvShape,
) -> Result<usize, KvPoolError> {
    if let Some(n) = kv_blocks {
        return if n == 0 {
            Err(KvPoolError::NoBlocks)
        } else {
            Ok(n)
        };
    }
    match memory {
        KvMemory::Auto => {
            let tokens = shape.context_tokens.clamp(1, AUTO_CONTEXT_CAP);
            Ok(tokens.div_ceil(shape.block_tokens.max(1)))
        }
        KvMemory::Bytes(bytes) => {
            let n = bytes / shape.block_bytes.max(1) as u64;
            if n == 0 {
                return Err(KvPoolError::TooSmall {
                    bytes,
                    block_bytes: shape.block_bytes,
                    block_tokens: shape.block_tokens,
                });
            }
            Ok(usize::try_from(n).unwrap_or(usize::MAX))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M, f32: 30 layers × 2 × 3 heads × 64 × 16 tokens × 4 bytes; 8,192 context.
    const SMOL: KvShape = KvShape {
        block_bytes: 30 * 2 * 3 * 64 * 16 * 4,
        block_tokens: 16,
        context_tokens: 8192,
    };

    #[test]
    fn auto_holds_one_whole_context_up_to_the_cap() {
        // The default model keeps the 512 blocks it had when the count was fixed.
        assert_eq!(pool_blocks(None, KvMemory::Auto, SMOL), Ok(512));
        let long = KvShape {
            context_tokens: 131_072,
            ..SMOL
        };
        assert_eq!(pool_blocks(None, KvMemory::Auto, long), Ok(2048));
        let odd = KvShape {
            context_tokens: 1000,
            ..SMOL
        };
        assert_eq!(pool_blocks(None, KvMemory::Auto, odd), Ok(63));
    }

    #[test]
    fn a_size_is_divided_by_the_whole_models_block_bytes_and_kv_blocks_wins() {
        let m: KvMemory = "1GiB".parse().unwrap();
        assert_eq!(m, KvMemory::Bytes(1 << 30));
        assert_eq!(pool_blocks(None, m, SMOL), Ok((1 << 30) / SMOL.block_bytes));
        assert_eq!(pool_blocks(Some(7), m, SMOL), Ok(7));
        assert_eq!(pool_blocks(Some(0), m, SMOL), Err(KvPoolError::NoBlocks));
        let e = pool_blocks(None, "1KiB".parse().unwrap(), SMOL).unwrap_err();
        assert!(e.to_string().contains("holds no KV block"), "{e}");
    }

    #[test]
    fn sizes_parse_with_binary_and_decimal_suffixes_and_bad_ones_name_the_value() {
        assert_eq!("512MiB".parse(), Ok(KvMemory::Bytes(512 << 20)));
        assert_eq!("512Mi".parse(), Ok(KvMemory::Bytes(512 << 20)));
        assert_eq!("8G".parse(), Ok(KvMemory::Bytes(8_000_000_000)));
        assert_eq!("AUTO".parse(), Ok(KvMemory::Auto));
        let e = "lots".parse::<KvMemory>().unwrap_err();
        assert!(e.contains("\"lots\"") && e.contains("auto"), "{e}");
        assert_eq!(
            KvMemory::Bytes(42).to_string().parse(),
            Ok(KvMemory::Bytes(42))
        );
    }
}
