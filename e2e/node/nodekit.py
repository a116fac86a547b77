"""Helpers of the node tier: the cluster's kubectl, an InferenceService of the example's shape,
readiness, metrics, the router's ClusterIP (used by the fixtures in conftest.py and the tests)."""

import json
import os
import re
import subprocess
import time
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TAG = "e2e"
IMAGE = f"localhost/cleave:{TAG}"
MODEL_IMAGE = f"localhost/cleave-model-smollm2:{TAG}"
MODEL_PATH = "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
OPERATOR_NS = "cleave-system"


class Node:
    """The session's cluster: kubectl/helm with its kubeconfig, and timings for the report."""

    def __init__(self, cluster_dir):
        self.dir = cluster_dir
        self.env = dict(os.environ)
        with open(os.path.join(cluster_dir, "env")) as f:
            for line in f:
                key, _, value = line.removeprefix("export ").strip().partition("=")
                self.env[key] = value.replace("$PATH", os.environ["PATH"])
        self.timings = {}

    def run(self, *args, input=None, check=True, timeout=180):
        r = subprocess.run(list(args), input=input, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {r.returncode}:\n{r.stdout}\n{r.stderr}")
        return r

    def kubectl(self, *args, **kw):
        return self.run("kubectl", *args, **kw).stdout

    def json(self, *args):
        return json.loads(self.kubectl(*args, "-o", "json"))

    def apply(self, obj, namespace=None):
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=json.dumps(obj))

    def wait_for(self, what, predicate, timeout=300, interval=0.5):
        """Polls predicate() until it returns something truthy; fails naming `what`. A refused or
        reset connection counts as "not yet": a Service's ClusterIP rejects connections until
        kube-proxy has programmed the endpoints of pods that just became Ready (the isvc can be
        Ready a moment before that)."""
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                last = predicate()
                if last:
                    return last
            except (AssertionError, subprocess.TimeoutExpired, json.JSONDecodeError, OSError,
                    openai.APIConnectionError) as e:
                last = e
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last})")

    def describe(self, namespace):
        """Everything a failing test needs to see: pods, events, the isvc status."""
        out = self.kubectl("get", "pods,isvc,deploy,svc", "-n", namespace, "-o", "wide", check=False)
        out += self.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False)
        return out


def model_source():
    return {"image": {"image": MODEL_IMAGE, "path": MODEL_PATH}}


def isvc(name, **overrides):
    """An InferenceService of examples/cpu-smollm2.yaml's shape, sized for a 2-core node (the
    example requests a whole CPU per worker) and with the locally built model image."""
    spec = {
        "model": {"servedName": "smollm2", "source": model_source()},
        "prefill": {"replicas": 1, "threads": 1,
                    "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}},
        "decode": {"replicas": 1, "threads": 1, "kvBlocks": 512,
                   "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}},
        "router": {"replicas": 1, "policy": "prefix-optimistic"},
        "kvTransfer": {"backend": "tcp"},
    }
    for key, value in overrides.items():
        spec[key] = value
    return {"apiVersion": "serving.cleave.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": name}, "spec": spec}


# Long enough (≥ 32 uncached KV blocks) that the router disaggregates it.
LONG_PROMPT = " ".join(
    f"Item {i}: the quick brown fox jumps over the lazy dog while the river runs to the sea." for i in range(40)
) + " To sum up, the fox"


def ready(node, ns, name):
    status = node.json("get", "isvc", name, "-n", ns).get("status", {})
    cond = {c["type"]: c for c in status.get("conditions", [])}
    return status if cond.get("Ready", {}).get("status") == "True" else None


def pods(node, ns, component):
    items = node.json("get", "pods", "-n", ns, "-l", f"app.kubernetes.io/component={component}")["items"]
    return [p for p in items if p["metadata"].get("deletionTimestamp") is None]


def pod_ready(p):
    return any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))


def metric(text, name):
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def scrape(ip, port):
    return urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=10).read().decode()


def metrics_port(pod):
    """The port serving /metrics: the main container's `http` port (8080 on workers, 8000 on
    routers)."""
    for p in pod["spec"]["containers"][0].get("ports", []):
        if p.get("name") == "http":
            return p["containerPort"]
    raise AssertionError(f"pod {pod['metadata']['name']} has no http port")


def router_base_url(node, ns, name):
    svc = node.json("get", "svc", f"{name}-router", "-n", ns)
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    return f"http://{svc['spec']['clusterIP']}:{port}/v1"


class BenchServe:
    """Open-loop load from `cleave bench serve` in the background: Poisson arrivals at `rate`
    req/s of `input_len` random prompt tokens (no shared prefix, so nothing is a cache hit), `rate *
    duration` of them (so about `duration` seconds of arrivals: the prompts are made up front); `result()` waits for every request to end and returns the load point's
    stats (requests, ok, errors by kind, TTFT/ITL/E2E)."""

    def __init__(self, base_url, model, rate, duration, input_len, output_len):
        self.proc = subprocess.Popen(
            [os.path.join(ROOT, "target", "debug", "cleave"), "bench", "serve", "--url", base_url,
             "--model", model, "--rate", str(rate), "--requests", str(max(1, round(rate * duration))),
             "--input-len", str(input_len), "--input-spread", "0", "--output-len", str(output_len),
             "--prefix-fraction", "0", "--warmup", "0", "--metrics", "none", "--timeout", "240",
             "--json", "--no-progress"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def result(self, timeout=400):
        out, err = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise AssertionError(f"cleave bench serve exited {self.proc.returncode}:\n{err[-3000:]}")
        return json.loads(out)["points"][0]["stats"]


def cleave_generate(prompt, max_tokens):
    out = subprocess.run(
        [os.path.join(ROOT, "target", "debug", "cleave"), "generate", "--prompt", prompt,
         "--max-tokens", str(max_tokens), "--json"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    return json.loads(out.stdout)["text"]
