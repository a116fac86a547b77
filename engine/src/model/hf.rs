//! Hugging Face checkpoints: `config.json` plus safetensors, for the Llama family (llama,
//! mistral, qwen2, qwen3) and MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE). Each rank reads only
//! its shard: its heads, its FFN rows/columns, its vocabulary rows and its experts. Weights are
//! kept as f32 (converted from F32, F16 or BF16).

use std::ops::Range;
use std::path::Path;

use serde_json::Value;

use crate::kernels::QMatrix;
use cleave_text::safetensors::SafeTensors;

use super::config::{Arch, ArchOptions, ModelConfig, MoeConfig, RopeScaling, RopeStyle};
use super::moe::{MoeLayer, SharedExpert};
use super::weights::{Ffn, Layer, Mlp, Shard, Weights};
use super::ModelError;

/// Reads `dir/config.json`.
pub fn read_config(dir: &Path) -> Result<ModelConfig, ModelError> {
    let path = dir.join("config.json");
    let err = |why: String| ModelError::HfConfig {
        path: path.clone(),
        why,
    };
    let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| err(format!("not JSON: {e}")))?;
    parse_config(&v).map_err(err)
}

fn parse_config(v: &Value) -> Result<ModelConfig, String> {
    let u = |k: &str| -> Result<usize, String> {
        v[k].as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| format!("missing or non-integer {k:?}"))
    };
    let opt_u = |k: &str| v.get(k).and_then(Value::as_u64).map(|x| x as usize);
    let f = |k: &str, default: f64| v.get(k).and_then(Value::as_f64).unwrap_or(default) as f32;
    let name = v["architectures"][0]
        .as_str()
        .ok_or("missing \"architectures\"")?;
    let arch = match name {
        "LlamaForCausalLM" => Arch::Llama,
        "MistralForCausalLM" => Arch::Mistral,
        "Qwen2ForCausalLM" => Arch::Qwen2,
        "Qwen3ForCausalLM" => Arch::Qwen3,
        "MixtralForCausalLM" => Arch::Mixtral,
        "Qwen2MoeForCausalLM" => Arch::Qwen2Moe,
        "Qwen3MoeForCausalLM" => Arch::Qwen3Moe,
        other => {
            return Err(format!(
            "unsupported architecture {other:?} (supported: LlamaForCausalLM, MistralForCausalLM, \
                 Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM, \
                 Qwen3MoeForCausalLM)"
        ))
        }
    };
    if !v.get("rope_scaling").is_none_or(Value::is_null) {
        return Err("rope_scaling is not supported".into());
    }
    let (n_heads, hidden, n_layers) = (
        u("num_attention_heads")?,
        u("hidden_size")?,
        u("num_hidden_layers")?,
    );
    let head_dim = opt_u("head_dim").unwrap_or(hidden / n_heads.max(1));
    let flag = |k: &str, default: bool| v.get(k).and_then(Value::as_bool).unwrap_or(default);
    let moe = match arch {
        Arch::Mixtral => Some(MoeConfig {
            n_experts: u("num_local_experts")?,
            top_k: u("num_experts_per_tok")?,
            expert_ffn: u("intermediate_size")?,
            norm_topk: true,
            shared_ffn: None,
            sparse_layers: vec![true; n_layers],
        }),
        Arch::Qwen2Moe | Arch::Qwen3Moe => {
            let step = opt_u("decoder_sparse_step").unwrap_or(1).max(1);
            let dense: Vec<u64> = v
                .get("mlp_only_layers")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).collect())
                .unwrap_or_default();
            let shared = match arch {
                Arch::Qwen2Moe => opt_u("shared_expert_intermediate_size").filter(|&s| s > 0),
                _ => None,
            };
            Some(MoeConfig {
                n_experts: u("num_experts")?,
                top_k: u("num_experts_per_tok")?,
                expert_ffn: u("moe_intermediate_size")?,
                norm_topk: flag("norm_topk_prob", false),
                shared_ffn: shared,
                sparse_layers: (0..n_layers)
                    .map(|l| !dense.contains(&(l as u64)) && (l + 1) % step == 0)
                    .collect(),
            })
        }
        _ => None,
    };
    let cfg = ModelConfig {
        arch,
        n_layers,
        n_heads,
        n_kv_heads: opt_u("num_key_value_heads").unwrap_or(n_heads),
        hidden,
        ffn: u("intermediate_size")?,
        head_dim,
        rope_theta: f("rope_theta", 10_000.0),
        rope_dim: head_dim,
        rms_eps: f("rms_norm_eps", 1e-6),
        vocab: u("vocab_size")?,
        context_length: cleave_text::model_text::hf_context_length(v),
        // HF checkpoints rotate halves (`rotate_half`); only GGUF llama files are permuted.
        rope_style: RopeStyle::Neox,
        rope_scaling: RopeScaling::default(),
        options: ArchOptions::plain(head_dim),
        moe,
    };
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// Reads rows `rows` / columns `cols` of the `[r x c]` matrix `name` as an f32 [`QMatrix`].
fn part(
    st: &SafeTensors,
    name: &str,
    (r, c): (usize, usize),
    rows: Range<usize>,
    cols: Range<usize>,
) -> Result<QMatrix, ModelError> {
    let (nr, nc) = (rows.len(), cols.len());
    let data = st.read_f32(name, &[r, c], rows, cols)?;
    Ok(QMatrix::from_f32(nr, nc, data)?)
}

fn whole(st: &SafeTensors, name: &str, r: usize, c: usize) -> Result<QMatrix, ModelError> {
    part(st, name, (r, c), 0..r, 0..c)
}

fn vector(st: &SafeTensors, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    Ok(st.read_f32(name, &[len], 0..1, 0..len)?)
}

fn optional(
    st: &SafeTensors,
    name: &str,
    len: usize,
    keep: Range<usize>,
) -> Result<Option<Vec<f32>>, ModelError> {
    if !st.contains(name) {
        return Ok(None);
    }
    Ok(Some(st.read_f32(name, &[len], 0..1, keep)?))
}

/// A SwiGLU split like a dense tensor-parallel FFN: gate/up rows `f`, down columns `f`.
fn mlp(
    st: &SafeTensors,
    [gate, up, down]: [&str; 3],
    hidden: usize,
    ffn: usize,
    f: Range<usize>,
) -> Result<Mlp, ModelError> {
    Ok(Mlp {
        w_gate: part(st, gate, (ffn, hidden), f.clone(), 0..hidden)?,
        w_up: part(st, up, (ffn, hidden), f.clone(), 0..hidden)?,
        w_down: part(st, down, (hidden, ffn), 0..hidden, f)?,
    })
}

/// Loads this rank's share of every weight of a Hugging Face checkpoint.
pub fn load_weights(
    st: &SafeTensors,
    cfg: &ModelConfig,
    shard: Shard,
) -> Result<Weights, ModelError> {
    let w = shard.world;
    let shared = cfg.moe.as_ref().and_then(|m| m.shared_ffn).unwrap_or(0);
    let any_dense = cfg
        .moe
        .as_ref()
        .is_none_or(|m| m.sparse_layers.iter().any(|s| !s));
    if !cfg.n_kv_heads.is_multiple_of(w)
        || !cfg.vocab.is_multiple_of(w)
        || (any_dense && !cfg.ffn.is_multiple_of(w))
        || !shared.is_multiple_of(w)
    {
        return Err(ModelError::BadConfig(format!(
            "group size {w} must divide kv heads ({}), vocab ({}), dense ffn ({}) and shared \
             expert ffn ({shared})",
            cfg.n_kv_heads, cfg.vocab, cfg.ffn
        )));
    }
    let (hidden, hd) = (cfg.hidden, cfg.head_dim);
    let (q0, q1) = shard.range(cfg.n_heads);
    let (k0, k1) = shard.range(cfg.n_kv_heads);
    let (qr, kr) = (q0 * hd..q1 * hd, k0 * hd..k1 * hd);
    let (qd, kd) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);

    let tok_embd = whole(st, "model.embed_tokens.weight", cfg.vocab, hidden)?;
    let (v0, v1) = shard.range(cfg.vocab);
    let head_name = if st.contains("lm_head.weight") {
        "lm_head.weight"
    } else {
        "model.embed_tokens.weight"
    };
    let output = part(st, head_name, (cfg.vocab, hidden), v0..v1, 0..hidden)?;

    let mut layers = Vec::with_capacity(cfg.n_layers);
    for i in 0..cfg.n_layers {
        let p = format!("model.layers.{i}.");
        let n = |s: &str| format!("{p}{s}");
        let a = |s: &str| format!("{p}self_attn.{s}");
        let sparse = cfg.moe.as_ref().is_some_and(|m| m.sparse_layers[i]);
        let ffn = if sparse {
            Ffn::Moe(moe_layer(st, cfg, &p, shard)?)
        } else {
            let (f0, f1) = shard.range(cfg.ffn);
            let names = ["gate_proj", "up_proj", "down_proj"].map(|s| format!("{p}mlp.{s}.weight"));
            let names = [&*names[0], &*names[1], &*names[2]];
            Ffn::Dense(mlp(st, names, hidden, cfg.ffn, f0..f1)?)
        };
        layers.push(Layer {
            attn_norm: vector(st, &n("input_layernorm.weight"), hidden)?,
            wq: part(st, &a("q_proj.weight"), (qd, hidden), qr.clone(), 0..hidden)?,
            wk: part(st, &a("k_proj.weight"), (kd, hidden), kr.clone(), 0..hidden)?,
            wv: part(st, &a("v_proj.weight"), (kd, hidden), kr.clone(), 0..hidden)?,
            wo: part(st, &a("o_proj.weight"), (hidden, qd), 0..hidden, qr.clone())?,
            bq: optional(st, &a("q_proj.bias"), qd, qr.clone())?,
            bk: optional(st, &a("k_proj.bias"), kd, kr.clone())?,
            bv: optional(st, &a("v_proj.bias"), kd, kr.clone())?,
            q_norm: optional(st, &a("q_norm.weight"), hd, 0..hd)?,
            k_norm: optional(st, &a("k_norm.weight"), hd, 0..hd)?,
            ffn_norm: vector(st, &n("post_attention_layernorm.weight"), hidden)?,
            attn_post_norm: None,
            ffn_post_norm: None,
            ffn,
        });
    }
    Ok(Weights {
        tok_embd,
        layers,
        output_norm: vector(st, "model.norm.weight", hidden)?,
        output,
    })
}

/// One MoE block: the router (every rank), this rank's experts, the shared expert's slice.
fn moe_layer(
    st: &SafeTensors,
    cfg: &ModelConfig,
    p: &str,
    shard: Shard,
) -> Result<MoeLayer, ModelError> {
    let m = cfg.moe.as_ref().expect("sparse layer of a MoE model");
    let hidden = cfg.hidden;
    let mixtral = cfg.arch == Arch::Mixtral;
    let (router, experts) = if mixtral {
        ("block_sparse_moe.gate.weight", "block_sparse_moe.experts")
    } else {
        ("mlp.gate.weight", "mlp.experts")
    };
    let router = whole(st, &format!("{p}{router}"), m.n_experts, hidden)?;
    let mine = Shard::uneven(m.n_experts, shard.world, shard.rank);
    let first = mine.start;
    let mut local = Vec::with_capacity(mine.len());
    for e in mine {
        let names = if mixtral {
            ["w1", "w3", "w2"].map(|s| format!("{p}{experts}.{e}.{s}.weight"))
        } else {
            ["gate_proj", "up_proj", "down_proj"].map(|s| format!("{p}{experts}.{e}.{s}.weight"))
        };
        let names = [&*names[0], &*names[1], &*names[2]];
        local.push(mlp(st, names, hidden, m.expert_ffn, 0..m.expert_ffn)?);
    }
    let shared = match m.shared_ffn {
        Some(ffn) => {
            let names = ["gate_proj", "up_proj", "down_proj"]
                .map(|s| format!("{p}mlp.shared_expert.{s}.weight"));
            let names = [&*names[0], &*names[1], &*names[2]];
            let (f0, f1) = shard.range(ffn);
            let gate_name = format!("{p}mlp.shared_expert_gate.weight");
            Some(SharedExpert {
                mlp: mlp(st, names, hidden, ffn, f0..f1)?,
                gate: st.read_f32(&gate_name, &[1, hidden], 0..1, 0..hidden)?,
            })
        }
        None => None,
    };
    Ok(MoeLayer {
        router,
        first,
        experts: local,
        shared,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_errors_name_the_problem() {
        let e = parse_config(&serde_json::json!({"architectures": ["GPT2LMHeadModel"]}));
        assert!(e.unwrap_err().contains("GPT2LMHeadModel"));
        let e = parse_config(&serde_json::json!({"architectures": ["LlamaForCausalLM"]}));
        assert!(e.unwrap_err().contains("num_attention_heads"));
    }

    #[test]
    fn qwen2_moe_sparse_layer_map() {
        let v = serde_json::json!({
            "architectures": ["Qwen2MoeForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 96,
            "vocab_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 2, "mlp_only_layers": [3],
        });
        let c = parse_config(&v).unwrap();
        let m = c.moe.unwrap();
        assert_eq!(m.sparse_layers, vec![false, true, false, false]);
        assert_eq!(m.shared_ffn, Some(64));
        assert!(!m.norm_topk);
    }
}
