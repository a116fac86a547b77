"""Writes the dequantization references the kernel tests compare against (exactly).

For each type: 1024 elements of random blocks (random quant and scale bytes; f16 block
scales set to sane values) followed by gguf-py's `gguf.quants.dequantize` of them, as
little-endian f32. Run from this directory: `python3 make_reference.py` (needs `pip install
gguf`); the outputs are small and committed, so tests never need Python.
"""

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

N = 1024
rng = np.random.default_rng(20261201)


def f16_field(blocks, at, lo, hi, signed=False):
    v = rng.uniform(lo, hi, size=blocks.shape[0]).astype(np.float16)
    if signed:
        v = v * rng.choice([-1, 1], size=v.shape).astype(np.float16)
    blocks[:, at:at + 2] = v.view(np.uint8).reshape(-1, 2)


# (type, file name, f16 fields: (offset, low, high, signed))
TYPES = [
    (T.Q4_0, "q4_0", [(0, 1e-3, 0.1, True)]),
    (T.Q4_1, "q4_1", [(0, 1e-3, 0.1, False), (2, 0.05, 1.0, True)]),
    (T.Q5_0, "q5_0", [(0, 1e-3, 0.1, True)]),
    (T.Q5_1, "q5_1", [(0, 1e-3, 0.1, False), (2, 0.05, 1.0, True)]),
    (T.Q8_0, "q8_0", [(0, 1e-4, 0.01, True)]),
    (T.Q4_K, "q4_k", [(0, 1e-4, 2e-3, False), (2, 1e-4, 2e-3, False)]),
    (T.Q5_K, "q5_k", [(0, 1e-4, 2e-3, False), (2, 1e-4, 2e-3, False)]),
    (T.Q6_K, "q6_k", [(208, 1e-5, 5e-4, True)]),
    (T.IQ4_NL, "iq4_nl", [(0, 1e-4, 0.01, True)]),
    (T.Q2_K, "q2_k", [(80, 1e-4, 2e-3, False), (82, 1e-4, 2e-3, False)]),
    (T.Q3_K, "q3_k", [(108, 1e-5, 5e-4, True)]),
]

for ty, name, fields in TYPES:
    block, size = GGML_QUANT_SIZES[ty]
    blocks = rng.integers(0, 256, size=(N // block, size), dtype=np.uint8)
    for at, lo, hi, signed in fields:
        f16_field(blocks, at, lo, hi, signed)
    raw = blocks.reshape(-1)
    values = dequantize(raw, ty).astype("<f4").reshape(-1)
    assert values.size == N and np.isfinite(values).all()
    with open(f"{name}.bin", "wb") as f:
        f.write(raw.tobytes())
        f.write(values.tobytes())
    print(name, raw.size, "bytes +", values.size, "values")
