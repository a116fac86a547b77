"""Killing workers: a dead prefill worker makes requests fall back to local prefill; a dead
decode worker ends its streams with an error and the router stops placing on it; no KV block
leaks on the survivors. Each worker and the router is a separate process (`cleave worker`,
`cleave router`), so they can be killed one at a time."""

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

import openai
import pytest

from conftest import free_port


class Proc:
    def __init__(self, cleave_bin, *args, env=None):
        self.p = subprocess.Popen([cleave_bin, *args], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, **(env or {})})
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"{args[0]} exited with {self.p.wait()}")
        self.addrs = json.loads(line)
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.p.kill()


def metric(proc, name):
    body = urllib.request.urlopen(f"http://{proc.addrs['http']}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(m.group(1)) if m else None


def metric_sum(proc, name):
    """The sum of every series of `name`, labelled or not."""
    body = urllib.request.urlopen(f"http://{proc.addrs['http']}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", body, re.M))


def wait_until(cond, timeout=30, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture()
def fleet(cleave_bin):
    procs = []

    def worker(role, env=None):
        p = Proc(cleave_bin, "worker", "--role", role, "--kv-blocks", "256", "--model", model_path(cleave_bin), env=env)
        procs.append(p)
        return p

    def router(prefill, decode, *extra):
        port = free_port()
        args = ["router", "--model", model_path(cleave_bin), "--listen", f"127.0.0.1:{port}", "--disagg-min-uncached-blocks", "1", *extra]
        for p in prefill:
            args += ["--prefill", f"http://{p.addrs['grpc']}"]
        for d in decode:
            args += ["--decode", f"http://{d.addrs['grpc']}"]
        r = Proc(cleave_bin, *args)
        procs.append(r)
        base = f"http://{r.addrs['http']}"
        wait_until(lambda: ready(base), what="router ready")
        wait_until(lambda: metric(r, "cleave_router_healthy_decode_workers") == len(decode),
                   what="the router seeing every decode worker healthy")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        client.model = client.models.list().data[0].id
        client._cleave_router = r
        return client

    yield worker, router
    for p in procs:
        p.stop()


def ready(base):
    try:
        return urllib.request.urlopen(f"{base}/ready", timeout=2).status == 200
    except Exception:
        return False


def model_path(cleave_bin):
    return subprocess.run([cleave_bin, "model", "path"], capture_output=True, text=True, check=True).stdout.strip()


LONG = "Licensed under the Apache License, Version 2.0; you may not use this file except in compliance with the License. " * 30


def test_dead_prefill_worker_means_local_prefill_and_no_leak(fleet):
    """The fault point `prefill.kv_blocks_sent=4` makes the prefill worker exit (status 86)
    with a long prompt's KV writes in flight: the decode worker computes the prompt itself
    (counted in `prefill_fallbacks_total`) and nothing leaks."""
    worker, router = fleet
    p = worker("prefill", env={"CLEAVE_FAULT": "prefill.kv_blocks_sent=4"})
    d = worker("decode")
    client = router([p], [d])
    # A short prompt sends fewer than 4 blocks: disaggregated, and the prefill worker lives.
    ok = client.completions.create(model=client.model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in ok.choices[0].text
    assert metric(d, "cleave_worker_disaggregated_requests_total") == 1
    assert metric(d, "cleave_worker_prefill_fallbacks_total") == 0
    r = client.completions.create(model=client.model, prompt=LONG, max_tokens=8, temperature=0)
    assert r.usage.completion_tokens == 8
    assert p.p.wait(timeout=30) == 86, "the fault point did not stop the prefill worker"
    assert metric(d, "cleave_worker_prefill_fallbacks_total") == 1
    # And later requests still work (prefilled on the decode worker).
    again = client.completions.create(model=client.model, prompt=LONG + " Again.", max_tokens=4, temperature=0)
    assert again.usage.completion_tokens == 4
    wait_until(lambda: metric(d, "cleave_kv_blocks_used") == 0, what="decode worker blocks back to 0")


def test_dead_decode_worker_with_migration_off_ends_its_stream_with_an_error_and_is_avoided(fleet):
    worker, router = fleet
    d1, d2 = worker("decode"), worker("decode")
    client = router([], [d1, d2], "--migration-limit", "0")
    stream = client.completions.create(model=client.model, prompt="Once upon a time", max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    victim = d1 if (metric(d1, "cleave_worker_running_sequences") or 0) > 0 else d2
    survivor = d2 if victim is d1 else d1
    victim.kill()
    # The OpenAI error names why the stream was not moved.
    with pytest.raises(openai.APIError, match="migration-limit 0"):
        for _ in it:
            pass
    # New requests go to the survivor.
    for i in range(4):
        r = client.completions.create(model=client.model, prompt=f"Request {i}: hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    wait_until(lambda: metric(survivor, "cleave_kv_blocks_used") == 0, what="survivor blocks back to 0")


def test_a_decode_worker_dying_at_the_grpc_call_is_placed_around(fleet):
    """The fault point `decode.generate_calls=1` makes the victim exit (status 86) as its first
    Generate call arrives: the router's call fails before any event, so the router marks it
    unhealthy and places the request again (not a migration: nothing was streamed)."""
    worker, router = fleet
    victim = worker("decode", env={"CLEAVE_FAULT": "decode.generate_calls=1"})
    survivor = worker("decode")
    client = router([], [victim, survivor], "--policy", "round-robin")
    for i in range(4):
        r = client.completions.create(model=client.model, prompt=f"Request {i}: hello", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
    assert victim.p.wait(timeout=30) == 86
    routed = client_router(client)
    # Round-robin tried the victim once: one placement more than requests, no migration.
    assert metric_sum(routed, "cleave_router_placements_total") == 5
    assert (metric(routed, "cleave_router_migrations_total") or 0) == 0


def stream_completion(client, prompt, **kw):
    """Streams one completion: (text, chunk ids, finish reason, usage)."""
    text, ids, finish, usage = "", set(), None, None
    for chunk in client.completions.create(model=client.model, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **kw):
        ids.add(chunk.id)
        if chunk.choices:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    return text, ids, finish, usage


MIGRATED = [dict(prompt=f"Story {i}: once upon a time, in a land far away,", max_tokens=24, temperature=0)
            for i in range(6)] + [dict(prompt=f"Poem {i}: the sea at night", max_tokens=24, temperature=0.9, seed=1234)
                                  for i in range(2)]


def test_decode_worker_dying_mid_stream_migrates_its_streams_which_go_on_unchanged(fleet):
    """The fault point `decode.tokens_streamed=5` makes the victim exit (status 86) once one of
    its streams has sent 5 tokens: its streams are in flight, mid-stream. With round-robin
    placement over [victim, survivor], 4 of the 8 concurrent streams are on the victim; every
    stream must end as an uninterrupted run on the survivor alone does (greedy and seeded
    sampling), with one response id and usage counting every token once."""
    worker, router = fleet
    survivor = worker("decode")
    reference = router([], [survivor])
    want = [stream_completion(reference, extra_body={"ignore_eos": True}, **r) for r in MIGRATED]
    victim = worker("decode", env={"CLEAVE_FAULT": "decode.tokens_streamed=5"})
    client = router([], [victim, survivor], "--policy", "round-robin")
    got = [None] * len(MIGRATED)

    def one(i):
        try:
            got[i] = stream_completion(client, extra_body={"ignore_eos": True}, **MIGRATED[i])
        except Exception as e:  # noqa: BLE001 - reported below
            got[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(MIGRATED))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert victim.p.wait(timeout=30) == 86, "the fault point did not stop the victim"
    for i, (g, w) in enumerate(zip(got, want)):
        assert not isinstance(g, Exception), f"stream {i} failed: {g!r}"
        text, ids, finish, usage = g
        assert text == w[0], f"stream {i}: {text!r} != uninterrupted {w[0]!r}"
        assert len(ids) == 1 and finish == "length", (ids, finish)
        assert (usage.prompt_tokens, usage.completion_tokens) == (w[3].prompt_tokens, 24), usage
    migrations = metric(client_router(client), "cleave_router_migrations_total")
    assert migrations and migrations >= 1, migrations
    wait_until(lambda: metric(survivor, "cleave_kv_blocks_used") == 0, what="survivor blocks back to 0")


def client_router(client):
    return client._cleave_router


def test_over_capacity_gives_429_with_retry_after_not_timeouts(fleet):
    worker, router = fleet
    d = worker("decode")
    client = router([], [d], "--max-in-flight", "1", "--max-queue", "1")
    results = []

    def one(i):
        try:
            client.completions.create(model=client.model, prompt=f"Request {i}: once upon a time", max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
            results.append("ok")
        except openai.RateLimitError as e:
            results.append(("429", e.response.headers.get("retry-after")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    rejected = [r for r in results if r != "ok"]
    assert len(results) == 6
    assert results.count("ok") >= 1, results
    assert rejected and all(r[1] == "1" for r in rejected), results
    wait_until(lambda: metric(d, "cleave_kv_blocks_used") == 0, what="blocks back to 0")
