"""Changes under load on a real node: a rolling update of every pod (a new image tag) under a
steady closed-loop load, and live queue-depth autoscaling up and back down under open-loop load
from `cleave bench serve`, each with zero failed requests, through the router's ClusterIP."""

import itertools
import threading
import time

import openai

from nodekit import BenchServe, isvc, pod_ready, pods, ready, router_base_url


class Load:
    """Closed-loop load: `threads` clients, each sending the next request when the last ended.
    Every request must succeed; no retries (max_retries=0), so a failure is counted."""

    def __init__(self, base_url, model, threads, prompt, max_tokens):
        self.client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
        self.model, self.prompt, self.max_tokens = model, prompt, max_tokens
        self.ok = 0
        self.failures = []
        self.stop = threading.Event()
        self.counter = itertools.count()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.loop) for _ in range(threads)]
        for t in self.threads:
            t.start()

    def loop(self):
        while not self.stop.is_set():
            # A new first sentence each time: every prompt is computed, none is a cache hit.
            prompt = self.prompt.format(n=next(self.counter))
            try:
                r = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                                                   temperature=0)
                assert r.choices[0].text is not None
                with self.lock:
                    self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure counts, whatever its kind
                with self.lock:
                    self.failures.append(repr(e))

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join(180)
        assert not any(t.is_alive() for t in self.threads), "a client hung"
        return self.ok, self.failures


def serve(node, ns, name, spec):
    node.apply(spec, ns)
    node.wait_for(f"isvc {name} Ready", lambda: ready(node, ns, name), timeout=300)
    base_url = router_base_url(node, ns, name)
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=60)
    model = node.wait_for("the router", lambda: client.models.list().data[0].id, timeout=60)
    return base_url, model


def images(node, ns):
    return {c["image"] for p in node.json("get", "pods", "-n", ns)["items"] for c in p["spec"]["containers"]}


def test_rolling_update_of_every_pod_under_load(node, operator, namespace):
    base_url, model = serve(node, namespace, "roll", isvc("roll"))
    # The same image under a second tag: changing spec.image rolls prefill, decode and router.
    new_image = "localhost/cleave:e2e-rolled"
    node.run("ctr", "--address", node.env["CLEAVE_NODE_CONTAINERD"], "-n", "k8s.io", "images", "tag", "--force",
             "localhost/cleave:e2e", new_image)
    load = Load(base_url, model, threads=2, prompt="Request {n}. The capital of France is", max_tokens=8)
    time.sleep(3)
    t0 = time.time()
    node.kubectl("patch", "isvc", "roll", "-n", namespace, "--type", "merge", "-p",
                 f'{{"spec":{{"image":"{new_image}"}}}}')
    no_decode = []

    def rolled():
        decode = [p for p in pods(node, namespace, "decode") if pod_ready(p)]
        if not decode:
            no_decode.append(time.time())
        everything = node.json("get", "pods", "-n", namespace)["items"]
        return (all(p["spec"]["containers"][0]["image"] == new_image and pod_ready(p) for p in everything)
                and ready(node, namespace, "roll"))

    node.wait_for("every pod on the new image and Ready", rolled, timeout=300, interval=0.5)
    t_roll = time.time() - t0
    time.sleep(3)
    ok, failures = load.finish()
    node.timings["rolling update of 3 pods"] = t_roll
    print(f"\nrolling update: {t_roll:.1f}s, {ok} requests answered, {len(failures)} failed")
    assert not no_decode, "there was a moment with no Ready decode pod"
    assert ok > 0 and failures == [], failures[:5]


def test_autoscaling_follows_queue_depth_up_and_down(node, operator, namespace):
    period = 5
    spec = isvc("auto",
                prefill={"replicas": 0},
                # 80 blocks of 16 tokens hold one long prompt at a time: the rest queue.
                decode={"threads": 1, "kvBlocks": 80, "autoscaling": {"minReplicas": 1, "maxReplicas": 2},
                        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}},
                autoscaling={"targetQueueDepth": 1, "periodSeconds": period, "scaleUpStabilizationSeconds": 0,
                             "scaleDownStabilizationSeconds": 20})
    base_url, model = serve(node, namespace, "auto", spec)
    # Open loop from `cleave bench serve`: 2 prompts of 600 uncached tokens a second for 6 s, more
    # than one decode pod prefills (well under 1 a second on a share of 2 cores): its queue grows.
    # The requests queued before the scale-up all stay on the first pod, so their number bounds the
    # last one's wait: 12 of them take ~100 s on an AVX2-only 2-vCPU machine (135M prefill ~70
    # tok/s there), inside bench serve's 240 s timeout; 20 did not fit.
    load = BenchServe(base_url, model, rate=2, duration=6, input_len=600, output_len=16)
    t0 = time.time()

    def replicas():
        return node.json("get", "deployment", "auto-decode", "-n", namespace)["spec"]["replicas"]

    node.wait_for("decode scaled up to 2", lambda: replicas() == 2, timeout=120)
    t_up = time.time() - t0
    up_scale = node.json("get", "isvc", "auto", "-n", namespace)["status"]["lastScale"]
    assert up_scale["pool"] == "decode" and up_scale["from"] == 1 and up_scale["to"] == 2, up_scale
    assert up_scale["queueDepth"] > 1, up_scale
    node.wait_for("the second decode pod Ready", lambda: len([p for p in pods(node, namespace, "decode")
                                                               if pod_ready(p)]) == 2, timeout=180)
    up = load.result()
    # Light open-loop load while it scales down (short prompts, well under one pod's capacity):
    # every request must still be answered, also those in flight on the pod that goes away.
    light = BenchServe(base_url, model, rate=1, duration=45, input_len=16, output_len=4)
    t1 = time.time()
    node.wait_for("decode scaled back down to 1", lambda: replicas() == 1, timeout=180)
    t_down = time.time() - t1
    node.wait_for("one decode pod left", lambda: len(pods(node, namespace, "decode")) == 1, timeout=120)
    down = light.result()
    last = node.json("get", "isvc", "auto", "-n", namespace)["status"]["lastScale"]
    assert last["from"] == 2 and last["to"] == 1, last
    node.timings["scale-up reaction"] = t_up
    node.timings["scale-down after load stopped"] = t_down
    print(f"\nautoscaling (cleave bench serve, open loop): up in {t_up:.1f}s (period {period}s; "
          f"{up_scale['reason']!r}), down {t_down:.1f}s after the load stopped "
          f"(stabilization 20s); answered {up['ok']}/{up['requests']} + {down['ok']}/{down['requests']}, "
          f"errors {up['errors']} + {down['errors']}; {last['reason']!r}; TTFT p50 under load "
          f"{up['ttft_ms']['p50'] / 1000:.1f}s (requests queued before the scale-up stay on the first pod)")
    assert up["requests"] > 0 and up["ok"] == up["requests"] and not up["errors"], up
    assert down["requests"] > 0 and down["ok"] == down["requests"] and not down["errors"], down
