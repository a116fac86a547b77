#!/usr/bin/env python3
"""Independent reference forward pass for the tiny HF checkpoints of engine/tests (numpy only).

Usage: hf_reference.py MODEL_DIR TOKEN,TOKEN,...  -> prints {"logits": [[...], ...]} (one row per
position). Follows the Hugging Face modelling code of LlamaForCausalLM, MixtralForCausalLM,
Qwen2MoeForCausalLM and Qwen3MoeForCausalLM (rotate_half RoPE, softmax top-k routing), in float64.
"""
import json
import struct
import sys

import numpy as np


def load_safetensors(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        b, e = t["data_offsets"]
        buf = data[b:e]
        if t["dtype"] == "F32":
            a = np.frombuffer(buf, dtype="<f4")
        elif t["dtype"] == "F16":
            a = np.frombuffer(buf, dtype="<f2")
        elif t["dtype"] == "BF16":
            a = (np.frombuffer(buf, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"unsupported dtype {t['dtype']}")
        out[name] = a.astype(np.float64).reshape(t["shape"])
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope(x, theta):
    # x: [T, heads, d]; HF rotate_half pairing (i, i + d/2).
    t, _, d = x.shape
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.arange(t, dtype=np.float64)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, axis=-1)[:, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def mlp(x, g, u, d):
    return (silu(x @ g.T) * (x @ u.T)) @ d.T


def main():
    model_dir, toks = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    cfg = json.load(open(f"{model_dir}/config.json"))
    W = load_safetensors(f"{model_dir}/model.safetensors")
    arch = cfg["architectures"][0]
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)
    hd = cfg.get("head_dim", H // nh)
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    T = len(toks)
    x = W["model.embed_tokens.weight"][toks]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{l}."
        a = p + "self_attn."
        h = rms_norm(x, W[p + "input_layernorm.weight"], eps)
        q, k, v = (h @ W[a + f"{n}_proj.weight"].T for n in "qkv")
        if a + "q_proj.bias" in W:
            q, k, v = (q + W[a + "q_proj.bias"], k + W[a + "k_proj.bias"], v + W[a + "v_proj.bias"])
        q, k, v = q.reshape(T, nh, hd), k.reshape(T, nkv, hd), v.reshape(T, nkv, hd)
        if a + "q_norm.weight" in W:
            q = rms_norm(q, W[a + "q_norm.weight"], eps)
            k = rms_norm(k, W[a + "k_norm.weight"], eps)
        q, k = rope(q, theta), rope(k, theta)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shd->thd", s, v).reshape(T, nh * hd)
        x = x + o @ W[a + "o_proj.weight"].T

        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        if arch == "MixtralForCausalLM":
            router, ex = p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.experts."
            names, n_exp, norm = ("w1", "w3", "w2"), cfg["num_local_experts"], True
        else:
            router, ex = p + "mlp.gate.weight", p + "mlp.experts."
            names, n_exp = ("gate_proj", "up_proj", "down_proj"), cfg.get("num_experts", 0)
            norm = cfg.get("norm_topk_prob", False)
        if router in W:
            logits = h @ W[router].T
            probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out = np.zeros_like(h)
            for t in range(T):
                top = np.argsort(-probs[t], kind="stable")[: cfg["num_experts_per_tok"]]
                w = probs[t, top]
                if norm:
                    w = w / w.sum()
                for e, we in zip(top, w):
                    g, u, d = (W[f"{ex}{e}.{n}.weight"] for n in names)
                    out[t] += we * mlp(h[t], g, u, d)
            sh = p + "mlp.shared_expert."
            if sh + "gate_proj.weight" in W:
                gate = 1.0 / (1.0 + np.exp(-(h @ W[p + "mlp.shared_expert_gate.weight"].T)))
                out += gate * mlp(h, *(W[sh + f"{n}_proj.weight"] for n in ("gate", "up", "down")))
            assert n_exp > 0
        else:
            out = mlp(h, *(W[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down")))
        x = x + out
    x = rms_norm(x, W["model.norm.weight"], eps)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    json.dump({"logits": (x @ head.T).tolist()}, sys.stdout)


if __name__ == "__main__":
    main()
