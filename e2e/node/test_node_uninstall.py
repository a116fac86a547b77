"""The operator as Helm ships it, then `helm upgrade` and `helm uninstall`: the operator pod runs
non-root with a read-only root filesystem and holds the leader Lease; an upgrade rolls it; an
uninstall leaves no object of the release behind (the CRD stays, as Helm keeps `crds/`).

Runs last in the tier (file order): it removes the session's operator."""

from nodekit import OPERATOR_NS, ROOT

RELEASE_LABEL = "app.kubernetes.io/instance=cleave"
KINDS = "deployments,replicasets,pods,services,serviceaccounts,roles,rolebindings,leases,configmaps,secrets"


def operator_pods(node):
    return node.json("get", "pods", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=cleave-operator")["items"]


def test_operator_pod_as_shipped_then_upgrade_and_uninstall_leave_nothing(node, operator):
    pod = operator_pods(node)[0]
    assert pod["status"]["phase"] == "Running"
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] == 65532
    sc = spec["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    lease = node.json("get", "lease", "cleave", "-n", OPERATOR_NS)
    assert lease["spec"]["holderIdentity"] == pod["metadata"]["name"]
    assert lease["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"

    # An upgrade that changes the pod template rolls the operator; the new pod leads.
    node.run("helm", "upgrade", "cleave", f"{ROOT}/charts/cleave", "-n", OPERATOR_NS, "--reuse-values",
             "--set", "operator.logLevel=debug", "--wait", "--timeout", "180s", timeout=240)

    def rolled():
        ps = [p for p in operator_pods(node) if p["metadata"].get("deletionTimestamp") is None]
        return ps if len(ps) == 1 and ps[0]["metadata"]["name"] != pod["metadata"]["name"] else None

    new = node.wait_for("the upgraded operator pod", rolled, timeout=120)[0]
    node.wait_for("the new pod holding the Lease", lambda: node.json("get", "lease", "cleave", "-n", OPERATOR_NS)[
        "spec"].get("holderIdentity") == new["metadata"]["name"], timeout=120)

    node.run("helm", "uninstall", "cleave", "-n", OPERATOR_NS, "--wait", "--timeout", "120s", timeout=180)

    def gone():
        left = node.json("get", KINDS, "-n", OPERATOR_NS, "-l", RELEASE_LABEL)["items"]
        left += [i for i in node.json("get", "clusterroles,clusterrolebindings", "-l", RELEASE_LABEL)["items"]]
        return not left or None

    node.wait_for("no object of the release left", gone, timeout=120)
    names = [i["metadata"]["name"] for i in node.json("get", "leases", "-n", OPERATOR_NS)["items"]]
    assert "cleave" not in names, names
    node.kubectl("get", "crd", "inferenceservices.serving.cleave.dev")
