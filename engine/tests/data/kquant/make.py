"""Records what engine/tests/kquant_reference.rs compares with: for each of Q4_K_M, Q5_K_M, Q6_K and
Q8_0, the tensor types llama.cpp's quantizer gives the default model (SmolLM2-135M-Instruct Q4_1,
requantized) in `TYPE.types`, and llama.cpp's perplexity and next-token argmaxes on the file
scripts/kquant-models makes from those types in `ref.json` (with that file's sha256, so the test
knows it reads the same file).

Run from the repository root after scripts/llama-vocab, with llama-cpp-python built without
native tuning (docs/engine.md, "llama.cpp as the yardstick"):

    python3 engine/tests/data/kquant/make.py

It writes the types, runs scripts/kquant-models into a scratch cache, checks that every tensor
of each file equals llama.cpp's own quantizer's output byte for byte, then measures llama.cpp on
the apache reference text exactly as ../shared/reference was measured (no BOS, n_ctx 2048, one
thread).
"""

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

import llama_cpp

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "../../../.."))
TYPES = ["Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]
NAME = "SmolLM2-135M-Instruct"


def default_model():
    out = subprocess.run([os.path.join(ROOT, "target/debug/cleave"), "model", "fetch"], check=True,
                         capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def llama_quantize(src, dst, ftype):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = 2
    p.allow_requantize = True
    if llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p)) != 0:
        sys.exit(f"llama_model_quantize {ftype} failed")


def tensors(path):
    from gguf import GGUFReader  # here, so that ../kv/make.py can import measure without it

    r = GGUFReader(path)
    return {t.name: (t.tensor_type.name, np.asarray(t.data).view(np.uint8).tobytes()) for t in r.tensors}, r


def ggml_name(t):
    """ggml_type_name's spelling: q4_K, q5_0, f32."""
    return t.lower().replace("_k", "_K")


def measure(path, tokens, **kw):
    """llama.cpp's perplexity and next-token argmaxes on `tokens` (keyword arguments go to
    llama_cpp.Llama: the KV cache's types, for one)."""
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=2048, n_ubatch=2048, n_threads=1,
                          logits_all=True, verbose=False, **kw)
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[:, 0]
    nll = [lse[p] - logits[p, tokens[p + 1]] for p in range(len(tokens) - 1)]
    return {
        "n_scored": len(nll),
        "ppl": float(np.exp(np.mean(nll))),
        "top1_next": [int(v) for v in logits[:-1].argmax(-1)],
    }


def main():
    src = default_model()
    tokens = json.load(open(os.path.join(ROOT, "engine/tests/data/apache2_llamacpp_ref.json")))["tokens"]
    refs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for t in TYPES:
            theirs = os.path.join(tmp, f"llama-{t}.gguf")
            llama_quantize(src, theirs, t)
            want, reader = tensors(theirs)
            file_type = int(reader.fields["general.file_type"].parts[-1][0])
            with open(os.path.join(HERE, f"{t}.types"), "w") as f:
                f.write(f"# llama.cpp's tensor types for {NAME} {t} (llama-cpp-python {llama_cpp.__version__})\n")
                f.write(f"# file_type {file_type}\n")
                for name, (ty, _) in want.items():
                    f.write(f"{name} {ggml_name(ty)}\n")
        cache = os.path.join(tmp, "cache")
        os.makedirs(os.path.join(cache, "models"))
        os.symlink(src, os.path.join(cache, "models", os.path.basename(src)))
        subprocess.run([os.path.join(ROOT, "scripts/kquant-models")], check=True,
                       env=dict(os.environ, CLEAVE_CACHE_DIR=cache))
        for t in TYPES:
            ours = os.path.join(cache, "models", f"{NAME}.{t}.gguf")
            got, _ = tensors(ours)
            want, _ = tensors(os.path.join(tmp, f"llama-{t}.gguf"))
            assert got.keys() == want.keys(), t
            differ = [n for n in want if got[n] != want[n]]
            assert not differ, f"{t}: {len(differ)} tensors differ from llama.cpp's, first {differ[0]}"
            ref = measure(ours, tokens)
            ref["sha256"] = hashlib.sha256(open(ours, "rb").read()).hexdigest()
            refs[t] = ref
            print(f"{t}: ppl {ref['ppl']:.4f}, file {ref['sha256'][:12]}")
    with open(os.path.join(HERE, "ref.json"), "w") as f:
        json.dump({"llama_cpp": f"llama-cpp-python {llama_cpp.__version__}, n_ctx 2048, 1 thread, no BOS",
                   "models": refs}, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
