"""`kubectl apply` of an InferenceService to a served answer, on a real node: the operator (a pod,
installed by Helm) renders prefill, decode and router pods; the kubelet runs them; the official
`openai` client reaches the router through its ClusterIP (kube-proxy) and gets the greedy text
`cleave generate` gives; the decode pod's metrics show the KV came from the prefill pod."""

import re
import time

import openai

from nodekit import (LONG_PROMPT, cleave_generate, isvc, metric, metrics_port, pod_ready, pods, ready,
                     router_base_url, scrape)


def test_apply_to_a_served_disaggregated_answer(node, operator, namespace):
    t0 = time.time()
    node.apply(isvc("smollm2"), namespace)
    status = node.wait_for("isvc smollm2 Ready=True", lambda: ready(node, namespace, "smollm2"), timeout=300)
    t_ready = time.time() - t0
    for component in ("prefill", "decode", "router"):
        ps = pods(node, namespace, component)
        assert ps and all(p["status"]["phase"] == "Running" and pod_ready(p) for p in ps), (component, ps)
    assert status["routerEndpoint"] == f"http://smollm2-router.{namespace}.svc:8000/v1"
    table = node.kubectl("get", "isvc", "-n", namespace, "-o", "wide")
    assert re.search(r"^smollm2\s+True\s", table, re.M), table
    assert status["routerEndpoint"] in table, table

    base_url = router_base_url(node, namespace, "smollm2")
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    # The router's Service can route before its endpoint list reaches kube-proxy: retry the first
    # connection only (never a request that got an answer).
    model = node.wait_for("the router through its ClusterIP", lambda: client.models.list().data[0].id, timeout=60)
    t_first = time.time() - t0
    decode = pods(node, namespace, "decode")[0]
    before = metric(scrape(decode["status"]["podIP"], metrics_port(decode)), "cleave_worker_disaggregated_requests_total")

    r = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=16, temperature=0)
    assert r.choices[0].text == cleave_generate(LONG_PROMPT, 16)
    after = metric(scrape(decode["status"]["podIP"], metrics_port(decode)), "cleave_worker_disaggregated_requests_total")
    assert after == before + 1, "the decode pod did not take its KV from the prefill pod"

    router = pods(node, namespace, "router")[0]
    body = scrape(router["status"]["podIP"], metrics_port(router))
    assert metric(body, r'cleave_router_placements_total\{[^}]*mode="disaggregated"[^}]*\}') >= 1, body

    node.timings["kubectl apply to isvc Ready"] = t_ready
    node.timings["kubectl apply to first answer"] = t_first
    print(f"\napply -> Ready {t_ready:.1f}s, apply -> first answered request {t_first:.1f}s")
