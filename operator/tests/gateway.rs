//! `spec.gateway.inferencePool` against a real kube-apiserver (KUBECONFIG; skipped without one
//! unless CLEAVE_REQUIRE_CLUSTER=1): with the upstream InferencePool CRD installed, the operator
//! renders the pool and the endpoint picker, and removes the pool and the picker's Deployment
//! when the spec turns the gateway off.

use crate::common;

use std::time::Duration;

use cleave_operator::crd::{FailureMode, InferenceService};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::json;

use common::{eventually, install_crd};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renders_an_inference_pool_and_its_endpoint_picker() {
    let Some(client) = cleave_testkube::client("operator gateway test").await else {
        return;
    };
    install_crd(&client).await;
    cleave_testkube::upstream::install_crd(&client, cleave_testkube::upstream::INFERENCE_POOL_CRD)
        .await;
    let ns = cleave_testkube::TestNamespace::create(&client, "gw").await;
    let (stop, running) = common::start_controller(&client);

    let (_, mut isvc) = common::examples()
        .into_iter()
        .find(|(f, _)| f == "cpu-smollm2.yaml")
        .expect("examples/cpu-smollm2.yaml");
    isvc.metadata.name = Some("chat".into());
    isvc.metadata.namespace = Some(ns.name.clone());
    isvc.spec.gateway.inference_pool = true;
    isvc.spec.gateway.failure_mode = FailureMode::FailOpen;
    let isvcs: Api<InferenceService> = Api::namespaced(client.clone(), &ns.name);
    isvcs
        .create(&PostParams::default(), &isvc)
        .await
        .expect("the isvc");

    let pools: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns.name,
        &cleave_operator::render::gateway::inference_pool_resource(),
    );
    let pool = eventually("the InferencePool", || async {
        pools.get("chat-pool").await.ok()
    })
    .await;
    let spec = &pool.data["spec"];
    assert_eq!(
        spec["selector"]["matchLabels"]["app.kubernetes.io/component"],
        json!("decode")
    );
    assert_eq!(
        spec["endpointPickerRef"]["name"],
        json!("chat-epp"),
        "{spec}"
    );
    assert_eq!(spec["endpointPickerRef"]["failureMode"], json!("FailOpen"));
    let owner = &pool.metadata.owner_references.as_ref().expect("owned")[0];
    assert_eq!(owner.kind, "InferenceService");

    let deps: Api<Deployment> = Api::namespaced(client.clone(), &ns.name);
    let epp = eventually("the picker's Deployment", || async {
        deps.get("chat-epp").await.ok()
    })
    .await;
    let c = &epp.spec.unwrap().template.spec.unwrap().containers[0];
    assert_eq!(
        c.command.as_deref(),
        Some(&["cleave-router".to_string()][..])
    );
    let svc: Api<Service> = Api::namespaced(client.clone(), &ns.name);
    let port = svc
        .get("chat-epp")
        .await
        .expect("the picker's Service")
        .spec
        .unwrap()
        .ports
        .unwrap()[0]
        .port;
    assert_eq!(port, cleave_operator::render::gateway::EPP_PORT);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let env = cms.get("chat-epp").await.unwrap().data.unwrap();
    assert_eq!(env["CLEAVE_MODE"], "endpoint-picker");
    assert_eq!(env["CLEAVE_EPP_POOL"], "chat-pool");

    // Each decode pod answers the OpenAI API itself (the Gateway sends requests to it).
    let containers = |d: Deployment| d.spec.unwrap().template.spec.unwrap().containers;
    let decode = containers(deps.get("chat-decode").await.expect("decode"));
    assert_eq!(
        decode.iter().map(|c| c.name.as_str()).collect::<Vec<_>>(),
        ["worker", "openai"]
    );

    // Turning the gateway off removes the pool, the picker and the sidecar.
    isvcs
        .patch(
            "chat",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"gateway": {"inferencePool": false}}})),
        )
        .await
        .unwrap();
    eventually("the pool and the picker to go", || async {
        let gone = pools.get("chat-pool").await.is_err() && deps.get("chat-epp").await.is_err();
        gone.then_some(())
    })
    .await;
    eventually("the decode pods without the sidecar", || async {
        let d = deps.get("chat-decode").await.ok()?;
        (containers(d).len() == 1).then_some(())
    })
    .await;

    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(20), running).await;
    ns.delete().await;
}
