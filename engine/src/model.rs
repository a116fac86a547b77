//! The transformer forward pass over a batch of sequence chunks.
//!
//! One call runs any mix of prefill chunks and decode tokens: all tokens go through each linear
//! layer together (so weights are read once per step), and each token attends over its own
//! sequence's paged KV. The result for a token never depends on the rest of the batch.

pub mod attention;
pub mod config;
pub mod forward;
mod gguf_moe;
pub mod hf;
pub mod moe;
pub mod ops;
pub mod reference;
pub mod score;
mod tensors;
pub mod weights;

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::kernels::{KernelError, Threads};
use crate::kv::memory::{KvDtype, KvLayout};
use cleave_text::gguf::{GgufError, GgufFile};
use cleave_types::collective::{Collective, SingleRank};

pub use config::{
    Activation, Arch, ArchOptions, ModelConfig, MoeConfig, RopeScaling, RopeStyle, SlidingWindow,
};
pub use forward::{Logits, SeqChunk, Workspace};
pub use weights::{Shard, Weights};

/// Errors loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The GGUF file could not be read.
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A weight could not be prepared for the kernels.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// `general.architecture` names a model family this engine does not implement.
    #[error("unsupported architecture {0:?} (supported: llama, mistral, qwen2, qwen3, qwen2moe, qwen3moe, gemma, gemma2, gemma3, phi3)")]
    UnsupportedArch(String),
    /// A weight is stored in a format the kernels cannot use.
    #[error("tensor {name} has unsupported type {ty} (supported: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, iq4_nl, q2_K, q3_K, q4_K, q5_K, q6_K)")]
    UnsupportedTensorType {
        /// The tensor.
        name: String,
        /// Its GGML type.
        ty: String,
    },
    /// A weight has the wrong shape.
    #[error("tensor {name}: {why}")]
    BadTensor {
        /// The tensor.
        name: String,
        /// What is wrong.
        why: String,
    },
    /// The hyper-parameters are inconsistent.
    #[error("bad model configuration: {0}")]
    BadConfig(String),
    /// A safetensors checkpoint could not be read.
    #[error(transparent)]
    Safetensors(#[from] cleave_text::safetensors::SafetensorsError),
    /// A Hugging Face `config.json` is missing, malformed or describes an unsupported model.
    #[error("{path}: {why}")]
    HfConfig {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// A loaded model: configuration, this rank's weights and the group it computes with.
pub struct Model {
    /// Hyper-parameters.
    pub config: ModelConfig,
    weights: Weights,
    collective: Arc<dyn Collective>,
    threads: Threads,
    /// Tokens routed to each expert, `layer * n_experts + expert` (MoE models).
    expert_tokens: Vec<AtomicU64>,
}

impl Model {
    /// Loads rank `collective.rank()` of `collective.world()` from a GGUF file.
    pub fn load(
        g: &GgufFile,
        collective: Arc<dyn Collective>,
        threads: Threads,
    ) -> Result<Self, ModelError> {
        let config = ModelConfig::from_gguf(g)?;
        let shard = Shard {
            rank: collective.rank(),
            world: collective.world(),
        };
        let weights = Weights::load(g, &config, shard)?;
        Ok(Self::assemble(config, weights, collective, threads))
    }

    /// Loads rank `collective.rank()` of `collective.world()` from a Hugging Face model
    /// directory (`config.json` plus safetensors): this rank's heads, FFN slices, vocabulary
    /// slice and (MoE) experts only.
    pub fn load_hf(
        dir: &Path,
        collective: Arc<dyn Collective>,
        threads: Threads,
    ) -> Result<Self, ModelError> {
        let config = hf::read_config(dir)?;
        let st = cleave_text::safetensors::SafeTensors::open_dir(dir)?;
        let shard = Shard {
            rank: collective.rank(),
            world: collective.world(),
        };
        let weights = hf::load_weights(&st, &config, shard)?;
        Ok(Self::assemble(config, weights, collective, threads))
    }

    fn assemble(
        config: ModelConfig,
        weights: Weights,
        collective: Arc<dyn Collective>,
        threads: Threads,
    ) -> Self {
        let n = config
            .moe
            .as_ref()
            .map_or(0, |m| m.n_experts * config.n_layers);
        Model {
            config,
            weights,
            collective,
            threads,
            expert_tokens: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Loads the whole model into this process from a GGUF path.
    pub fn open(path: &Path, threads: Threads) -> Result<Self, ModelError> {
        let g = GgufFile::open(path)?;
        Self::load(&g, Arc::new(SingleRank), threads)
    }

    /// Query heads computed by this rank.
    pub fn local_heads(&self) -> usize {
        self.config.n_heads / self.collective.world()
    }

    /// Key/value heads held by this rank (the KV layout's head count).
    pub fn local_kv_heads(&self) -> usize {
        self.config.n_kv_heads / self.collective.world()
    }

    /// The layout of this rank's KV cache for blocks of `block_size` tokens stored as `dtype`.
    pub fn kv_layout(&self, block_size: usize, dtype: KvDtype) -> KvLayout {
        KvLayout {
            n_layers: self.config.n_layers,
            n_kv_heads: self.local_kv_heads(),
            head_dim: self.config.head_dim,
            block_size,
            dtype,
        }
    }
}
