"""Expert parallelism through the whole product: `cleave model tiny` writes a random-weight
Qwen2-MoE checkpoint (Hugging Face layout: config.json, safetensors, tokenizer.json; 8 experts,
top-2, a gated shared expert, one dense layer); `cleave up --ep 2` serves it with a prefill group
and a decode group of 2 ranks each (each rank holding 4 experts, P/D rank to rank). Through the
official openai client its greedy completions equal those of a single process (`cleave up`
without --ep, aggregated), the decode leader exports per-expert token counts, and the prefill
group did the prompts. `--ep` on a dense model and `--ep` != `--tp` are refused clearly."""

import re
import subprocess
import urllib.request

import openai
import pytest

from conftest import free_port
from test_groups import Up, flag, ranks

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "Expert parallelism splits the experts of each layer across the ranks of a group.",
    "short",
]


@pytest.fixture(scope="module")
def moe_dir(cleave_bin, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "tiny-qwen2-moe"
    subprocess.run([cleave_bin, "model", "tiny", "--kind", "qwen2-moe", "--seed", "7", str(d)], check=True)
    return d


def completions(up):
    client = openai.OpenAI(base_url=up.base, api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    assert model == "tiny-qwen2-moe"
    out = []
    for p in PROMPTS:
        r = client.completions.create(model=model, prompt=p, max_tokens=16, temperature=0, logprobs=1)
        assert r.usage.completion_tokens == 16
        lp = r.choices[0].logprobs
        out.append((lp.tokens, lp.token_logprobs))
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.usage.completion_tokens == 4
    return out


def metrics(http):
    return urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()


def test_ep2_groups_serve_the_single_process_tokens(cleave_bin, moe_dir):
    one = Up(cleave_bin, "--model", str(moe_dir), "--prefill", "0", "--decode", "1", "--port", str(free_port()))
    try:
        want = completions(one)
    finally:
        one.stop()
    ep = Up(cleave_bin, "--model", str(moe_dir), "--ep", "2", "--prefill", "1", "--decode", "1", "--port", str(free_port()))
    try:
        got = completions(ep)
        group = ranks(ep.p.pid)
        assert sorted(r for _, r, _, _ in group) == [0, 0, 1, 1], group
        decode = next(a for _, r, _, a in group if r == 0 and flag(a, "--role") == "decode")
        m = metrics(flag(decode, "--http-addr"))
        counts = [float(v) for v in re.findall(r"^cleave_moe_expert_tokens_total\{[^}]*\} (\S+)$", m, re.M)]
        # Layers 0 and 2 are sparse (8 experts each), layer 1 is dense.
        assert len(counts) == 16 and sum(counts) > 0, counts
        disagg = re.search(r"^cleave_worker_disaggregated_requests_total (\S+)$", m, re.M)
        assert disagg and float(disagg.group(1)) >= 1, "no prompt came from the prefill group"
    finally:
        ep.stop()
    # Only the order of float sums differs between one rank and two; no near tie on these.
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        assert max(abs(a - b) for a, b in zip(gl, wl)) < 1e-3, (gl, wl)


def test_ep_is_refused_for_a_dense_model_and_must_equal_tp(cleave_bin, tmp_path):
    dense = tmp_path / "tiny-llama"
    subprocess.run([cleave_bin, "model", "tiny", "--kind", "llama", str(dense)], check=True)
    r = subprocess.run(
        [cleave_bin, "up", "--model", str(dense), "--ep", "2", "--prefill", "0", "--port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode != 0
    assert "is a dense model (no experts to split); use --tp 2" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([cleave_bin, "up", "--model", str(dense), "--ep", "2", "--tp", "4"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--tp 4 and --ep 2 differ" in r.stderr, r.stderr
