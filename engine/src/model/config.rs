//! The model's hyper-parameters, read from GGUF metadata (`{arch}.*` keys) or from a Hugging
//! Face `config.json` ([`super::hf`]).

use crate::gguf::GgufFile;

use super::ModelError;

/// How rotary embeddings pair the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(x[2i], x[2i+1])`: llama-family GGUFs (their Q/K rows are permuted at
    /// conversion so this matches the Hugging Face model).
    Normal,
    /// Pairs `(x[i], x[i + d/2])`: qwen2/qwen3 GGUFs.
    Neox,
}

/// Architectures whose tensor names and metadata this engine understands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1/2/3, SmolLM, TinyLlama and other `llama` GGUFs.
    Llama,
    /// Mistral 7B-style GGUFs (same tensors as llama).
    Mistral,
    /// Qwen2 / Qwen2.5: biases on Q, K and V.
    Qwen2,
    /// Qwen3 (dense): RMSNorm on each Q and K head, no biases.
    Qwen3,
    /// Mixtral: llama attention, sparse MoE feed-forward (HF safetensors only).
    Mixtral,
    /// Qwen2-MoE: qwen2 attention, MoE with a gated shared expert (HF safetensors only).
    Qwen2Moe,
    /// Qwen3-MoE: qwen3 attention, MoE without shared expert (HF safetensors only).
    Qwen3Moe,
}

impl Arch {
    /// Parses `general.architecture`.
    pub fn parse(name: &str) -> Result<Self, ModelError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "mistral" => Ok(Arch::Mistral),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen2moe" => Ok(Arch::Qwen2Moe),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }

    /// The rotary pairing this architecture's GGUFs use.
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama | Arch::Mistral | Arch::Mixtral => RopeStyle::Normal,
            Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen2Moe | Arch::Qwen3Moe => RopeStyle::Neox,
        }
    }
}

/// Hyper-parameters of a decoder-only transformer.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The architecture.
    pub arch: Arch,
    /// Number of transformer blocks.
    pub n_layers: usize,
    /// Query heads.
    pub n_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_heads`).
    pub n_kv_heads: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the feed-forward layer.
    pub ffn: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Rotary base frequency.
    pub rope_theta: f32,
    /// How many dimensions of each head are rotated.
    pub rope_dim: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Vocabulary size (rows of the embedding).
    pub vocab: usize,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Rotary pairing of the stored Q/K rows (GGUF llama files are permuted, HF files not).
    pub rope_style: RopeStyle,
    /// The mixture-of-experts feed-forward, for MoE models.
    pub moe: Option<MoeConfig>,
}

/// Hyper-parameters of a sparse mixture-of-experts feed-forward.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Routed experts per MoE layer.
    pub n_experts: usize,
    /// Experts each token is sent to.
    pub top_k: usize,
    /// Width of one routed expert's SwiGLU.
    pub expert_ffn: usize,
    /// Renormalise the top-k softmax weights to sum to one (Mixtral: always; Qwen:
    /// `norm_topk_prob`).
    pub norm_topk: bool,
    /// Width of the shared expert (Qwen2-MoE), with its sigmoid gate.
    pub shared_ffn: Option<usize>,
    /// Which layers are sparse (the others use the dense `ffn`).
    pub sparse_layers: Vec<bool>,
}

impl ModelConfig {
    /// Reads the configuration from a GGUF file's metadata.
    pub fn from_gguf(g: &GgufFile) -> Result<Self, ModelError> {
        let arch_name = g.architecture()?.to_string();
        let mut arch = Arch::parse(&arch_name)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let u = |k: &str| -> Result<usize, ModelError> { Ok(g.get_u32(&key(k))? as usize) };
        let ffn =
            u("feed_forward_length").or_else(|e| u("expert_feed_forward_length").map_err(|_| e))?;
        let n_heads = u("attention.head_count")?;
        let hidden = u("embedding_length")?;
        let n_kv_heads = u("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = match g.get_u32(&key("attention.key_length")) {
            Ok(v) => v as usize,
            Err(_) => hidden / n_heads.max(1),
        };
        let vocab = match g.get_u32(&key("vocab_size")) {
            Ok(v) => v as usize,
            Err(_) => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let mut cfg = ModelConfig {
            arch,
            n_layers: u("block_count")?,
            n_heads,
            n_kv_heads,
            hidden,
            ffn,
            head_dim,
            rope_theta: g.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_dim: u("rope.dimension_count").unwrap_or(head_dim),
            rms_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            vocab,
            context_length: u("context_length").unwrap_or(2048),
            rope_style: arch.rope_style(),
            moe: None,
        };
        // llama.cpp's MoE layout: `expert_count` > 0, stacked `ffn_*_exps` tensors.
        let n_experts = u("expert_count").unwrap_or(0);
        if n_experts > 0 {
            if arch == Arch::Llama {
                arch = Arch::Mixtral;
            }
            let norm_default = arch != Arch::Qwen2Moe;
            let sparse_layers = (0..cfg.n_layers)
                .map(|i| g.tensor(&format!("blk.{i}.ffn_gate_inp.weight")).is_ok())
                .collect();
            let shared = u("expert_shared_feed_forward_length").ok();
            cfg.moe = Some(MoeConfig {
                n_experts,
                top_k: u("expert_used_count")?,
                expert_ffn: u("expert_feed_forward_length").unwrap_or(cfg.ffn),
                norm_topk: g
                    .get_bool(&key("expert_weights_norm"))
                    .unwrap_or(norm_default),
                shared_ffn: shared.filter(|&s| s > 0 && arch == Arch::Qwen2Moe),
                sparse_layers,
            });
            cfg.arch = arch;
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the cross-field rules the forward pass relies on.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |why: String| Err(ModelError::BadConfig(why));
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.n_layers == 0 {
            return bad("head and layer counts must be positive".into());
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return bad(format!(
                "head_count {} is not a multiple of head_count_kv {}",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return bad(format!(
                "rope dimension {} does not fit head dimension {}",
                self.rope_dim, self.head_dim
            ));
        }
        if let Some(m) = &self.moe {
            if m.top_k == 0 || m.top_k > m.n_experts {
                return bad(format!(
                    "experts per token {} must be in 1..={}",
                    m.top_k, m.n_experts
                ));
            }
            if m.sparse_layers.len() != self.n_layers {
                return bad("sparse layer map does not cover every layer".into());
            }
        }
        Ok(())
    }

    /// Query heads that share one key/value head.
    pub fn group_size(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}
