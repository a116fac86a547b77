"""A multi-node decode group on a real node: tensor parallelism across 3 pods (one StatefulSet;
the API server has no LeaderWorkerSet), the followers finding the leader through cluster DNS.
Deleting a follower pod fails the group fast (a clean error, never a hang) and it re-forms.

TP=3, not 2: the default model has 9 attention heads (3 KV heads), which 2 does not divide."""

import time

import openai

from nodekit import isvc, pod_ready, pods, ready, router_base_url


def test_tensor_parallel_group_across_pods_fails_fast_and_reforms(node, operator, namespace):
    spec = isvc("tp", prefill={"replicas": 0},
                decode={"replicas": 1, "threads": 1, "kvBlocks": 128,
                        "parallelism": {"tensor": 3, "nodesPerGroup": 3},
                        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}})
    t0 = time.time()
    node.apply(spec, namespace)
    node.wait_for("isvc tp Ready", lambda: ready(node, namespace, "tp"), timeout=300)
    group = pods(node, namespace, "decode")
    assert len(group) == 3 and all(pod_ready(p) for p in group), [p["metadata"]["name"] for p in group]
    node.timings["TP=3 group apply to Ready"] = time.time() - t0
    client = openai.OpenAI(base_url=router_base_url(node, namespace, "tp"), api_key="none", max_retries=0,
                           timeout=60)
    model = node.wait_for("the router", lambda: client.models.list().data[0].id, timeout=60)
    want = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                     temperature=0).choices[0].text
    assert want

    follower = next(p["metadata"]["name"] for p in group if p["metadata"]["name"].endswith("-1"))
    node.kubectl("delete", "pod", follower, "-n", namespace, "--grace-period=0", "--force", "--wait=false")
    t1 = time.time()
    # While the group is down a request ends in a clean error or an answer, within its timeout.
    try:
        client.completions.create(model=model, prompt="During the failure", max_tokens=4, temperature=0)
    except openai.APIError as e:
        print(f"\nduring the group failure: {type(e).__name__}: {e}")

    def reformed():
        ps = pods(node, namespace, "decode")
        if len(ps) != 3 or not all(pod_ready(p) for p in ps):
            return None
        try:
            return client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                             temperature=0).choices[0].text
        except openai.APIError:  # the router turns Ready a probe period after the group
            return None

    got = node.wait_for("the group re-formed and serving", reformed, timeout=240, interval=1)
    node.timings["TP=3 follower deleted to serving again"] = time.time() - t1
    assert got == want
