//! llama.cpp's GGUF layout of MoE models (stacked `ffn_*_exps` experts, `ffn_gate_inp` router,
//! Qwen2-MoE `ffn_*_shexp` shared expert; Mixtral as `llama` with `expert_count` and permuted
//! Q/K rows): the tiny HF checkpoints converted to GGUF by this test
//! load into the same model as from safetensors, whole and expert-parallel.

use crate::tiny;

use std::path::Path;
use std::sync::Arc;

use cleave_engine::kernels::Threads;
use cleave_engine::model::Model;
use cleave_text::gguf::GgufFile;
use cleave_text::safetensors::{Dtype, SafeTensors};
use cleave_types::collective::SingleRank;
use tiny::{all_logits, max_diff, on_ranks, write_model, Kind};

fn gstr(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Q8_0 blocks of 32: an f16 scale then 32 signed bytes (ggml's reference rounding).
fn q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in values.chunks_exact(32) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_bits().to_le_bytes());
        out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
    }
    out
}

/// Converts a tiny Mixtral / Qwen2-MoE / Qwen3-MoE HF checkpoint to GGUF (experts in Q8_0 when `quant`).
fn convert(dir: &Path, arch: &str, quant: bool) -> Vec<u8> {
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let st = SafeTensors::open_dir(dir).unwrap();
    let c = |k: &str| cfg[k].as_u64().unwrap() as u32;
    let mixtral = arch == "llama";
    let ne = c(if mixtral {
        "num_local_experts"
    } else {
        "num_experts"
    });
    let (layers, hidden) = (c("num_hidden_layers"), c("hidden_size"));
    let mut kv = Vec::new();
    let mut n_kv = 0u64;
    let mut put = |key: &str, ty: u32, val: Vec<u8>| {
        gstr(&mut kv, key);
        kv.extend(ty.to_le_bytes());
        kv.extend(val);
        n_kv += 1;
    };
    let mut s = Vec::new();
    gstr(&mut s, arch);
    put("general.architecture", 8, s);
    let u32s = [
        ("block_count", layers),
        ("embedding_length", hidden),
        ("feed_forward_length", c("intermediate_size")),
        ("attention.head_count", c("num_attention_heads")),
        ("attention.head_count_kv", c("num_key_value_heads")),
        ("attention.key_length", c("head_dim")),
        ("vocab_size", c("vocab_size")),
        ("expert_count", ne),
        ("expert_used_count", c("num_experts_per_tok")),
    ];
    for (k, v) in u32s {
        put(&format!("{arch}.{k}"), 4, v.to_le_bytes().to_vec());
    }
    if let Some(v) = cfg["moe_intermediate_size"].as_u64() {
        let v = (v as u32).to_le_bytes().to_vec();
        put(&format!("{arch}.expert_feed_forward_length"), 4, v);
    }
    if let Some(v) = cfg["shared_expert_intermediate_size"].as_u64() {
        let v = (v as u32).to_le_bytes().to_vec();
        put(&format!("{arch}.expert_shared_feed_forward_length"), 4, v);
    }
    put(
        &format!("{arch}.rope.freq_base"),
        6,
        10000f32.to_le_bytes().to_vec(),
    );
    let eps = (cfg["rms_norm_eps"].as_f64().unwrap() as f32)
        .to_le_bytes()
        .to_vec();
    put(&format!("{arch}.attention.layer_norm_rms_epsilon"), 6, eps);
    if let Some(b) = cfg["norm_topk_prob"].as_bool() {
        put(&format!("{arch}.expert_weights_norm"), 7, vec![b as u8]);
    }

    // (gguf name, [hf names stacked], quantize)
    let mut map: Vec<(String, Vec<String>, bool)> = vec![
        (
            "token_embd.weight".into(),
            vec!["model.embed_tokens.weight".into()],
            false,
        ),
        (
            "output_norm.weight".into(),
            vec!["model.norm.weight".into()],
            false,
        ),
    ];
    if st.contains("lm_head.weight") {
        map.push(("output.weight".into(), vec!["lm_head.weight".into()], false));
    }
    for l in 0..layers {
        let p = format!("model.layers.{l}.");
        let mut one = |g: &str, h: &str| {
            if st.contains(&format!("{p}{h}")) {
                map.push((format!("blk.{l}.{g}"), vec![format!("{p}{h}")], false));
            }
        };
        for (g, h) in [
            ("attn_norm.weight", "input_layernorm.weight"),
            ("ffn_norm.weight", "post_attention_layernorm.weight"),
            ("attn_q.weight", "self_attn.q_proj.weight"),
            ("attn_k.weight", "self_attn.k_proj.weight"),
            ("attn_v.weight", "self_attn.v_proj.weight"),
            ("attn_output.weight", "self_attn.o_proj.weight"),
            ("attn_q.bias", "self_attn.q_proj.bias"),
            ("attn_k.bias", "self_attn.k_proj.bias"),
            ("attn_v.bias", "self_attn.v_proj.bias"),
            ("attn_q_norm.weight", "self_attn.q_norm.weight"),
            ("attn_k_norm.weight", "self_attn.k_norm.weight"),
            ("ffn_gate.weight", "mlp.gate_proj.weight"),
            ("ffn_up.weight", "mlp.up_proj.weight"),
            ("ffn_down.weight", "mlp.down_proj.weight"),
            ("ffn_gate_inp.weight", "mlp.gate.weight"),
            ("ffn_gate_inp.weight", "block_sparse_moe.gate.weight"),
            (
                "ffn_gate_shexp.weight",
                "mlp.shared_expert.gate_proj.weight",
            ),
            ("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
            (
                "ffn_down_shexp.weight",
                "mlp.shared_expert.down_proj.weight",
            ),
            ("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
        ] {
            one(g, h);
        }
        let (experts, names) = if mixtral {
            ("block_sparse_moe.experts", ["w1", "w3", "w2"])
        } else {
            ("mlp.experts", ["gate_proj", "up_proj", "down_proj"])
        };
        if st.contains(&format!("{p}{experts}.0.{}.weight", names[0])) {
            for (g, h) in ["gate_exps", "up_exps", "down_exps"].into_iter().zip(names) {
                let names = (0..ne)
                    .map(|e| format!("{p}{experts}.{e}.{h}.weight"))
                    .collect();
                map.push((format!("blk.{l}.ffn_{g}.weight"), names, quant));
            }
        }
    }
    let (mut infos, mut data) = (Vec::new(), Vec::new());
    for (name, srcs, q) in &map {
        let shape = st.shape(&srcs[0]).unwrap().to_vec();
        let mut values = Vec::new();
        for s in srcs {
            let (r, c) = if shape.len() == 2 {
                (shape[0], shape[1])
            } else {
                (1, shape[0])
            };
            values.extend(st.read_f32(s, &shape, 0..r, 0..c).unwrap());
        }
        // llama GGUFs store Q/K rows permuted so rotary pairs are adjacent (as llama.cpp's
        // converter does): row 2i+j of a head comes from row j*hd/2+i.
        let heads = match name.rsplit('.').nth(1) {
            Some("attn_q") if mixtral => c("num_attention_heads") as usize,
            Some("attn_k") if mixtral => c("num_key_value_heads") as usize,
            _ => 0,
        };
        if let Some(hd) = shape[0].checked_div(heads) {
            let cols = shape[1];
            let old = values.clone();
            for h in 0..heads {
                for i in 0..hd / 2 {
                    for j in 0..2 {
                        let (to, from) = (h * hd + 2 * i + j, h * hd + j * hd / 2 + i);
                        values[to * cols..(to + 1) * cols]
                            .copy_from_slice(&old[from * cols..(from + 1) * cols]);
                    }
                }
            }
        }
        let mut dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        if srcs.len() > 1 {
            dims.push(srcs.len() as u64);
        }
        data.resize(data.len().next_multiple_of(32), 0);
        gstr(&mut infos, name);
        infos.extend((dims.len() as u32).to_le_bytes());
        for d in &dims {
            infos.extend(d.to_le_bytes());
        }
        infos.extend(if *q { 8u32 } else { 0u32 }.to_le_bytes());
        infos.extend((data.len() as u64).to_le_bytes());
        if *q {
            data.extend(q8_0(&values));
        } else {
            data.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        }
    }
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((map.len() as u64).to_le_bytes());
    out.extend(n_kv.to_le_bytes());
    out.extend(kv);
    out.extend(infos);
    out.resize(out.len().next_multiple_of(32), 0);
    out.extend(data);
    out
}

fn check(kind: Kind, arch: &str) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tiny-gguf-{arch}"));
    write_model(&dir, kind, Dtype::F32, 5);
    let tokens: Vec<u32> = (0..20).map(|i| (i * 29 + 3) % tiny::VOCAB as u32).collect();
    let hf = Model::load_hf(&dir, Arc::new(SingleRank), Threads::single()).unwrap();
    let want = all_logits(&hf, &tokens);
    for quant in [false, true] {
        let g = GgufFile::from_bytes(convert(&dir, arch, quant)).unwrap();
        let one = Model::load(&g, Arc::new(SingleRank), Threads::single()).unwrap();
        assert_eq!(one.config.moe, hf.config.moe);
        let got = all_logits(&one, &tokens);
        let (d, scale) = max_diff(&got, &want);
        eprintln!("{arch} GGUF (q8_0 experts: {quant}) vs HF: max |dlogit| {d:e} of {scale:.2}");
        // F32 experts: the same numbers as the HF load, and EP=2 only reorders sums. Q8_0
        // experts (with the 8-bit activations they imply) stay within 2% of the logit scale,
        // except where the perturbation, or a last-bit change of the residual stream turned
        // into a rounding flip by the 8-bit activations, changes a near-tie of the top-k
        // routing: then most positions must be close (a wrong expert slice spoils them all).
        let check_close = |a: &[f32], b: &[f32], what: &str| {
            if quant {
                let close = a
                    .chunks(tiny::VOCAB)
                    .zip(b.chunks(tiny::VOCAB))
                    .filter(|(x, y)| max_diff(x, y).0 <= 0.02 * scale.max(1.0))
                    .count();
                eprintln!("  {what}: {close}/{} positions within 2%", tokens.len());
                assert!(
                    close * 4 >= tokens.len() * 3,
                    "{arch} {what}: {close} close"
                );
            } else {
                let (d, _) = max_diff(a, b);
                assert!(d <= 1e-4 * scale.max(1.0), "{arch} {what}: differs by {d}");
            }
        };
        check_close(&got, &want, "GGUF vs HF");
        let ranks = on_ranks(2, |c| {
            all_logits(&Model::load(&g, c, Threads::single()).unwrap(), &tokens)
        });
        for r in &ranks {
            check_close(r, &got, "GGUF EP=2 vs EP=1");
        }
    }
}

#[test]
fn mixtral_gguf_layout_loads_like_safetensors() {
    check(Kind::Mixtral, "llama");
}

#[test]
fn qwen2moe_gguf_layout_loads_like_safetensors() {
    check(Kind::Qwen2Moe, "qwen2moe");
}

#[test]
fn qwen3moe_gguf_layout_loads_like_safetensors() {
    check(Kind::Qwen3Moe, "qwen3moe");
}
