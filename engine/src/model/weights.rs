//! Loading the transformer's weights from GGUF, for one rank of a tensor-parallel group.
//!
//! Column-parallel matrices (Q, K, V, gate, up, the LM head) are split by output rows, row-parallel
//! ones (attention output, down) by input columns; with `world == 1` nothing is split.

use crate::kernels::QMatrix;
use cleave_text::gguf::GgufFile;

use super::config::ModelConfig;
use super::moe::MoeLayer;
use super::tensors::{expect_shape, matrix, optional_vector, vector};
pub use super::tensors::{Mlp, Shard};
use super::ModelError;

/// One transformer block's weights.
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: QMatrix,
    pub wk: QMatrix,
    pub wv: QMatrix,
    pub wo: QMatrix,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    /// RMSNorm of the attention output before the residual add (Gemma 2/3).
    pub attn_post_norm: Option<Vec<f32>>,
    /// RMSNorm of the feed-forward output before the residual add (Gemma 2/3).
    pub ffn_post_norm: Option<Vec<f32>>,
    pub ffn: Ffn,
}

/// A block's feed-forward.
pub enum Ffn {
    /// Dense SwiGLU, tensor-parallel.
    Dense(Mlp),
    /// Sparse mixture of experts, expert-parallel.
    Moe(MoeLayer),
}

/// All weights of the model (this rank's share).
pub struct Weights {
    /// Token embeddings, full on every rank (a lookup, not a product).
    pub tok_embd: QMatrix,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The LM head's rows for this rank's part of the vocabulary (the tied embedding when the
    /// file has no `output.weight`).
    pub output: QMatrix,
}

impl Weights {
    /// Loads this rank's share of every weight.
    pub fn load(g: &GgufFile, cfg: &ModelConfig, shard: Shard) -> Result<Self, ModelError> {
        let w = shard.world;
        let sparse = |i: usize| cfg.moe.as_ref().is_some_and(|m| m.sparse_layers[i]);
        let any_dense = (0..cfg.n_layers).any(|i| !sparse(i));
        if !cfg.n_kv_heads.is_multiple_of(w)
            || (any_dense && !cfg.ffn.is_multiple_of(w))
            || !cfg.vocab.is_multiple_of(w)
        {
            return Err(ModelError::BadConfig(format!(
                "tensor-parallel size {w} must divide kv heads ({}), ffn ({}) and vocab ({})",
                cfg.n_kv_heads, cfg.ffn, cfg.vocab
            )));
        }
        let hd = cfg.head_dim;
        let (q0, q1) = shard.range(cfg.n_heads);
        let (k0, k1) = shard.range(cfg.n_kv_heads);
        let (f0, f1) = shard.range(cfg.ffn);
        let rows = |m: QMatrix, a: usize, b: usize| if w == 1 { m } else { m.slice_rows(a, b) };
        let cols = |m: QMatrix, a: usize, b: usize| -> Result<QMatrix, ModelError> {
            Ok(if w == 1 { m } else { m.slice_cols(a, b)? })
        };
        let part = |v: Vec<f32>, a: usize, b: usize| if w == 1 { v } else { v[a..b].to_vec() };

        let tok_embd = matrix(g, "token_embd.weight")?;
        expect_shape(&tok_embd, "token_embd.weight", cfg.vocab, cfg.hidden)?;
        let output = match g.tensor("output.weight") {
            Ok(_) => matrix(g, "output.weight")?,
            Err(_) => tok_embd.clone(),
        };
        expect_shape(&output, "output.weight", cfg.vocab, cfg.hidden)?;
        let (v0, v1) = shard.range(cfg.vocab);
        let output = rows(output, v0, v1);

        let mut layers = Vec::with_capacity(cfg.n_layers);
        for i in 0..cfg.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let load = |s: &str, r: usize, c: usize| -> Result<QMatrix, ModelError> {
                let m = matrix(g, &n(s))?;
                expect_shape(&m, &n(s), r, c)?;
                Ok(m)
            };
            let (qd, kd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
            let bias = |s: &str, len: usize, a: usize, b: usize| {
                optional_vector(g, &n(s), len).map(|o| o.map(|v| part(v, a, b)))
            };
            let head_norm = |s: &str| optional_vector(g, &n(s), hd);
            // Phi-3 stores Q, K and V as one `attn_qkv` matrix (rows: Q, then K, then V).
            let (wq, wk, wv) = if g.tensor(&n("attn_qkv.weight")).is_ok() {
                let qkv = load("attn_qkv.weight", qd + 2 * kd, cfg.hidden)?;
                (
                    qkv.slice_rows(0, qd),
                    qkv.slice_rows(qd, qd + kd),
                    qkv.slice_rows(qd + kd, qd + 2 * kd),
                )
            } else {
                (
                    load("attn_q.weight", qd, cfg.hidden)?,
                    load("attn_k.weight", kd, cfg.hidden)?,
                    load("attn_v.weight", kd, cfg.hidden)?,
                )
            };
            layers.push(Layer {
                attn_norm: vector(g, &n("attn_norm.weight"), cfg.hidden)?,
                wq: rows(wq, q0 * hd, q1 * hd),
                wk: rows(wk, k0 * hd, k1 * hd),
                wv: rows(wv, k0 * hd, k1 * hd),
                wo: cols(
                    load("attn_output.weight", cfg.hidden, qd)?,
                    q0 * hd,
                    q1 * hd,
                )?,
                bq: bias("attn_q.bias", qd, q0 * hd, q1 * hd)?,
                bk: bias("attn_k.bias", kd, k0 * hd, k1 * hd)?,
                bv: bias("attn_v.bias", kd, k0 * hd, k1 * hd)?,
                q_norm: head_norm("attn_q_norm.weight")?,
                k_norm: head_norm("attn_k_norm.weight")?,
                ffn_norm: vector(g, &n("ffn_norm.weight"), cfg.hidden)?,
                attn_post_norm: optional_vector(g, &n("post_attention_norm.weight"), cfg.hidden)?,
                ffn_post_norm: optional_vector(g, &n("post_ffw_norm.weight"), cfg.hidden)?,
                ffn: if sparse(i) {
                    Ffn::Moe(super::gguf_moe::layer(g, cfg, i, shard)?)
                } else {
                    let (gate, up) = if g.tensor(&n("ffn_gate.weight")).is_ok() {
                        (
                            load("ffn_gate.weight", cfg.ffn, cfg.hidden)?,
                            load("ffn_up.weight", cfg.ffn, cfg.hidden)?,
                        )
                    } else {
                        // Phi-3: one `ffn_up` of 2·ffn rows, the gate's first.
                        let both = load("ffn_up.weight", 2 * cfg.ffn, cfg.hidden)?;
                        (
                            both.slice_rows(0, cfg.ffn),
                            both.slice_rows(cfg.ffn, 2 * cfg.ffn),
                        )
                    };
                    Ffn::Dense(Mlp {
                        w_gate: rows(gate, f0, f1),
                        w_up: rows(up, f0, f1),
                        w_down: cols(load("ffn_down.weight", cfg.hidden, cfg.ffn)?, f0, f1)?,
                    })
                },
            });
        }
        Ok(Weights {
            tok_embd,
            layers,
            output_norm: vector(g, "output_norm.weight", cfg.hidden)?,
            output,
        })
    }
}
