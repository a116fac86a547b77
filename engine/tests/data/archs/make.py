"""Writes small random-weight GGUFs of the architectures cleave runs besides llama/qwen, quantizes
them with llama.cpp's own quantizer, and records llama.cpp's tokens and logits on them.

For each model in MODELS: gguf-py (llama.cpp's writer, so tensor names and metadata are
llama.cpp's) writes an F32 file with a small SentencePiece-style vocabulary (byte fallback,
`▁` pieces, the family's special tokens); `llama_model_quantize` turns it into `NAME.gguf` with
the listed file type (llama.cpp's own mix of tensor types, as in downloaded files); llama.cpp
then tokenizes TEXT and evaluates every position, and `NAME.json` keeps its token ids, each
position's argmax and next-token negative log-likelihood, and the full logits at a few positions.

Run from this directory with llama-cpp-python built without native tuning (docs/engine.md,
"llama.cpp as the yardstick") and `pip install gguf numpy`: `python3 make.py`. The outputs are
committed; the tests (engine/tests/archs.rs) only read them.
"""

import ctypes
import json
import os
import sys
import tempfile

import numpy as np
from gguf import GGUFWriter
from gguf.constants import TokenType

import llama_cpp

TEXT = ("Hello world! The quick brown fox jumps over the lazy dog. Grüße aus München, ¿qué tal? "
        "你好，世界 🌍🚀✨ def add(a, b):\n    return a + b  # sum\n\tTabs and  double  spaces, 3.14159 "
        "and x_1 <= 42; the end of the text is here.")

# Pieces beyond the single characters: enough that words take a few tokens each.
PIECES = ["▁the", "▁a", "▁t", "he", "in", "er", "an", "on", "▁of", "▁and", "▁to", "ing", "▁is", "re",
          "▁w", "▁s", "▁c", "▁f", "▁b", "▁d", "▁h", "▁m", "▁p", "▁o", "or", "en", "at", "es", "ou",
          "ed", "▁in", "▁th", "is", "it", "al", "ar", "st", "nd", "▁re", "le", "ll", "▁e", "▁be",
          "▁qu", "ick", "▁quick", "▁br", "own", "▁brown", "▁fox", "▁j", "um", "ps", "▁jumps", "▁o",
          "ver", "▁over", "▁l", "az", "▁lazy", "▁dog", "▁He", "llo", "▁Hello", "▁world", "▁The",
          "▁text", "▁end", "▁here", "▁def", "▁add", "▁return", "▁sum", "▁and", "▁double", "▁spaces",
          "▁Tabs", "▁aus", "▁M", "ün", "chen", "▁qué", "▁tal", "▁x", "_1", "▁<", "=", "▁42", "▁3",
          ".1", "41", "59", "▁▁", "▁▁▁▁", "\n", "\t"]
CHARS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)] \
    + list("0123456789") + list(".,!?;:()+-*/#<>=_'\"äöüßé¿")

GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
LLAMA_SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]


def vocab(specials):
    """tokens, scores, types of a SentencePiece-style vocabulary: specials, the 256 byte tokens,
    "▁", single characters, then the pieces (later pieces score lower, longer ones higher), then
    unreachable fillers up to a multiple of 64 tokens, so that the vocabulary splits evenly over
    the ranks of a group (the LM head is vocab-parallel)."""
    normal = ["▁"] + CHARS + [p for p in dict.fromkeys(PIECES) if p not in CHARS and p != "▁"]
    normal += [f"▁zz{i}" for i in range(-(len(specials) + 256 + len(normal)) % 64)]
    tokens = list(specials) + [f"<0x{b:02X}>" for b in range(256)] + normal
    types = [TokenType.CONTROL] * len(specials) + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(normal)
    types[specials.index("<unk>")] = TokenType.UNKNOWN
    scores = [0.0] * (len(specials) + 256) + [-1.0 - i * 0.01 + 0.5 * len(t) for i, t in enumerate(normal)]
    return tokens, scores, [int(t) for t in types]


class Model:
    def __init__(self, name, arch, ftype, *, layers, hidden, heads, kv_heads, head_dim, ffn, specials,
                 add_space_prefix, extra=None, seed=0):
        self.name, self.arch, self.ftype = name, arch, ftype
        self.layers, self.hidden, self.heads, self.kv_heads = layers, hidden, heads, kv_heads
        self.head_dim, self.ffn, self.specials = head_dim, ffn, specials
        self.add_space_prefix, self.extra, self.seed = add_space_prefix, extra or {}, seed


MODELS = [
    # Gemma: head_dim 256 (> hidden / heads), tied LM head, GELU-tanh gating.
    Model("gemma", "gemma", "Q4_K_M", layers=2, hidden=256, heads=2, kv_heads=1, head_dim=256, ffn=256,
          specials=GEMMA_SPECIALS, add_space_prefix=False, seed=1),
    # Gemma 2: post-norms, attention and final soft-capping (small caps, so the tanh bends),
    # layer 0 windowed (24 positions), layer 1 global.
    Model("gemma2", "gemma2", "Q5_K_M", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
          specials=GEMMA_SPECIALS, add_space_prefix=False, seed=2,
          extra={"window": 24, "attn_softcap": 3.0, "final_softcap": 8.0}),
    # Gemma 3: Q/K norms, layers 0 and 1 windowed (20 positions, RoPE base 10k), layer 2 global
    # (base 1M with linear scaling 8, as the 4B+ models have).
    Model("gemma3", "gemma3", "Q4_K_M", layers=3, hidden=256, heads=4, kv_heads=1, head_dim=64, ffn=256,
          specials=GEMMA_SPECIALS, add_space_prefix=False, seed=3,
          extra={"window": 20, "pattern": 3, "rope_base": 1_000_000.0, "rope_base_swa": 10_000.0,
                 "linear": 8.0}),
    # Phi-3: fused QKV and gate/up, LongRoPE factors (long ones: the context exceeds the
    # original 256) with an attention factor.
    Model("phi3", "phi3", "Q6_K", layers=2, hidden=256, heads=4, kv_heads=4, head_dim=64, ffn=256,
          specials=LLAMA_SPECIALS, add_space_prefix=True, seed=4, extra={"longrope": 256}),
    # Llama 3.1-style RoPE frequency factors (`rope_freqs`), grouped-query attention, Q2_K.
    Model("llama31", "llama", "Q2_K", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=256,
          specials=LLAMA_SPECIALS, add_space_prefix=True, seed=5, extra={"llama3_rope": True}),
    # Mixture-of-experts layouts (stacked `ffn_*_exps`, router `ffn_gate_inp`): Mixtral (a
    # `llama` with `expert_count`), Qwen2-MoE (gated shared expert, no top-k renormalisation),
    # Qwen3-MoE (Q/K norms). Four experts, two per token.
    # Eight heads: the attention output's 512 columns split into whole 256-element K-quant
    # super-blocks over the two ranks of an expert-parallel group.
    Model("mixtral", "llama", "Q4_K_M", layers=1, hidden=256, heads=8, kv_heads=2, head_dim=64, ffn=256,
          specials=LLAMA_SPECIALS, add_space_prefix=True, seed=6, extra={"experts": 4, "used": 2}),
    # (llama.cpp's qwen2moe wants heads × head_dim = hidden: Q4_0, whose 32-element blocks split
    # at 128 columns.)
    Model("qwen2moe", "qwen2moe", "Q4_0", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64,
          ffn=256, specials=LLAMA_SPECIALS, add_space_prefix=True, seed=7,
          extra={"experts": 4, "used": 2, "shared_ffn": 256, "qkv_bias": True}),
    Model("qwen3moe", "qwen3moe", "Q4_K_M", layers=1, hidden=256, heads=8, kv_heads=2, head_dim=64,
          ffn=256, specials=LLAMA_SPECIALS, add_space_prefix=True, seed=8, extra={"experts": 4, "used": 2}),
]


def llama3_factors(dim, base=500_000.0, factor=8.0, low=1.0, high=4.0, orig=64):
    """Llama 3.1's frequency divisors (the converter's formula) for an original context of 64
    positions (8192 in the real models), so that over the test's 160 positions every band (kept,
    divided by `factor`, interpolated) changes the angles visibly."""
    freqs = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_f32(m, path):
    rng = np.random.default_rng(1200 + m.seed)
    w = GGUFWriter(path, m.arch)
    w.add_block_count(m.layers)
    w.add_context_length(4096)
    w.add_embedding_length(m.hidden)
    w.add_feed_forward_length(m.ffn)
    w.add_head_count(m.heads)
    w.add_head_count_kv(m.kv_heads)
    w.add_key_length(m.head_dim)
    w.add_value_length(m.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(m.head_dim)
    e = m.extra
    w.add_rope_freq_base(e.get("rope_base", 500_000.0 if e.get("llama3_rope") else 10_000.0))
    if "window" in e:
        w.add_sliding_window(e["window"])
    if "pattern" in e:
        w.add_sliding_window_pattern(e["pattern"])
    if "rope_base_swa" in e:
        w.add_rope_freq_base_swa(e["rope_base_swa"])
    if "linear" in e:
        w.add_rope_scaling_type(__import__("gguf").RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(e["linear"])
    if "attn_softcap" in e:
        w.add_attn_logit_softcapping(e["attn_softcap"])
        w.add_final_logit_softcapping(e["final_softcap"])
    if "longrope" in e:
        w.add_rope_scaling_orig_ctx_len(e["longrope"])
        w.add_rope_scaling_attn_factors(1.19)
    if "experts" in e:
        w.add_expert_count(e["experts"])
        w.add_expert_used_count(e["used"])
        if m.arch != "llama":
            w.add_expert_feed_forward_length(m.ffn)
        if "shared_ffn" in e:
            w.add_expert_shared_feed_forward_length(e["shared_ffn"])
    tokens, scores, types = vocab(m.specials)
    n_vocab = len(tokens)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    bos = m.specials.index("<bos>" if "<bos>" in m.specials else "<s>")
    eos = m.specials.index("<eos>" if "<eos>" in m.specials else "</s>")
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(m.specials.index("<unk>"))
    if "<pad>" in m.specials:
        w.add_pad_token_id(m.specials.index("<pad>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(m.add_space_prefix)

    def t(name, *shape, std=None, norm=False):
        """A random tensor of numpy shape `shape` (GGUF dims reversed): unit-variance outputs
        for unit-variance inputs unless `std` says otherwise; norm weights near `norm`."""
        if norm:
            x = norm * (1.0 + 0.1 * rng.standard_normal(shape))
        else:
            x = rng.standard_normal(shape) * (std if std is not None else 1.0 / np.sqrt(shape[-1]))
        w.add_tensor(name, x.astype(np.float32))

    H, qd, kd = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    gemma = m.arch.startswith("gemma")
    # Gemma ties the LM head to the (scaled) embedding: with the blocks' outputs much larger
    # than a token's own embedding, the next-token logits are not dominated by the input token.
    t("token_embd.weight", n_vocab, H, std=0.05 if gemma else 1.0)
    gain = {"gemma": 8.0, "gemma2": 4.0, "gemma3": 4.0}.get(m.arch, 1.0)
    if e.get("llama3_rope"):
        w.add_tensor("rope_freqs.weight", llama3_factors(m.head_dim))
    if "longrope" in e:
        half = m.head_dim // 2
        w.add_tensor("rope_factors_short.weight", np.linspace(1.0, 2.0, half).astype(np.float32))
        w.add_tensor("rope_factors_long.weight", np.linspace(1.0, 12.0, half).astype(np.float32))
    for i in range(m.layers):
        p = f"blk.{i}."
        t(p + "attn_norm.weight", H, norm=1.0)
        if m.arch == "phi3":
            t(p + "attn_qkv.weight", qd + 2 * kd, H)
        else:
            t(p + "attn_q.weight", qd, H)
            t(p + "attn_k.weight", kd, H)
            t(p + "attn_v.weight", kd, H)
        if e.get("qkv_bias"):
            t(p + "attn_q.bias", qd, std=0.1)
            t(p + "attn_k.bias", kd, std=0.1)
            t(p + "attn_v.bias", kd, std=0.1)
        t(p + "attn_output.weight", H, qd, std=gain / np.sqrt(qd))
        if m.arch in ("gemma3", "qwen3moe"):
            t(p + "attn_q_norm.weight", m.head_dim, norm=1.0)
            t(p + "attn_k_norm.weight", m.head_dim, norm=1.0)
        if m.arch in ("gemma2", "gemma3"):
            t(p + "post_attention_norm.weight", H, norm=gain)
            t(p + "post_ffw_norm.weight", H, norm=gain)
        t(p + "ffn_norm.weight", H, norm=1.0)
        if "experts" in e:
            n = e["experts"]
            t(p + "ffn_gate_inp.weight", n, H, std=2.0 / np.sqrt(H))
            t(p + "ffn_gate_exps.weight", n, m.ffn, H)
            t(p + "ffn_up_exps.weight", n, m.ffn, H)
            t(p + "ffn_down_exps.weight", n, H, m.ffn)
            if "shared_ffn" in e:
                t(p + "ffn_gate_inp_shexp.weight", H, std=1.0 / np.sqrt(H))
                t(p + "ffn_gate_shexp.weight", e["shared_ffn"], H)
                t(p + "ffn_up_shexp.weight", e["shared_ffn"], H)
                t(p + "ffn_down_shexp.weight", H, e["shared_ffn"])
        elif m.arch == "phi3":
            t(p + "ffn_up.weight", 2 * m.ffn, H)
        else:
            t(p + "ffn_gate.weight", m.ffn, H)
            t(p + "ffn_up.weight", m.ffn, H)
        if "experts" not in e:
            t(p + "ffn_down.weight", H, m.ffn, std=gain / np.sqrt(m.ffn))
    t("output_norm.weight", H, norm=4.0 if gemma else 1.0)
    if not gemma:
        t("output.weight", n_vocab, H, std=3.0 / np.sqrt(H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src, dst, ftype):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize {dst}: {rc}")


def reference(path, m):
    # An f32 KV cache, as cleave's default (llama.cpp's is f16).
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=1, logits_all=True,
                          flash_attn=False, type_k=0, type_v=0, verbose=False)
    text_tokens = llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    tokens = [llm.token_bos()] + text_tokens
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = [float(lse[p] - logits[p, tokens[p + 1]]) for p in range(len(tokens) - 1)]
    window = m.extra.get("window", 16)
    at = sorted({0, window - 1, window, window + 5, len(tokens) // 2, len(tokens) - 1})
    return {
        "model": f"{m.name}.gguf",
        "file_type": m.ftype,
        "llama_cpp": f"llama-cpp-python {llama_cpp.__version__}, n_ctx 512, f32 KV, one batch, 1 thread",
        "text": TEXT,
        "text_tokens": text_tokens,
        "tokens": tokens,
        "vocab": int(logits.shape[1]),
        "nll": [round(v, 5) for v in nll],
        "ppl": float(np.exp(np.mean(nll))),
        "top1": [int(v) for v in logits.argmax(-1)],
        "logits_at": {str(p): [round(float(v), 5) for v in logits[p]] for p in at},
    }


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    names = sys.argv[1:] or [m.name for m in MODELS]
    with tempfile.TemporaryDirectory() as tmp:
        for m in [m for m in MODELS if m.name in names]:
            f32 = os.path.join(tmp, f"{m.name}.f32.gguf")
            out = os.path.join(here, f"{m.name}.gguf")
            write_f32(m, f32)
            quantize(f32, out, m.ftype)
            ref = reference(out, m)
            with open(os.path.join(here, f"{m.name}.json"), "w") as f:
                json.dump(ref, f, separators=(",", ":"))
            print(f"{m.name}: {os.path.getsize(out)} bytes, {len(ref['tokens'])} tokens, ppl {ref['ppl']:.3f}")


if __name__ == "__main__":
    main()
