//! Loading the transformer's weights from GGUF, for one rank of a tensor-parallel group.
//!
//! Column-parallel matrices (Q, K, V, gate, up, the LM head) are split by output rows, row-parallel
//! ones (attention output, down) by input columns; with `world == 1` nothing is split.

use crate::kernels::{QMatrix, WeightType};
use cleave_text::gguf::{GgmlType, GgufFile};

use super::config::ModelConfig;
use super::moe::MoeLayer;
use super::ModelError;

/// Which part of the weights this process holds: rank `rank` of a group of `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This process's index in the group.
    pub rank: usize,
    /// The group's size.
    pub world: usize,
}

impl Shard {
    /// The whole model in one process.
    pub const SINGLE: Shard = Shard { rank: 0, world: 1 };

    /// The contiguous part of `n` items this rank owns (requires `n % world == 0`).
    pub fn range(&self, n: usize) -> (usize, usize) {
        let per = n / self.world;
        (self.rank * per, (self.rank + 1) * per)
    }

    /// The contiguous part of `n` items rank `rank` owns when `n` need not divide evenly
    /// (experts, tokens): `rank * n / world .. (rank + 1) * n / world`.
    pub fn uneven(n: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
        rank * n / world..(rank + 1) * n / world
    }
}

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

/// A gated feed-forward: `down(act(gate x) * up x)` (SwiGLU, or GeGLU for Gemma). In a dense layer gate/up are this rank's
/// rows and down its columns; a routed expert is whole on the rank that owns it.
pub struct Mlp {
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
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

/// Reads a 2-D weight `[rows x cols]` (cols = GGUF dims[0]) in its own format.
pub(super) fn matrix(g: &GgufFile, name: &str) -> Result<QMatrix, ModelError> {
    let info = g.tensor(name)?;
    if info.dims.len() != 2 {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("expected 2 dimensions, found {:?}", info.dims),
        });
    }
    let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
    let ty = match info.ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            return Ok(QMatrix::from_f32(rows, cols, g.tensor_f32(name)?)?);
        }
        other => kernel_type(name, other)?,
    };
    // K-quant rows are used in the file's layout: they borrow the mapped file (no copy).
    Ok(QMatrix::from_shared(
        ty,
        rows,
        cols,
        g.tensor_shared(name)?,
    )?)
}

/// The kernel format of a quantized GGUF tensor; any type without kernels (IQ2/IQ3/IQ1
/// families, IQ4_XS, ternary TQ1_0/TQ2_0, MXFP4, …) is an error naming the tensor.
pub(super) fn kernel_type(name: &str, ty: GgmlType) -> Result<WeightType, ModelError> {
    Ok(match ty {
        GgmlType::Q4_0 => WeightType::Q4_0,
        GgmlType::Q4_1 => WeightType::Q4_1,
        GgmlType::Q5_0 => WeightType::Q5_0,
        GgmlType::Q5_1 => WeightType::Q5_1,
        GgmlType::Q8_0 => WeightType::Q8_0,
        GgmlType::IQ4_NL => WeightType::IQ4_NL,
        GgmlType::Q2_K => WeightType::Q2_K,
        GgmlType::Q3_K => WeightType::Q3_K,
        GgmlType::Q4_K => WeightType::Q4_K,
        GgmlType::Q5_K => WeightType::Q5_K,
        GgmlType::Q6_K => WeightType::Q6_K,
        other => {
            return Err(ModelError::UnsupportedTensorType {
                name: name.into(),
                ty: other.to_string(),
            })
        }
    })
}

pub(super) fn vector(g: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let v = g.tensor_f32(name)?;
    if v.len() != len {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("expected {len} values, found {}", v.len()),
        });
    }
    Ok(v)
}

fn optional_vector(g: &GgufFile, name: &str, len: usize) -> Result<Option<Vec<f32>>, ModelError> {
    if g.tensor(name).is_err() {
        return Ok(None);
    }
    vector(g, name, len).map(Some)
}

pub(super) fn expect_shape(
    m: &QMatrix,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<(), ModelError> {
    if m.rows() != rows || m.cols() != cols {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("expected {rows}x{cols}, found {}x{}", m.rows(), m.cols()),
        });
    }
    Ok(())
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
