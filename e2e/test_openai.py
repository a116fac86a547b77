"""The official `openai` Python client against `cleave up` (1 prefill + 2 decode workers)."""

import concurrent.futures
import json
import subprocess
import urllib.request

import openai
import pytest


def test_models_lists_the_served_model(client, model_name):
    assert model_name.startswith("SmolLM2")


def test_completion_greedy_equals_cleave_generate(client, model_name, cleave_bin):
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert "Paris" in text
    assert r.usage.completion_tokens == 12 or r.choices[0].finish_reason == "stop"
    out = subprocess.run(
        [cleave_bin, "generate", "--prompt", "The capital of France is", "--max-tokens", "12", "--json"],
        capture_output=True, text=True, check=True,
    )
    assert json.loads(out.stdout)["text"] == text


def test_chat_non_streaming_with_usage(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=40, temperature=0
    )
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_include_usage(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=30,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    assert "".join(pieces).strip()
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0
    # The same request without streaming gives the same text.
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Count from one to five."}], max_tokens=30, temperature=0
    )
    assert r.choices[0].message.content == "".join(pieces)


def test_stop_sequence_and_max_tokens(client, model_name):
    r = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=12, temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_seed_reproducibility(client, model_name):
    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_logprobs(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) >= 1
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob


def test_sixteen_concurrent_streams_complete(client, model_name):
    def one(i):
        stream = client.completions.create(
            model=model_name, prompt=f"Story number {i}: once upon a time", max_tokens=12, temperature=0, stream=True
        )
        return sum(1 for _ in stream)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        counts = list(pool.map(one, range(16)))
    assert all(c >= 2 for c in counts), counts


def test_multi_turn_reuses_the_cached_prefix(client, model_name):
    history = [
        {"role": "system", "content": "You are a helpful assistant who answers briefly and precisely. " * 4},
        {"role": "user", "content": "Name a primary color."},
    ]
    first = client.chat.completions.create(model=model_name, messages=history, max_tokens=10, temperature=0)
    history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "Name another one."}]
    second = client.chat.completions.create(model=model_name, messages=history, max_tokens=10, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48, f"the second turn found only {cached} cached prompt tokens"


def test_bad_requests_get_openai_errors(client, model_name):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="hi", max_tokens=2, temperature=5)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt="hi", max_tokens=10_000_000)
    assert "context" in str(e.value)


def test_router_metrics(cluster, client, model_name):
    client.completions.create(model=model_name, prompt="Hello", max_tokens=2, temperature=0)
    body = urllib.request.urlopen(f"http://127.0.0.1:{cluster['port']}/metrics").read().decode()
    for name in [
        "cleave_router_requests_total",
        "cleave_router_time_to_first_token_seconds",
        "cleave_router_inter_token_latency_seconds",
        "cleave_router_queue_depth",
        "cleave_router_placements_total",
    ]:
        assert name in body, name
