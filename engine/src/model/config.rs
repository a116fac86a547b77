//! The model's hyper-parameters, read from GGUF metadata (`{arch}.*` keys) or from a Hugging
//! Face `config.json` ([`super::hf`]).

use cleave_text::gguf::GgufFile;

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
    /// Gemma: embeddings scaled by sqrt(hidden), GELU-tanh gating, tied LM head.
    Gemma,
    /// Gemma 2: Gemma plus post-attention/post-FFN norms, attention and final logit
    /// soft-capping, and sliding-window attention on every other layer.
    Gemma2,
    /// Gemma 3: Gemma 2's block with Q/K head norms instead of attention soft-capping, five
    /// sliding-window layers (own RoPE base) per global one.
    Gemma3,
    /// Phi-3: fused QKV and gate/up projections, optional LongRoPE frequency factors.
    Phi3,
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
            "gemma" => Ok(Arch::Gemma),
            "gemma2" => Ok(Arch::Gemma2),
            "gemma3" => Ok(Arch::Gemma3),
            "phi3" => Ok(Arch::Phi3),
            other => Err(ModelError::UnsupportedArch(other.to_string())),
        }
    }

    /// The rotary pairing this architecture's GGUFs use.
    pub fn rope_style(self) -> RopeStyle {
        match self {
            Arch::Llama | Arch::Mistral | Arch::Mixtral => RopeStyle::Normal,
            Arch::Qwen2
            | Arch::Qwen3
            | Arch::Qwen2Moe
            | Arch::Qwen3Moe
            | Arch::Gemma
            | Arch::Gemma2
            | Arch::Gemma3
            | Arch::Phi3 => RopeStyle::Neox,
        }
    }

    /// Whether this is one of the Gemma family (scaled embeddings, GELU gating).
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma | Arch::Gemma2 | Arch::Gemma3)
    }
}

/// The feed-forward's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU): Llama, Qwen, Phi-3.
    Silu,
    /// `gelu_tanh(gate) * up` (GeGLU with the tanh approximation): Gemma.
    GeluTanh,
}

/// How RoPE angles are stretched beyond the plain `pos * theta^(-2i/d)`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeScaling {
    /// Positions are multiplied by this (linear scaling: `1 / rope.scaling.factor`).
    pub freq_scale: f32,
    /// Per-pair frequency divisors, `rope_dim / 2` of them: Llama 3.1's `rope_freqs` tensor,
    /// Phi-3's LongRoPE short or long factors.
    pub factors: Option<Vec<f32>>,
    /// Multiplier of the cos/sin tables (LongRoPE's `rope.scaling.attn_factor`).
    pub attn_factor: f32,
}

impl Default for RopeScaling {
    fn default() -> Self {
        RopeScaling {
            freq_scale: 1.0,
            factors: None,
            attn_factor: 1.0,
        }
    }
}

/// Sliding-window (local) attention on some layers: a window layer's token at position `p`
/// attends to positions `p - size + 1 ..= p` only (llama.cpp's standard SWA mask).
#[derive(Clone, Debug, PartialEq)]
pub struct SlidingWindow {
    /// Positions a window layer sees, the token itself included.
    pub size: usize,
    /// Which layers use the window (the others attend globally).
    pub layers: Vec<bool>,
    /// RoPE base of the window layers.
    pub rope_theta: f32,
    /// Linear RoPE scale of the window layers (global layers use `ModelConfig::rope_scaling`).
    pub rope_freq_scale: f32,
}

/// The per-architecture options of the one forward pass (a plain Llama block by default).
#[derive(Clone, Debug, PartialEq)]
pub struct ArchOptions {
    /// The feed-forward gate's activation.
    pub act: Activation,
    /// Token embeddings are multiplied by this (Gemma: `sqrt(hidden)`).
    pub embed_scale: Option<f32>,
    /// Query scale in attention (`1/sqrt(head_dim)` unless the architecture says otherwise).
    pub attn_scale: f32,
    /// `cap * tanh(score / cap)` on attention scores (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// `cap * tanh(logit / cap)` on the output logits (Gemma 2; Gemma 3 when its file says).
    pub final_softcap: Option<f32>,
    /// Local attention on some or all layers.
    pub sliding_window: Option<SlidingWindow>,
}

impl ArchOptions {
    /// A plain Llama-style block for heads of `head_dim`.
    pub fn plain(head_dim: usize) -> Self {
        ArchOptions {
            act: Activation::Silu,
            embed_scale: None,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            final_softcap: None,
            sliding_window: None,
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
    /// Frequency scaling of the (global layers') rotary embedding.
    pub rope_scaling: RopeScaling,
    /// What differs between architectures in the block.
    pub options: ArchOptions,
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
        let n_layers = u("block_count")?;
        let rope_theta = g.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0);
        let rope_dim = u("rope.dimension_count").unwrap_or(head_dim);
        let context_length = cleave_text::model_text::gguf_context_length(g);
        let rope_scaling = read_rope_scaling(g, &arch_name, arch, rope_dim, context_length)?;
        let options = read_options(
            g,
            &arch_name,
            arch,
            Shape {
                n_layers,
                n_heads,
                hidden,
                head_dim,
            },
            rope_theta,
            rope_scaling.freq_scale,
        )?;
        let mut cfg = ModelConfig {
            arch,
            n_layers,
            n_heads,
            n_kv_heads,
            hidden,
            ffn,
            head_dim,
            rope_theta,
            rope_dim,
            rms_eps: g.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            vocab,
            context_length,
            rope_style: arch.rope_style(),
            rope_scaling,
            options,
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
        if let Some(f) = &self.rope_scaling.factors {
            if f.len() != self.rope_dim / 2 {
                return bad(format!(
                    "{} RoPE frequency factors for {} rotated pairs",
                    f.len(),
                    self.rope_dim / 2
                ));
            }
        }
        if let Some(w) = &self.options.sliding_window {
            if w.size == 0 || w.layers.len() != self.n_layers {
                return bad(format!(
                    "sliding window of {} positions over {} layer flags for {} layers",
                    w.size,
                    w.layers.len(),
                    self.n_layers
                ));
            }
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

    /// The attention window of `layer`, `None` for a global layer.
    pub fn window(&self, layer: usize) -> Option<usize> {
        let w = self.options.sliding_window.as_ref()?;
        w.layers[layer].then_some(w.size)
    }
}

/// The sizes [`read_options`] depends on.
struct Shape {
    n_layers: usize,
    n_heads: usize,
    hidden: usize,
    head_dim: usize,
}

/// RoPE scaling from `{arch}.rope.scaling.*` and the frequency-factor tensors, as llama.cpp
/// reads them: `linear` (or no type) scales positions by `1 / factor`, `none` never scales;
/// Llama 3.1's `rope_freqs.weight` divides each pair's frequency; Phi-3's LongRoPE factors are
/// `rope_factors_long.weight` when the context served (the model's whole `context_length`)
/// exceeds `rope.scaling.original_context_length`, else `rope_factors_short.weight`. YaRN and
/// other types are refused: their frequencies would be silently wrong.
fn read_rope_scaling(
    g: &GgufFile,
    arch_name: &str,
    arch: Arch,
    rope_dim: usize,
    context_length: usize,
) -> Result<RopeScaling, ModelError> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let ty = g.get_str(&key("rope.scaling.type")).unwrap_or("linear");
    let factor = g
        .get_f32(&key("rope.scaling.factor"))
        .or_else(|_| g.get_f32(&key("rope.scale_linear")))
        .unwrap_or(0.0);
    let freq_scale = match ty {
        "none" => 1.0,
        "linear" | "longrope" if factor != 0.0 => 1.0 / factor,
        "linear" | "longrope" => 1.0,
        other => {
            return Err(ModelError::BadConfig(format!(
                "RoPE scaling type {other:?} is not supported (supported: none, linear, longrope \
                 and Llama 3.1's frequency factors)"
            )))
        }
    };
    let tensor = |name: &str| -> Result<Option<Vec<f32>>, ModelError> {
        if g.tensor(name).is_err() {
            return Ok(None);
        }
        Ok(Some(super::tensors::vector(g, name, rope_dim / 2)?))
    };
    let factors = match tensor("rope_freqs.weight")? {
        Some(f) => Some(f),
        None if arch == Arch::Phi3 => {
            let original = g
                .get_u32(&key("rope.scaling.original_context_length"))
                .map_or(context_length, |v| v as usize);
            if context_length > original {
                tensor("rope_factors_long.weight")?
            } else {
                tensor("rope_factors_short.weight")?
            }
        }
        None => None,
    };
    Ok(RopeScaling {
        freq_scale,
        factors,
        attn_factor: g.get_f32(&key("rope.scaling.attn_factor")).unwrap_or(1.0),
    })
}

/// The per-architecture options, with llama.cpp's defaults where a key is absent.
fn read_options(
    g: &GgufFile,
    arch_name: &str,
    arch: Arch,
    shape: Shape,
    rope_theta: f32,
    rope_freq_scale: f32,
) -> Result<ArchOptions, ModelError> {
    let key = |k: &str| format!("{arch_name}.{k}");
    let mut o = ArchOptions::plain(shape.head_dim);
    if !arch.is_gemma() {
        // Phi-3 files may carry `attention.sliding_window`; llama.cpp ignores it (full
        // attention), and so does this engine, to give the same tokens.
        return Ok(o);
    }
    o.act = Activation::GeluTanh;
    o.embed_scale = Some((shape.hidden as f32).sqrt());
    // The 27B models scale queries by hidden / heads instead of the head size (Gemma's
    // `query_pre_attn_scalar`); llama.cpp recognises them by their layer count.
    let big = matches!(
        (arch, shape.n_layers),
        (Arch::Gemma2, 46) | (Arch::Gemma3, 62)
    );
    if big {
        o.attn_scale = 1.0 / ((shape.hidden / shape.n_heads) as f32).sqrt();
    }
    let window = g
        .get_u32(&key("attention.sliding_window"))
        .ok()
        .map(|v| v as usize);
    let theta_swa = g.get_f32(&key("rope.freq_base_swa")).ok();
    match arch {
        Arch::Gemma2 => {
            o.attn_softcap = Some(g.get_f32(&key("attn_logit_softcapping")).unwrap_or(50.0));
            o.final_softcap = Some(g.get_f32(&key("final_logit_softcapping")).unwrap_or(30.0));
            o.sliding_window = Some(SlidingWindow {
                size: window.unwrap_or(4096),
                layers: window_layers(
                    g,
                    &key("attention.sliding_window_pattern"),
                    2,
                    shape.n_layers,
                )?,
                rope_theta: theta_swa.unwrap_or(rope_theta),
                rope_freq_scale,
            });
        }
        Arch::Gemma3 => {
            o.final_softcap = g
                .get_f32(&key("final_logit_softcapping"))
                .ok()
                .filter(|&c| c != 0.0);
            if let Some(size) = window.filter(|&w| w > 0) {
                o.sliding_window = Some(SlidingWindow {
                    size,
                    layers: window_layers(
                        g,
                        &key("attention.sliding_window_pattern"),
                        6,
                        shape.n_layers,
                    )?,
                    rope_theta: theta_swa.unwrap_or(10_000.0),
                    rope_freq_scale: 1.0,
                });
            }
        }
        _ => {}
    }
    Ok(o)
}

/// Which layers use the window: `attention.sliding_window_pattern` as one flag per layer, or
/// as a period `n` (every `n`-th layer global, the others windowed; 0 windows every layer).
fn window_layers(
    g: &GgufFile,
    key: &str,
    default_period: usize,
    n_layers: usize,
) -> Result<Vec<bool>, ModelError> {
    if let Some(flags) = g.meta(key).and_then(|v| v.as_array()) {
        let flags: Option<Vec<bool>> = flags
            .iter()
            .map(|v| match v {
                cleave_text::gguf::MetaValue::Bool(b) => Some(*b),
                _ => None,
            })
            .collect();
        return match flags {
            Some(f) if f.len() == n_layers => Ok(f),
            _ => Err(ModelError::BadConfig(format!(
                "{key} must be one bool per layer ({n_layers}) or a period"
            ))),
        };
    }
    let n = g.get_u32(key).map_or(default_period, |v| v as usize);
    Ok((0..n_layers).map(|l| n == 0 || l % n < n - 1).collect())
}
