//! Against a real kube-apiserver (KUBECONFIG; skipped without one unless
//! CLEAVE_REQUIRE_CLUSTER=1): CRD install, examples reconciled into the expected objects, status
//! and printer columns, replicas reconciled back, spec changes rolling objects, invalid specs
//! (422 and status), garbage collection, leader election, and `helm install` of the chart.

use crate::common;

use common::{eventually, install_crd};

use std::process::Command;
use std::time::Duration;

use cleave_operator::crd::InferenceService;
use cleave_operator::leader::LeaseLock;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::ResourceExt;
use serde_json::json;

fn replicas(d: &Deployment) -> i32 {
    d.spec.as_ref().unwrap().replicas.unwrap()
}

async fn deployment(api: &Api<Deployment>, name: &str) -> Deployment {
    eventually(&format!("deployment {name}"), || async {
        api.get(name).await.ok()
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_reconciles_examples_against_a_real_apiserver() {
    let Some(client) = cleave_testkube::client("operator cluster test").await else {
        return;
    };
    install_crd(&client).await;
    let ns = cleave_testkube::TestNamespace::create(&client, "op").await;
    let (stop, running) = common::start_controller(&client);

    let isvcs: Api<InferenceService> = Api::namespaced(client.clone(), &ns.name);
    let deps: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    let stss: Api<StatefulSet> = Api::namespaced(client.clone(), &ns.name);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    for (file, mut isvc) in common::examples() {
        isvc.metadata.namespace = Some(ns.name.clone());
        isvcs
            .create(&PostParams::default(), &isvc)
            .await
            .unwrap_or_else(|e| panic!("{file} rejected: {e}"));
    }

    // CPU example: Deployments with the right replicas, image, config and owner.
    let small = isvcs.get("smollm2").await.unwrap();
    let decode = deployment(&deps, "smollm2-decode").await;
    assert_eq!(replicas(&decode), 1);
    let owner = &decode.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(owner.uid, small.uid().unwrap());
    assert_eq!(owner.kind, "InferenceService");
    let pod = decode
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    assert_eq!(
        pod.containers[0].image.as_deref(),
        Some("cleave:cluster-test")
    );
    assert_eq!(
        pod.init_containers.as_ref().unwrap()[0].image.as_deref(),
        Some("ghcr.io/cleave-project/cleave-model-smollm2:0.1.0")
    );
    let cm = cms.get("smollm2-decode").await.unwrap();
    let data = cm.data.unwrap();
    assert_eq!(
        data["CLEAVE_MODEL"],
        "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
    );
    assert_eq!(data["CLEAVE_TRANSPORT"], "tcp");
    let router = deployment(&deps, "smollm2-router").await;
    let args = router.spec.unwrap().template.spec.unwrap().containers[0]
        .args
        .clone()
        .unwrap();
    assert!(
        args.contains(&"app.kubernetes.io/instance=smollm2".to_string()),
        "{args:?}"
    );
    // GPU example: the autoscaled decode pool starts at its minimum.
    assert_eq!(replicas(&deployment(&deps, "llama-8b-decode").await), 2);
    // Multi-node example (no LeaderWorkerSet on this server): one StatefulSet per group.
    let g0 = eventually("moe group StatefulSet", || async {
        stss.get("moe-large-decode-g0").await.ok()
    })
    .await;
    assert_eq!(g0.spec.unwrap().replicas, Some(2));

    // Status and printer columns (no kubelet: nothing becomes ready).
    let status = eventually("smollm2 status", || async {
        let s = isvcs.get("smollm2").await.ok()?.status?;
        (s.observed_generation == small.metadata.generation).then_some(s)
    })
    .await;
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "ReplicasNotReady")
    );
    assert_eq!(status.decode.summary, "0/1");
    assert!(status
        .router_endpoint
        .unwrap()
        .starts_with("http://smollm2-router."));
    if let Some(kubectl) = common::tool("kubectl", "printer columns") {
        let out = common::run(Command::new(kubectl).args([
            "get",
            "inferenceservices",
            "-n",
            &ns.name,
            "-o",
            "wide",
        ]));
        let line = out
            .lines()
            .find(|l| l.starts_with("smollm2"))
            .unwrap_or_else(|| panic!("{out}"));
        for want in ["False", "0/1", "ReplicasNotReady", "smollm2-router"] {
            assert!(line.contains(want), "{want} missing from {out}");
        }
        assert!(out.lines().next().unwrap().contains("PREFILL"), "{out}");
    }

    // A user's edit of a Deployment's replicas is reconciled back to the spec.
    deps.patch(
        "smollm2-decode",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": 5}})),
    )
    .await
    .unwrap();
    eventually("replicas reconciled back to 1", || async {
        (replicas(&deps.get("smollm2-decode").await.ok()?) == 1).then_some(())
    })
    .await;

    // Changing replicas and the model rolls the objects.
    let hash = |d: &Deployment| {
        let hash = cleave_operator::render::pods::config_hash(d);
        hash.expect("the pods carry the config hash").to_string()
    };
    let before = hash(&deps.get("smollm2-decode").await.unwrap());
    let change = json!({"spec": {"decode": {"replicas": 3},
        "model": {"source": {"image": {"image": "models:2", "path": "/m/other.gguf"}}}}});
    isvcs
        .patch("smollm2", &PatchParams::default(), &Patch::Merge(change))
        .await
        .unwrap();
    let rolled = eventually("decode rolled", || async {
        let d = deps.get("smollm2-decode").await.ok()?;
        (replicas(&d) == 3 && hash(&d) != before).then_some(d)
    })
    .await;
    let init = &rolled
        .spec
        .unwrap()
        .template
        .spec
        .unwrap()
        .init_containers
        .unwrap()[0];
    assert_eq!(init.image.as_deref(), Some("models:2"));
    assert_eq!(
        cms.get("smollm2-decode").await.unwrap().data.unwrap()["CLEAVE_MODEL"],
        "/models/other.gguf"
    );

    // Nonsense the schema can express is a 422 from the API server.
    let mut bad: InferenceService = common::examples().remove(0).1;
    bad.metadata.name = Some("bad".into());
    bad.metadata.namespace = Some(ns.name.clone());
    bad.spec.decode.parallelism.tensor = 0;
    match isvcs.create(&PostParams::default(), &bad).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{s:?}"),
        other => panic!("tensor 0 was not rejected: {other:?}"),
    }
    let bad_kv = json!({"apiVersion": "serving.cleave.dev/v1alpha1", "kind": "InferenceService",
        "metadata": {"name": "bad2"}, "spec": {"model": {"source": {"path": {"path": "/m.gguf"}}},
        "kvTransfer": {"backend": "carrier-pigeon"}}});
    let dynamic: Api<kube::api::DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns.name,
        &kube::api::ApiResource::erase::<InferenceService>(&()),
    );
    match dynamic
        .create(
            &PostParams::default(),
            &serde_json::from_value(bad_kv).unwrap(),
        )
        .await
    {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{s:?}"),
        other => panic!("an unknown kvTransfer backend was not rejected: {other:?}"),
    }
    // What it cannot express is reported in status.
    let mut inverted: InferenceService = common::examples().remove(0).1;
    inverted.metadata.name = Some("inverted".into());
    inverted.metadata.namespace = Some(ns.name.clone());
    inverted.spec.decode.replicas = None;
    inverted.spec.decode.autoscaling = Some(cleave_operator::crd::PoolAutoscaling {
        min_replicas: 5,
        max_replicas: 3,
    });
    isvcs
        .create(&PostParams::default(), &inverted)
        .await
        .unwrap();
    let degraded = eventually("inverted bounds reported", || async {
        let s = isvcs.get("inverted").await.ok()?.status?;
        s.conditions
            .into_iter()
            .find(|c| c.type_ == "Degraded" && c.status == "True")
    })
    .await;
    assert_eq!(degraded.reason, "InvalidSpec");
    assert!(
        degraded.message.contains("minReplicas 5 > maxReplicas 3"),
        "{}",
        degraded.message
    );
    assert!(
        deps.get("inverted-decode").await.is_err(),
        "nothing is applied for an invalid spec"
    );

    // Deleting the resource garbage-collects what it owns (kube-controller-manager's GC).
    isvcs
        .delete("smollm2", &DeleteParams::default())
        .await
        .unwrap();
    eventually("garbage collection", || async {
        let gone = deps.get("smollm2-decode").await.is_err()
            && deps.get("smollm2-router").await.is_err()
            && cms.get("smollm2-decode").await.is_err();
        gone.then_some(())
    })
    .await;

    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(20), running).await;
    ns.delete().await;
}

#[tokio::test]
async fn only_one_candidate_holds_the_lease() {
    let Some(client) = cleave_testkube::client("lease test").await else {
        return;
    };
    let ns = cleave_testkube::TestNamespace::create(&client, "lease").await;
    let ttl = Duration::from_secs(30);
    let a = LeaseLock::new(client.clone(), &ns.name, "op", "a", ttl);
    let b = LeaseLock::new(client.clone(), &ns.name, "op", "b", ttl);
    assert!(a.try_acquire().await.unwrap());
    assert!(!b.try_acquire().await.unwrap(), "b took a held lease");
    assert!(a.try_acquire().await.unwrap(), "a renews");
    a.release().await.unwrap();
    assert!(b.try_acquire().await.unwrap(), "b takes a released lease");
    assert!(!a.try_acquire().await.unwrap());
    ns.delete().await;
}

#[tokio::test]
async fn helm_installs_the_chart() {
    let Some(client) = cleave_testkube::client("helm install").await else {
        return;
    };
    let Some(helm) = common::tool("helm", "helm install") else {
        return;
    };
    let ns = cleave_testkube::TestNamespace::create(&client, "chart").await;
    let chart = common::root().join("charts/cleave");
    common::run(
        Command::new(&helm)
            .args(["install", "cleave"])
            .arg(&chart)
            .args(["--namespace", &ns.name, "--set", "replicaCount=2"]),
    );
    let deps: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    let d = deps.get("cleave").await.expect("the operator Deployment");
    assert_eq!(d.spec.as_ref().unwrap().replicas, Some(2));
    let c = &d.spec.unwrap().template.spec.unwrap().containers[0];
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(sc.allow_privilege_escalation, Some(false));
    common::run(Command::new(&helm).args(["uninstall", "cleave", "--namespace", &ns.name]));
    ns.delete().await;
}
