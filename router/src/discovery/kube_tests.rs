use serde_json::{json, Value};

use super::*;

/// A worker pod as the operator makes it, ready at 10.1.2.3.
fn worker() -> Value {
    json!({
        "metadata": {
            "name": "svc-decode-0",
            "labels": {"app.kubernetes.io/instance": "svc", POOL_LABEL: "decode"}
        },
        "spec": {"containers": [{
            "name": "worker",
            "ports": [
                {"name": "http", "containerPort": 8080},
                {"name": "grpc", "containerPort": 50052}
            ]
        }]},
        "status": {
            "podIP": "10.1.2.3",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True"}
            ]
        }
    })
}

fn state(v: Value) -> PodState {
    pod_state(&serde_json::from_value::<Pod>(v).expect("a pod"))
}

fn serving(role: Role, endpoint: &str) -> PodState {
    PodState::Serving(Record {
        role,
        endpoint: endpoint.into(),
    })
}

#[test]
fn ready_worker_serves_on_its_grpc_port() {
    assert_eq!(
        state(worker()),
        serving(Role::Decode, "http://10.1.2.3:50052")
    );
    let mut p = worker();
    p["metadata"]["labels"][POOL_LABEL] = json!("prefill");
    assert_eq!(state(p), serving(Role::Prefill, "http://10.1.2.3:50052"));
}

#[test]
fn grpc_port_defaults_and_ipv6_is_bracketed() {
    let mut p = worker();
    p["spec"]["containers"][0]["ports"] = json!([{"name": "http", "containerPort": 8080}]);
    p["status"]["podIP"] = json!("fd00::5");
    assert_eq!(state(p), serving(Role::Decode, "http://[fd00::5]:50051"));
    let mut p = worker();
    p["spec"] = json!({"containers": [
        {"name": "sidecar"},
        {"name": "worker", "ports": [{"name": "grpc", "containerPort": 7000}]}
    ]});
    assert_eq!(state(p), serving(Role::Decode, "http://10.1.2.3:7000"));
}

#[test]
fn unready_ipless_and_terminating_pods_wait() {
    let mut p = worker();
    p["status"]["conditions"][1]["status"] = json!("False");
    assert_eq!(state(p), PodState::Waiting("not ready"));
    let mut p = worker();
    p["status"]["conditions"] = json!([{"type": "ContainersReady", "status": "True"}]);
    assert_eq!(state(p), PodState::Waiting("not ready"));
    let mut p = worker();
    p["status"] = json!({});
    assert_eq!(state(p), PodState::Waiting("not ready"));
    let mut p = worker();
    p["status"]["podIP"] = json!("");
    assert_eq!(state(p), PodState::Waiting("no pod IP"));
    let mut p = worker();
    p["status"].as_object_mut().unwrap().remove("podIP");
    assert_eq!(state(p), PodState::Waiting("no pod IP"));
    let mut p = worker();
    p["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    assert_eq!(state(p), PodState::Waiting("terminating"));
}

#[test]
fn pods_without_a_known_pool_or_a_real_ip_are_invalid() {
    let mut p = worker();
    p["metadata"]["labels"]
        .as_object_mut()
        .unwrap()
        .remove(POOL_LABEL);
    assert!(matches!(state(p), PodState::Invalid(m) if m.contains("no serving.cleave.dev/pool")));
    let mut p = worker();
    p["metadata"]["labels"][POOL_LABEL] = json!("router");
    assert!(matches!(state(p), PodState::Invalid(m) if m.contains("\"router\"")));
    let mut p = worker();
    p["status"]["podIP"] = json!("not-an-ip");
    assert!(matches!(state(p), PodState::Invalid(m) if m.contains("not-an-ip")));
}

#[test]
fn listing_keeps_only_serving_pods_by_name() {
    let mut unready = worker();
    unready["metadata"]["name"] = json!("svc-decode-1");
    unready["status"]["conditions"][1]["status"] = json!("False");
    let mut prefill = worker();
    prefill["metadata"]["name"] = json!("svc-prefill-0");
    prefill["metadata"]["labels"][POOL_LABEL] = json!("prefill");
    prefill["status"]["podIP"] = json!("10.1.2.4");
    let pods: Vec<Pod> = [worker(), unready, prefill]
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect();
    let names: Vec<String> = super::serving(&pods).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["svc-decode-0", "svc-prefill-0"]);
}

#[test]
fn only_a_groups_leader_serves() {
    // LeaderWorkerSet pods: the leader has worker-index 0.
    let mut p = worker();
    p["metadata"]["labels"][LWS_INDEX_LABEL] = json!("0");
    assert_eq!(state(p), serving(Role::Decode, "http://10.1.2.3:50052"));
    let mut p = worker();
    p["metadata"]["labels"][LWS_INDEX_LABEL] = json!("2");
    assert!(matches!(state(p), PodState::Waiting(_)));
    // The operator's StatefulSet groups: rank = pod index.
    let mut p = worker();
    p["metadata"]["labels"][GROUP_LABEL] = json!("1");
    p["metadata"]["labels"][POD_INDEX_LABEL] = json!("1");
    assert!(matches!(state(p.clone()), PodState::Waiting(_)));
    p["metadata"]["labels"][POD_INDEX_LABEL] = json!("0");
    assert_eq!(state(p), serving(Role::Decode, "http://10.1.2.3:50052"));
}
