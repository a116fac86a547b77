//! Tiny random-weight checkpoints in the Hugging Face layout (`config.json`, safetensors,
//! a byte-level `tokenizer.json`): dense Llama and Mixtral-, Qwen2-MoE- and Qwen3-MoE-style
//! models small enough to load in milliseconds. The tests use them to exercise the real
//! loading code, tensor and expert parallelism; `cleave model tiny` writes one so a worker
//! group can be tried without downloading an MoE model. Their output is meaningless.

use std::path::Path;

use serde_json::json;

use crate::safetensors::{write_file, Dtype};

/// Which family of tiny model to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Dense Llama.
    Llama,
    /// Mixtral: top-2 of 8 experts, no shared expert.
    Mixtral,
    /// With a gated shared expert, biases on Q/K/V and one dense layer.
    Qwen2Moe,
    /// Q/K head norms, head_dim != hidden / heads, renormalised top-k.
    Qwen3Moe,
}

/// xorshift64*: reproducible weights without a dependency.
struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Vocabulary size: one token per byte.
pub const VOCAB: usize = 256;
const HIDDEN: usize = 64;

/// Writes a tiny checkpoint of `kind` into `dir`, weights stored as `dtype`.
pub fn write_model(dir: &Path, kind: Kind, dtype: Dtype, seed: u64) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (n_heads, n_kv, head_dim) = match kind {
        Kind::Qwen3Moe => (8, 4, 16),
        _ => (8, 4, 8),
    };
    let n_layers = if kind == Kind::Qwen2Moe { 3 } else { 2 };
    let (ffn, n_experts, top_k, expert_ffn, shared_ffn) = (128, 8, 2, 32, 64);
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, scale: f32, offset: f32| {
        let n: usize = shape.iter().product();
        let v = (0..n).map(|_| offset + scale * rng.uniform()).collect();
        tensors.push((name, dtype, shape, v));
    };
    // Uniform(-a, a) with a = sqrt(3 / fan_in): unit-variance outputs for unit-variance inputs.
    let lin = |fan_in: usize| (3.0 / fan_in as f32).sqrt();
    let (qd, kd) = (n_heads * head_dim, n_kv * head_dim);
    add(
        "model.embed_tokens.weight".into(),
        vec![VOCAB, HIDDEN],
        1.0,
        0.0,
    );
    for l in 0..n_layers {
        let p = format!("model.layers.{l}.");
        add(format!("{p}input_layernorm.weight"), vec![HIDDEN], 0.2, 1.0);
        add(
            format!("{p}post_attention_layernorm.weight"),
            vec![HIDDEN],
            0.2,
            1.0,
        );
        add(
            format!("{p}self_attn.q_proj.weight"),
            vec![qd, HIDDEN],
            lin(HIDDEN),
            0.0,
        );
        add(
            format!("{p}self_attn.k_proj.weight"),
            vec![kd, HIDDEN],
            lin(HIDDEN),
            0.0,
        );
        add(
            format!("{p}self_attn.v_proj.weight"),
            vec![kd, HIDDEN],
            lin(HIDDEN),
            0.0,
        );
        add(
            format!("{p}self_attn.o_proj.weight"),
            vec![HIDDEN, qd],
            lin(qd),
            0.0,
        );
        if kind == Kind::Qwen2Moe {
            add(format!("{p}self_attn.q_proj.bias"), vec![qd], 0.5, 0.0);
            add(format!("{p}self_attn.k_proj.bias"), vec![kd], 0.5, 0.0);
            add(format!("{p}self_attn.v_proj.bias"), vec![kd], 0.5, 0.0);
        }
        if kind == Kind::Qwen3Moe {
            add(
                format!("{p}self_attn.q_norm.weight"),
                vec![head_dim],
                0.2,
                1.0,
            );
            add(
                format!("{p}self_attn.k_norm.weight"),
                vec![head_dim],
                0.2,
                1.0,
            );
        }
        let mut swiglu = |pre: &str, [g, u, d]: [&str; 3], f: usize| {
            add(
                format!("{pre}{g}.weight"),
                vec![f, HIDDEN],
                lin(HIDDEN),
                0.0,
            );
            add(
                format!("{pre}{u}.weight"),
                vec![f, HIDDEN],
                lin(HIDDEN),
                0.0,
            );
            add(format!("{pre}{d}.weight"), vec![HIDDEN, f], lin(f), 0.0);
        };
        let names = ["gate_proj", "up_proj", "down_proj"];
        match kind {
            Kind::Llama => swiglu(&format!("{p}mlp."), names, ffn),
            Kind::Qwen2Moe if l == 1 => swiglu(&format!("{p}mlp."), names, ffn),
            Kind::Mixtral => {
                for e in 0..n_experts {
                    let pre = format!("{p}block_sparse_moe.experts.{e}.");
                    swiglu(&pre, ["w1", "w3", "w2"], expert_ffn);
                }
            }
            Kind::Qwen2Moe | Kind::Qwen3Moe => {
                for e in 0..n_experts {
                    swiglu(&format!("{p}mlp.experts.{e}."), names, expert_ffn);
                }
                if kind == Kind::Qwen2Moe {
                    swiglu(&format!("{p}mlp.shared_expert."), names, shared_ffn);
                }
            }
        }
        let router = match kind {
            Kind::Llama => None,
            Kind::Qwen2Moe if l == 1 => None,
            Kind::Mixtral => Some(format!("{p}block_sparse_moe.gate.weight")),
            _ => Some(format!("{p}mlp.gate.weight")),
        };
        if let Some(r) = router {
            add(r, vec![n_experts, HIDDEN], 2.0 * lin(HIDDEN), 0.0);
        }
        if kind == Kind::Qwen2Moe && l != 1 {
            add(
                format!("{p}mlp.shared_expert_gate.weight"),
                vec![1, HIDDEN],
                lin(HIDDEN),
                0.0,
            );
        }
    }
    add("model.norm.weight".into(), vec![HIDDEN], 0.2, 1.0);
    let tied = matches!(kind, Kind::Mixtral | Kind::Qwen3Moe);
    if !tied {
        add(
            "lm_head.weight".into(),
            vec![VOCAB, HIDDEN],
            lin(HIDDEN),
            0.0,
        );
    }
    write_file(&dir.join("model.safetensors"), &tensors)?;

    let arch = match kind {
        Kind::Llama => "LlamaForCausalLM",
        Kind::Mixtral => "MixtralForCausalLM",
        Kind::Qwen2Moe => "Qwen2MoeForCausalLM",
        Kind::Qwen3Moe => "Qwen3MoeForCausalLM",
    };
    let mut cfg = json!({
        "architectures": [arch], "hidden_size": HIDDEN, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv, "head_dim": head_dim,
        "intermediate_size": if kind == Kind::Mixtral { expert_ffn } else { ffn },
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 512, "tie_word_embeddings": tied,
    });
    let extra = match kind {
        Kind::Llama => json!({}),
        Kind::Mixtral => json!({"num_local_experts": n_experts, "num_experts_per_tok": top_k}),
        Kind::Qwen2Moe => json!({
            "num_experts": n_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": expert_ffn, "shared_expert_intermediate_size": shared_ffn,
            "norm_topk_prob": false, "decoder_sparse_step": 1, "mlp_only_layers": [1],
        }),
        Kind::Qwen3Moe => json!({
            "num_experts": n_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": expert_ffn, "norm_topk_prob": true,
        }),
    };
    for (k, v) in extra.as_object().unwrap() {
        cfg[k] = v.clone();
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&cfg)?)?;
    write_tokenizer(dir)
}

/// Writes a byte-level `tokenizer.json` (one token per byte, id = byte value, no merges) and a
/// `tokenizer_config.json` with a plain-text chat template.
pub fn write_tokenizer(dir: &Path) -> std::io::Result<()> {
    let table = crate::tokenizer::byte_table();
    let vocab: serde_json::Map<String, serde_json::Value> = (0..VOCAB)
        .map(|b| (table[b].to_string(), json!(b)))
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "added_tokens": [],
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_vec(&tokenizer)?)?;
    let config = json!({
        "add_bos_token": false,
        "chat_template": "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}\
            {% if add_generation_prompt %}assistant: {% endif %}",
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_vec_pretty(&config)?,
    )
}

/// The kind named `name` (`llama`, `mixtral`, `qwen2-moe`, `qwen3-moe`).
pub fn parse_kind(name: &str) -> Option<Kind> {
    Some(match name {
        "llama" => Kind::Llama,
        "mixtral" => Kind::Mixtral,
        "qwen2-moe" => Kind::Qwen2Moe,
        "qwen3-moe" => Kind::Qwen3Moe,
        _ => return None,
    })
}
