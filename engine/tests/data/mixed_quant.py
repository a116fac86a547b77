"""Writes `mixed_quant.gguf`, a tiny random-weight llama whose tensors use every weight type
cleave loads (as llama.cpp's Q4_K_M/Q5_K_M files mix them), and `mixed_quant_ref.json`, the
logits of a numpy forward pass over gguf-py's dequantization of the same tensors.

Run from this directory: `python3 mixed_quant.py` (needs `pip install gguf numpy`). The outputs
are committed, so the tests never need Python.
"""

import json

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 256, 2, 1, 64, 256, 64
EPS, THETA = 1e-5, 10000.0
PROMPT = [1, 5, 9, 14, 2, 33, 60, 7, 7, 21, 40, 3]

rng = np.random.default_rng(1201)


def k_blocks(ty, rows, cols):
    """Random K-quant (or IQ4_NL) blocks with f16 scales chosen so |w| stays below ~0.15."""
    block, size = GGML_QUANT_SIZES[ty]
    b = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    f16 = lambda lo, hi: rng.uniform(lo, hi, b.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if ty == T.Q6_K:
        b[:, 208:210] = f16(3e-5, 8e-5)
    elif ty == T.IQ4_NL:
        b[:, 0:2] = f16(5e-4, 1e-3)
    elif ty == T.Q4_K:
        b[:, 0:2], b[:, 2:4] = f16(1e-4, 1.5e-4), f16(1e-3, 2e-3)
    else:  # Q5_K
        b[:, 0:2], b[:, 2:4] = f16(5e-5, 7e-5), f16(1e-3, 2e-3)
    return b.reshape(rows, -1)


def tensor(writer, weights, name, ty, rows, cols=None):
    """Adds a tensor of type `ty` and records the values gguf-py dequantizes it to."""
    shape = (rows, cols) if cols else (rows,)
    if ty in (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL):
        raw = k_blocks(ty, rows, cols)
    else:
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if cols is None:
            x = 1.0 + 0.1 * x  # norm weights near one
        raw = x if ty == T.F32 else quantize(x, ty)
        if ty == T.F16:
            raw = x.astype(np.float16)
    writer.add_tensor(name, raw, raw_dtype=ty if ty not in (T.F32, T.F16) else None)
    weights[name] = dequantize(raw.view(np.uint8) if ty not in (T.F32, T.F16) else raw, ty).reshape(shape).astype(np.float32)


def forward(w, tokens):
    x = w["token_embd.weight"][tokens]
    n = len(tokens)
    rms = lambda v, g: v / np.sqrt((v * v).mean(-1, keepdims=True) + EPS) * g

    def rope(v):  # ggml's "normal" mode: adjacent pairs
        v = v.reshape(n, -1, HEAD_DIM // 2, 2)
        inv = THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        ang = np.arange(n)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = v[..., 0], v[..., 1]
        return np.stack([a * c - b * s, a * s + b * c], -1).reshape(n, -1, HEAD_DIM)

    h = rms(x, w["blk.0.attn_norm.weight"])
    q = rope(h @ w["blk.0.attn_q.weight"].T)
    k = rope(h @ w["blk.0.attn_k.weight"].T)
    v = (h @ w["blk.0.attn_v.weight"].T).reshape(n, KV_HEADS, HEAD_DIM)
    att = np.zeros((n, HEADS, HEAD_DIM), np.float64)
    for hd in range(HEADS):
        kv = hd * KV_HEADS // HEADS
        s = q[:, hd] @ k[:, kv].T / np.sqrt(HEAD_DIM)
        s = s + np.triu(np.full((n, n), -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        att[:, hd] = (p / p.sum(-1, keepdims=True)) @ v[:, kv]
    x = x + att.reshape(n, -1) @ w["blk.0.attn_output.weight"].T
    h = rms(x, w["blk.0.ffn_norm.weight"])
    g, u = h @ w["blk.0.ffn_gate.weight"].T, h @ w["blk.0.ffn_up.weight"].T
    x = x + (g / (1 + np.exp(-g)) * u) @ w["blk.0.ffn_down.weight"].T
    return rms(x, w["output_norm.weight"]) @ w["output.weight"].T


writer = GGUFWriter("mixed_quant.gguf", "llama")
writer.add_block_count(1)
writer.add_context_length(128)
writer.add_embedding_length(HIDDEN)
writer.add_feed_forward_length(FFN)
writer.add_head_count(HEADS)
writer.add_head_count_kv(KV_HEADS)
writer.add_key_length(HEAD_DIM)
writer.add_value_length(HEAD_DIM)
writer.add_rope_freq_base(THETA)
writer.add_layer_norm_rms_eps(EPS)
writer.add_vocab_size(VOCAB)

w = {}
tensor(writer, w, "token_embd.weight", T.Q4_0, VOCAB, HIDDEN)
tensor(writer, w, "blk.0.attn_norm.weight", T.BF16, HIDDEN)
tensor(writer, w, "blk.0.attn_q.weight", T.Q5_K, HEADS * HEAD_DIM, HIDDEN)
tensor(writer, w, "blk.0.attn_k.weight", T.IQ4_NL, KV_HEADS * HEAD_DIM, HIDDEN)
tensor(writer, w, "blk.0.attn_v.weight", T.Q4_1, KV_HEADS * HEAD_DIM, HIDDEN)
# 128 columns: not whole super-blocks, so Q5_0 as llama.cpp's quantizer falls back to.
tensor(writer, w, "blk.0.attn_output.weight", T.Q5_0, HIDDEN, HEADS * HEAD_DIM)
tensor(writer, w, "blk.0.ffn_norm.weight", T.F16, HIDDEN)
tensor(writer, w, "blk.0.ffn_gate.weight", T.Q8_0, FFN, HIDDEN)
tensor(writer, w, "blk.0.ffn_up.weight", T.Q5_1, FFN, HIDDEN)
tensor(writer, w, "blk.0.ffn_down.weight", T.Q4_K, HIDDEN, FFN)
tensor(writer, w, "output_norm.weight", T.F32, HIDDEN)
tensor(writer, w, "output.weight", T.Q6_K, VOCAB, HIDDEN)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()

logits = forward({k: v.astype(np.float64) for k, v in w.items()}, PROMPT)
with open("mixed_quant_ref.json", "w") as f:
    json.dump({"prompt": PROMPT, "vocab": VOCAB, "logits": [round(float(v), 6) for v in logits.reshape(-1)]}, f)
print("logit std", logits.std(), "max", np.abs(logits).max())
