"""Records what engine/tests/reference.rs compares cleave's quantized KV cache with: llama.cpp's
perplexity and next-token argmaxes on the default model (SmolLM2-135M-Instruct Q4_1) over the
apache reference text, with its KV cache in f32, in f16 (its default) and in q8_0 (`-ctk q8_0 -ctv
q8_0`), flash attention on for both (llama.cpp needs it for a quantized V cache), measured as
../shared/reference was (no BOS, n_ctx 2048, one thread). Writes `ref.json` here.

Run from the repository root after `cargo build -p cleave`, with llama-cpp-python built without
native tuning (docs/engine.md, "llama.cpp as the yardstick"):

    python3 engine/tests/data/kv/make.py
"""

import json
import os
import sys

import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "../../../.."))
sys.path.insert(0, os.path.join(HERE, "../kquant"))
from make import default_model, measure  # noqa: E402

KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}


def main():
    path = default_model()
    tokens = json.load(open(os.path.join(ROOT, "engine/tests/data/apache2_llamacpp_ref.json")))["tokens"]
    refs = {}
    for name, ty in KV_TYPES.items():
        ref = measure(path, tokens, type_k=ty, type_v=ty, flash_attn=True)
        refs[name] = ref
        print(f"KV {name}: ppl {ref['ppl']:.4f}")
    with open(os.path.join(HERE, "ref.json"), "w") as f:
        json.dump({"llama_cpp": f"llama-cpp-python {llama_cpp.__version__}, n_ctx 2048, 1 thread, no BOS, "
                                "flash attention",
                   "kv": refs}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
