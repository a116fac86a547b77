"""Kubernetes for real: one node per test session (`scripts/kube-cluster start DIR --node`: the
control plane, containerd, a kubelet, kube-proxy and cluster DNS), cleave's image built without a
Docker daemon and imported into the node (`scripts/image`), and the operator installed from the
chart with `helm install`, running as a pod.

CLEAVE_TEST_NODE_DIR=DIR uses a node already started from DIR (its image already imported with
`scripts/image --profile dev --model --tag e2e --import DIR`). Without root or the node's packages
the tier fails under the test command (CLEAVE_REQUIRE_CLUSTER=1) and says SKIPPED otherwise."""

import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time

import pytest

from nodekit import OPERATOR_NS, ROOT, TAG, Node


SYSCTLS = ["vm.overcommit_memory", "kernel.panic", "kernel.panic_on_oops", "net.ipv4.ip_forward",
           "net.ipv4.conf.all.route_localnet"]


def host_state():
    """What the node may change on the host; `stop` must restore all of it."""
    def out(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).stdout
    # Rules and chains, not the empty built-in tables: iptables-nft creates those on first use and
    # has no command to drop them, and with only ACCEPT policies they change nothing.
    builtin = re.compile(r"^(\*\w+|COMMIT|:(PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) ACCEPT)$")
    lines = (line.split(" [")[0] for line in out("iptables-save").splitlines() if not line.startswith("#"))
    rules = sorted(line for line in lines if not builtin.match(line))
    return {
        "sysctl": {k: out("sysctl", "-n", k).strip() for k in SYSCTLS},
        "iptables": rules,
        "links": sorted(line.split()[0] for line in out("ip", "-br", "link").splitlines()),
        "kubepods cgroups": sorted(p for p in os.listdir("/sys/fs/cgroup/memory") if "kubepods" in p)
        if os.path.isdir("/sys/fs/cgroup/memory") else [],
        "host dirs": sorted(d for d in ["/var/lib/kubelet", "/var/log/pods", "/var/log/containers", "/var/lib/cni",
                                        "/run/containerd"] if os.path.exists(d)),
    }


def _node_dir():
    existing = os.environ.get("CLEAVE_TEST_NODE_DIR")
    if existing:
        return existing, None
    work = tempfile.mkdtemp(prefix="cleave-node-")
    cluster = os.path.join(work, "cluster")
    before = host_state()
    t0 = time.time()
    r = subprocess.run([os.path.join(ROOT, "scripts", "kube-cluster"), "start", cluster, "--node"],
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        msg = f"scripts/kube-cluster start --node failed:\n{r.stderr[-4000:]}"
        if os.environ.get("CLEAVE_REQUIRE_CLUSTER") == "1":
            pytest.fail(msg)
        pytest.skip("SKIPPED (no Kubernetes node on this machine): " + msg)
    return cluster, (work, time.time() - t0, before)


@pytest.fixture(scope="session")
def node():
    cluster, started = _node_dir()
    n = Node(cluster)
    if started:
        n.timings["node start"] = started[1]
    try:
        if started:
            t0 = time.time()
            subprocess.run([os.path.join(ROOT, "scripts", "image"), "--profile", "dev", "--model", "--tag", TAG,
                            "--import", cluster], check=True, timeout=600)
            n.timings["image build + import"] = time.time() - t0
        yield n
    finally:
        print("\nnode tier timings: " + ", ".join(f"{k} {v:.1f}s" for k, v in n.timings.items()))
        if started:
            subprocess.run([os.path.join(ROOT, "scripts", "kube-cluster"), "stop", cluster], timeout=300, check=True)
            mounts = [m for m in open("/proc/self/mounts").read().splitlines() if started[0] in m]
            shutil.rmtree(started[0], ignore_errors=True)
            after = host_state()
            # An error at teardown fails the session: the node left something on the host.
            assert after == started[2], f"kube-cluster stop left the host changed: before {started[2]}, after {after}"
            assert not mounts, f"mounts left under the node's folder: {mounts}"


@pytest.fixture(scope="session")
def operator(node):
    """`helm install` of charts/cleave with the local image: the operator as a pod (`upgrade
    --install`, so that a reused node (CLEAVE_TEST_NODE_DIR) takes the current chart)."""
    t0 = time.time()
    node.run("helm", "upgrade", "--install", "cleave", os.path.join(ROOT, "charts", "cleave"), "-n", OPERATOR_NS,
             "--create-namespace", "--set", "image.repository=localhost/cleave", "--set", f"image.tag={TAG}",
             "--set", "image.pullPolicy=Never", "--wait", "--timeout", "180s", timeout=240)
    node.timings["helm install to operator Ready"] = time.time() - t0
    yield OPERATOR_NS


_ns_counter = itertools.count()
_session = os.urandom(2).hex()


@pytest.fixture
def namespace(node, request):
    """A fresh namespace per test, deleted afterwards (its pods with it)."""
    # Unique across sessions too: a reused node may still be deleting an earlier run's namespace.
    ns = f"e2e-{_session}{next(_ns_counter)}-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:36].strip("-")
    node.kubectl("create", "namespace", ns)
    # Pods wait for the namespace's default ServiceAccount (its token controller makes it).
    node.wait_for("the default ServiceAccount", lambda: node.run(
        "kubectl", "get", "serviceaccount", "default", "-n", ns, check=False).returncode == 0, timeout=60)
    yield ns
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(node.describe(ns))
    node.kubectl("delete", "namespace", ns, "--wait=false", check=False)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
