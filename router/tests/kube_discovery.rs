//! Kubernetes discovery against a real API server (KUBECONFIG; see docs/kubernetes-testing.md):
//! worker pods labelled as the operator labels them are created in a namespace of their own;
//! no kubelet runs, so the test sets their status (Ready, pod IP) itself through the status
//! subresource, and checks that the router's membership follows: created (absent), ready
//! (added), unready (dropped), ready again, a new IP (replaced), deleted (dropped). Pods of
//! another instance and pods without a pool label never count.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_router::discovery::kube::Kube;
use cleave_router::discovery::Discovery;
use cleave_router::dispatch::Cluster;
use cleave_router::place::Role;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const INSTANCE: &str = "svc";

fn pod(name: &str, instance: &str, pool: Option<&str>, grpc_port: i32) -> Pod {
    let mut labels = json!({
        "app.kubernetes.io/name": "cleave",
        "app.kubernetes.io/instance": instance,
        "app.kubernetes.io/component": pool.unwrap_or("router"),
        "app.kubernetes.io/managed-by": "cleave-operator",
    });
    if let Some(pool) = pool {
        labels["serving.cleave.dev/pool"] = json!(pool);
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{
            "name": "worker",
            "image": "cleave:test",
            "ports": [
                {"name": "grpc", "containerPort": grpc_port},
                {"name": "http", "containerPort": 8080}
            ]
        }]}
    }))
    .expect("a pod")
}

/// Creates `pod`, retrying while a fresh namespace's default service account is not there yet
/// (on clusters with ServiceAccount admission).
async fn create(api: &Api<Pod>, pod: Pod) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match api.create(&PostParams::default(), &pod).await {
            Ok(_) => return,
            Err(e) if Instant::now() < deadline && e.to_string().contains("serviceaccount") => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("creating pod {:?}: {e}", pod.metadata.name),
        }
    }
}

/// Sets a pod's Ready condition and IP as a kubelet would.
async fn set_status(api: &Api<Pod>, name: &str, ready: bool, ip: &str) {
    let status = json!({"status": {
        "phase": "Running",
        "podIP": ip,
        "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
    }});
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("setting the status of pod {name}: {e}"));
}

fn members(cluster: &Cluster) -> Vec<(Role, String)> {
    let mut m: Vec<(Role, String)> = cluster
        .all()
        .into_iter()
        .map(|w| (w.role, w.endpoint))
        .collect();
    m.sort_by(|a, b| a.1.cmp(&b.1));
    m
}

/// Waits until the membership is `expected` (in any order).
async fn expect_members(cluster: &Cluster, what: &str, expected: &[(Role, &str)]) {
    let mut expected: Vec<(Role, String)> =
        expected.iter().map(|(r, e)| (*r, e.to_string())).collect();
    expected.sort_by(|a, b| a.1.cmp(&b.1));
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = members(cluster);
        if now == expected {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: membership is {now:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_follows_worker_pods() {
    let Some(client) = cleave_testkube::client("router_follows_worker_pods").await else {
        return;
    };
    let ns = cleave_testkube::TestNamespace::create(&client, "kube-discovery").await;
    let api = Api::<Pod>::namespaced(client.clone(), &ns.name);
    create(&api, pod("svc-decode-0", INSTANCE, Some("decode"), 50051)).await;
    create(&api, pod("svc-prefill-0", INSTANCE, Some("prefill"), 50052)).await;
    create(&api, pod("other-decode-0", "other", Some("decode"), 50051)).await;
    create(&api, pod("svc-router-0", INSTANCE, None, 8000)).await;

    // The real construction path (KUBECONFIG); a re-list period far beyond the test, so what
    // follows is the watch's doing.
    let selector = format!("app.kubernetes.io/instance={INSTANCE}");
    let mut discovery = Kube::connect(Some(&ns.name), &selector)
        .await
        .expect("kubernetes discovery connects");
    discovery.relist_every = Duration::from_secs(3600);
    let cluster = Arc::new(Cluster::default());
    let shutdown = CancellationToken::new();
    Box::new(discovery)
        .start(cluster.clone(), shutdown.clone())
        .expect("discovery starts");
    assert!(members(&cluster).is_empty(), "no pod is ready yet");

    set_status(&api, "svc-decode-0", true, "10.9.0.1").await;
    set_status(&api, "other-decode-0", true, "10.9.0.9").await;
    set_status(&api, "svc-router-0", true, "10.9.0.8").await;
    expect_members(
        &cluster,
        "decode ready",
        &[(Role::Decode, "http://10.9.0.1:50051")],
    )
    .await;

    set_status(&api, "svc-prefill-0", true, "10.9.0.2").await;
    let both = [
        (Role::Decode, "http://10.9.0.1:50051"),
        (Role::Prefill, "http://10.9.0.2:50052"),
    ];
    expect_members(&cluster, "prefill ready", &both).await;

    set_status(&api, "svc-decode-0", false, "10.9.0.1").await;
    expect_members(
        &cluster,
        "decode unready",
        &[(Role::Prefill, "http://10.9.0.2:50052")],
    )
    .await;

    set_status(&api, "svc-decode-0", true, "10.9.0.1").await;
    expect_members(&cluster, "decode ready again", &both).await;

    set_status(&api, "svc-decode-0", true, "10.9.0.3").await;
    expect_members(
        &cluster,
        "decode moved to a new IP",
        &[
            (Role::Decode, "http://10.9.0.3:50051"),
            (Role::Prefill, "http://10.9.0.2:50052"),
        ],
    )
    .await;

    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    api.delete("svc-decode-0", &now)
        .await
        .expect("deleting a pod");
    expect_members(
        &cluster,
        "decode deleted",
        &[(Role::Prefill, "http://10.9.0.2:50052")],
    )
    .await;
    api.delete("svc-prefill-0", &now)
        .await
        .expect("deleting a pod");
    expect_members(&cluster, "prefill deleted", &[]).await;

    shutdown.cancel();
    ns.delete().await;
}
