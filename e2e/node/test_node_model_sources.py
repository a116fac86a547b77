"""The model delivered the two other ways users deliver it, on a real node: a file on the node
(`model.source.path` without a claim: a hostPath volume) and a file on a local
PersistentVolume bound to a claim (`path.claimName`). The pods read it read-only from /models and
answer with the greedy text `cleave generate` gives. (The `image` source is what every other test
of the tier uses.)"""

import os
import shutil
import subprocess

import openai

from nodekit import ROOT, cleave_generate, isvc, pods, ready, router_base_url

PROMPT = "The capital of France is"


def host_model(node, name):
    """A folder under the node's own directory holding the default model's GGUF."""
    gguf = subprocess.run([os.path.join(ROOT, "target", "debug", "cleave"), "model", "fetch"], capture_output=True,
                          text=True, check=True, timeout=300).stdout.strip().splitlines()[-1]
    folder = os.path.join(node.dir, name)
    os.makedirs(folder, exist_ok=True)
    os.chmod(folder, 0o755)
    shutil.copy(gguf, folder)
    os.chmod(os.path.join(folder, os.path.basename(gguf)), 0o644)
    return folder, os.path.basename(gguf)


def serve_and_check(node, ns, name, source):
    # prefill and decode both mount the model; the prompt is short, so decode computes it.
    node.apply(isvc(name, model={"servedName": "smollm2", "source": source}), ns)
    node.wait_for(f"isvc {name} Ready", lambda: ready(node, ns, name), timeout=300)
    for component in ("prefill", "decode"):
        volumes = pods(node, ns, component)[0]["spec"]["volumes"]
        model = next(v for v in volumes if v["name"] == "model")
        assert ("hostPath" in model) == ("path" in source and "claimName" not in source["path"]), model
        assert ("persistentVolumeClaim" in model) == ("claimName" in source.get("path", {})), model
    client = openai.OpenAI(base_url=router_base_url(node, ns, name), api_key="none", max_retries=0, timeout=120)
    model_id = node.wait_for("the router", lambda: client.models.list().data[0].id, timeout=60)
    r = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == cleave_generate(PROMPT, 8)


def test_model_from_a_host_path(node, operator, namespace):
    folder, file = host_model(node, "host-models")
    serve_and_check(node, namespace, "hostpath", {"path": {"path": f"{folder}/{file}"}})


def test_model_from_a_local_persistent_volume(node, operator, namespace):
    folder, file = host_model(node, "local-pv")
    node_name = node.json("get", "nodes")["items"][0]["metadata"]["name"]
    pv = f"{namespace}-models"
    node.apply({
        "apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": pv},
        "spec": {
            "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "cleave-local-models",
            "local": {"path": folder},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node_name]}]}]}},
        },
    })
    try:
        node.apply({
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models"},
            "spec": {"accessModes": ["ReadWriteOnce"], "storageClassName": "cleave-local-models",
                     "volumeName": pv, "resources": {"requests": {"storage": "1Gi"}}},
        }, namespace)
        node.wait_for("the claim Bound", lambda: node.json("get", "pvc", "models", "-n", namespace)
                      ["status"].get("phase") == "Bound", timeout=60)
        serve_and_check(node, namespace, "localpv", {"path": {"claimName": "models", "path": file}})
    finally:
        # A PersistentVolume is not namespaced: the namespace's deletion would leave it.
        node.kubectl("delete", "isvc", "localpv", "-n", namespace, "--wait=true", "--timeout=120s", check=False)
        node.kubectl("delete", "pvc", "models", "-n", namespace, "--wait=true", "--timeout=60s", check=False)
        node.kubectl("delete", "pv", pv, "--wait=true", "--timeout=60s", check=False)
