"""Failures on a real node: pods deleted under load (the decode pod mid-stream, the prefill pod),
the operator pod killed. Each ends in a complete answer or a clean OpenAI error, never a hang, and
the system recovers by itself."""

import itertools
import threading
import time

import openai

from nodekit import (OPERATOR_NS, LONG_PROMPT, cleave_generate, isvc, metric, metrics_port, pod_ready, pods, ready,
                     router_base_url, scrape)


def serve(node, ns, name, **overrides):
    node.apply(isvc(name, **overrides), ns)
    node.wait_for(f"isvc {name} Ready", lambda: ready(node, ns, name), timeout=300)
    client = openai.OpenAI(base_url=router_base_url(node, ns, name), api_key="none", max_retries=0, timeout=60)
    model = node.wait_for("the router", lambda: client.models.list().data[0].id, timeout=60)
    return client, model


def test_decode_pod_deleted_mid_stream(node, operator, namespace):
    client, model = serve(node, namespace, "fail")
    victim = pods(node, namespace, "decode")[0]["metadata"]["name"]
    outcome = {}
    started = threading.Event()

    def stream():
        try:
            s = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Count from one to one hundred in words."}],
                max_tokens=400, temperature=0, stream=True)
            text = ""
            for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                    started.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    outcome["finish"] = chunk.choices[0].finish_reason
            outcome["text"] = text
        except openai.APIError as e:  # a clean OpenAI error is an allowed ending
            outcome["error"] = e
        finally:
            started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(120), "no token streamed"
    # The kubelet stops the container with SIGTERM; grace 0 makes it immediate.
    node.kubectl("delete", "pod", victim, "-n", namespace, "--grace-period=0", "--force", "--wait=false")
    t.join(120)
    assert not t.is_alive(), "the stream hung after its decode pod was deleted"
    assert "finish" in outcome or "error" in outcome, outcome

    # The Deployment replaces the pod; the router discovers it and places on it.
    def replaced():
        ps = pods(node, namespace, "decode")
        return ps if ps and ps[0]["metadata"]["name"] != victim and pod_ready(ps[0]) else None

    new = node.wait_for("a replacement decode pod Ready", replaced, timeout=180)[0]
    r = node.wait_for("an answer from the replacement", lambda: client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=4, temperature=0), timeout=60)
    assert r.choices[0].text
    served = metric(scrape(new["status"]["podIP"], metrics_port(new)), "cleave_prefix_cache_query_tokens_total")
    assert served > 0, "the router did not place on the new decode pod"


def test_prefill_pod_killed_then_replaced(node, operator, namespace):
    """The prefill pod deleted: the next long prompt is still answered with the same greedy text,
    either through the decode worker's fallback (the router still knew the pod) or placed locally
    (it already did not); which path ran is printed, not assumed (the Rust P/D tests pin each
    path with fault points). Once the Deployment's replacement is Ready, requests are
    disaggregated again: the router discovered it."""
    client, model = serve(node, namespace, "nopf")
    prefill = pods(node, namespace, "prefill")[0]["metadata"]["name"]
    decode = pods(node, namespace, "decode")[0]
    ip, port = decode["status"]["podIP"], metrics_port(decode)
    counters = ("cleave_worker_prefill_fallbacks_total", "cleave_worker_disaggregated_requests_total")
    before = [metric(scrape(ip, port), c) for c in counters]
    node.kubectl("delete", "pod", prefill, "-n", namespace, "--grace-period=0", "--force", "--wait=false")
    r = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == cleave_generate(LONG_PROMPT, 8)
    mid = [metric(scrape(ip, port), c) for c in counters]
    print(f"\nafter the prefill pod was deleted: fallbacks +{mid[0] - before[0]:.0f}, "
          f"disaggregated +{mid[1] - before[1]:.0f}")

    def replaced():
        ps = pods(node, namespace, "prefill")
        return ps if ps and ps[0]["metadata"]["name"] != prefill and pod_ready(ps[0]) else None

    node.wait_for("a replacement prefill pod Ready", replaced, timeout=180)

    attempt = itertools.count()

    def disaggregated_again():
        # A new first sentence each time: nothing of it is in the decode pod's prefix cache.
        prompt = f"Attempt {next(attempt)}. {LONG_PROMPT}"
        client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
        return metric(scrape(ip, port), counters[1]) > mid[1]

    node.wait_for("a request disaggregated through the new prefill pod", disaggregated_again, timeout=60, interval=2)


def test_operator_pod_killed_reconciliation_resumes(node, operator, namespace):
    node.apply(isvc("lead", **{"prefill": {"replicas": 0}}), namespace)
    node.wait_for("isvc lead Ready", lambda: ready(node, namespace, "lead"), timeout=300)
    op = node.json("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=cleave-operator")["items"][0]
    holder = lambda: node.json("get", "lease", "cleave", "-n", OPERATOR_NS)["spec"].get("holderIdentity")  # noqa: E731
    assert holder() == op["metadata"]["name"]
    node.kubectl("delete", "pod", op["metadata"]["name"], "-n", OPERATOR_NS, "--grace-period=0", "--force")
    t0 = time.time()
    new_leader = node.wait_for("a new operator leader", lambda: (h := holder()) and h != op["metadata"]["name"] and h,
                               timeout=120)
    # Reconciliation resumes: a spec change made now is applied by the new leader.
    node.kubectl("patch", "isvc", "lead", "-n", namespace, "--type", "merge", "-p",
                 '{"spec":{"router":{"replicas":2}}}')
    node.wait_for("the router scaled to 2 by the new leader", lambda: node.json(
        "get", "deployment", "lead-router", "-n", namespace)["spec"]["replicas"] == 2, timeout=120)
    node.timings["operator pod killed to new leader"] = time.time() - t0
    assert new_leader
