"""Bad input on a real node: each mistake a user makes surfaces in the InferenceService's status
(or as the API server's 422), naming what is wrong."""

import json
import os

import pytest

from nodekit import ROOT, isvc


def condition(node, ns, name, type_="Ready"):
    status = node.json("get", "isvc", name, "-n", ns).get("status", {})
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


def wait_reason(node, ns, name, reason, timeout=180):
    def check():
        c = condition(node, ns, name)
        return c if c and c["status"] == "False" and c["reason"] == reason else None

    return node.wait_for(f"isvc {name} Ready=False reason {reason}", check, timeout=timeout)


def one_decode(**decode):
    spec = isvc("bad")["spec"]
    return {"prefill": {**spec["prefill"], "replicas": 0}, "decode": {**spec["decode"], **decode}}


def test_an_image_that_does_not_exist_is_reported(node, operator, namespace):
    # localhost/… resolves to a registry on this machine's loopback, which does not exist.
    node.apply(isvc("bad", image="localhost/cleave:does-not-exist", **one_decode()), namespace)
    c = wait_reason(node, namespace, "bad", "ImagePullFailed")
    assert "localhost/cleave:does-not-exist" in c["message"], c
    degraded = condition(node, namespace, "bad", "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "ImagePullFailed"


def test_a_model_path_that_does_not_exist_is_named(node, operator, namespace):
    """hostPath source: the folder exists, the file does not; the worker exits naming the path,
    and its log tail (terminationMessagePolicy FallbackToLogsOnError) reaches the condition."""
    folder = os.path.join(node.dir, "models-empty")
    os.makedirs(folder, exist_ok=True)
    missing = os.path.join(folder, "missing.gguf")
    spec = isvc("bad", **one_decode())
    spec["spec"]["model"]["source"] = {"path": {"path": missing}}
    node.apply(spec, namespace)
    c = wait_reason(node, namespace, "bad", "ContainerFailing")
    assert "/models/missing.gguf" in c["message"], c
    # The container restarts in a loop (CrashLoopBackOff): between two runs containerd may have
    # no log for the current one ("unable to retrieve container logs"), so poll, also asking for
    # the previous run's log, until one of them names the path.
    def logs_name_the_path():
        for previous in ([], ["--previous"]):
            logs = node.kubectl("logs", "-n", namespace, "-l", "app.kubernetes.io/component=decode",
                                "--tail", "20", *previous, check=False)
            if "/models/missing.gguf" in logs:
                return True
        return False

    node.wait_for("the worker's log naming /models/missing.gguf", logs_name_the_path, timeout=60)


def test_a_path_missing_from_the_model_image_is_named(node, operator, namespace):
    spec = isvc("bad", **one_decode())
    spec["spec"]["model"]["source"]["image"]["path"] = "/models/not-in-the-image.gguf"
    node.apply(spec, namespace)
    c = wait_reason(node, namespace, "bad", "ContainerFailing")
    assert "copy-model" in c["message"] and "/models/not-in-the-image.gguf" in c["message"], c


def test_a_memory_limit_below_the_model_surfaces_oom_killed(node, operator, namespace):
    node.apply(isvc("bad", **one_decode(kvBlocks=20000, resources={"limits": {"memory": "48Mi"},
                                                                    "requests": {"cpu": "100m", "memory": "48Mi"}})),
               namespace)
    c = wait_reason(node, namespace, "bad", "OOMKilled")
    assert "OOMKilled" in c["message"], c


@pytest.mark.parametrize("field,value,expect", [
    ("decode", {"replicas": "two"}, "spec.decode.replicas"),
    ("kvTransfer", {"backend": "carrier-pigeon"}, "spec.kvTransfer.backend"),
    ("decode", {"replicas": 1, "kvMemory": "lots"}, "spec.decode.kvMemory"),
])
def test_a_spec_the_schema_rejects_is_a_422_naming_the_field(node, operator, namespace, field, value, expect):
    spec = isvc("bad")
    spec["spec"][field] = value
    r = node.run("kubectl", "apply", "-n", namespace, "-f", "-", input=json.dumps(spec), check=False)
    assert r.returncode != 0
    assert expect in r.stderr and "is invalid" in r.stderr, r.stderr


def test_every_example_is_accepted_and_gpu_ones_say_they_compute_on_cpus(node, operator, namespace):
    """examples/: all pass the API server's schema (server-side dry run); the GPU ones, applied
    for real, are reported as unschedulable here (no GPU node) and their status says cleave's
    engine computes on CPUs. (The CPU example is applied in the serve test, with local images.)"""
    import yaml

    folder = os.path.join(ROOT, "examples")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".yaml"))
    assert "cpu-smollm2.yaml" in files
    for f in files:
        node.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", os.path.join(folder, f))
        with open(os.path.join(folder, f)) as fh:
            text = fh.read()
        if "nvidia.com/gpu" not in text:
            continue
        assert "no GPU kernels" in text, f"{f} must say at the top that it does not run on GPUs yet"
        obj = yaml.safe_load(text)
        node.kubectl("apply", "-n", namespace, "-f", os.path.join(folder, f))
        name = obj["metadata"]["name"]

        def said():
            c = condition(node, namespace, name, "Degraded")
            return c if c and "no GPU kernels yet" in c["message"] else None

        node.wait_for(f"{f}: a status naming the CPU fallback", said, timeout=120)
        assert condition(node, namespace, name)["status"] == "False"
