//! `spec.gateway.inferencePool`: the objects that plug an InferenceService into an Envoy-based
//! Gateway through the Gateway API Inference Extension.
//!
//! - an `InferencePool` (`inference.networking.k8s.io/v1`, `<name>-pool`) selecting the decode
//!   pods on their HTTP port, naming the endpoint picker Service as its `endpointPickerRef`;
//! - the endpoint picker: `cleave-router --mode endpoint-picker` (Deployment `<name>-epp`, one
//!   replica: it keeps optimistic load in memory, so it does not run active-active), configured
//!   through a ConfigMap rendered from the router's own config type, with a Service on its
//!   ext_proc port;
//! - a rule on the router's Role so the picker (same ServiceAccount) can read InferencePools.
//!
//! An HTTPRoute pointing at the pool is the Gateway owner's to write (it names their Gateway).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMap, ContainerPort, EnvFromSource, PodTemplateSpec, Probe, Service, ServicePort,
    ServiceSpec, TCPSocketAction,
};
use k8s_openapi::api::rbac::v1::PolicyRule;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::DynamicObject;
use kube::ResourceExt;
use serde_json::json;

use super::names::{self, Component};
use super::{config, config_hash, model, objects, pods, Desired, RenderError};
use crate::crd::{FailureMode, InferenceService};

/// The endpoint picker's ext_proc (and gRPC health) port, the protocol's default.
pub const EPP_PORT: i32 = 9002;
/// `app.kubernetes.io/component` of the endpoint picker.
pub const COMPONENT: &str = "endpoint-picker";

/// The InferencePool API (the endpoint picker's own definition).
use cleave_config::epp::{
    INFERENCE_POOL_GROUP, INFERENCE_POOL_KIND, INFERENCE_POOL_PLURAL, INFERENCE_POOL_VERSION,
};

/// The InferencePool API resource the router's endpoint picker follows.
pub fn inference_pool_resource() -> kube::api::ApiResource {
    kube::api::ApiResource::from_gvk_with_plural(
        &kube::api::GroupVersionKind::gvk(
            INFERENCE_POOL_GROUP,
            INFERENCE_POOL_VERSION,
            INFERENCE_POOL_KIND,
        ),
        INFERENCE_POOL_PLURAL,
    )
}

/// `<name>-pool`: the InferencePool.
pub fn pool_name(name: &str) -> String {
    format!("{name}-pool")
}

/// `<name>-epp`: the endpoint picker's Deployment, Service and ConfigMap.
pub fn epp_name(name: &str) -> String {
    format!("{name}-epp")
}

fn epp_labels(name: &str) -> BTreeMap<String, String> {
    let mut l = names::labels(name, Component::Router);
    l.insert("app.kubernetes.io/component".into(), COMPONENT.into());
    l
}

fn epp_selector(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (names::INSTANCE.to_string(), name.to_string()),
        ("app.kubernetes.io/component".to_string(), COMPONENT.into()),
    ])
}

fn epp_env(
    isvc: &InferenceService,
    model_path: &str,
) -> Result<BTreeMap<String, String>, RenderError> {
    let name = isvc.name_any();
    let mut settings = vec![
        ("mode", "endpoint-picker".to_string()),
        ("epp_listen", format!("0.0.0.0:{EPP_PORT}")),
        ("pool", pool_name(&name)),
        ("kube_namespace", isvc.namespace().unwrap_or_default()),
        ("model", model_path.to_string()),
        ("policy", isvc.spec.router.policy.as_flag().to_string()),
    ];
    settings.extend(super::model_text_settings(isvc));
    Ok(config::router_env(&settings)
        .map_err(RenderError::settings("endpoint-picker"))?
        .0)
}

/// The InferencePool for `isvc`'s decode pods.
pub fn inference_pool(isvc: &InferenceService, owner: &OwnerReference) -> DynamicObject {
    let name = isvc.name_any();
    let ns = isvc.namespace().unwrap_or_default();
    let mut obj = DynamicObject::new(&pool_name(&name), &inference_pool_resource());
    obj.metadata = objects::meta(pool_name(&name), &ns, epp_labels(&name), owner);
    let failure_mode = match isvc.spec.gateway.failure_mode {
        FailureMode::FailClose => "FailClose",
        FailureMode::FailOpen => "FailOpen",
    };
    obj.data = json!({
        "spec": {
            "selector": {"matchLabels": names::selector(&name, Component::Decode)},
            "targetPorts": [{"number": pods::ROUTER_HTTP_PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": epp_name(&name),
                "port": {"number": EPP_PORT},
                "failureMode": failure_mode,
            },
        }
    });
    obj
}

/// Port name of the OpenAI sidecar in decode pods (the InferencePool's target port).
pub const OPENAI_PORT_NAME: &str = "openai";

/// Makes a decode pod answer the OpenAI API itself when `spec.gateway.inferencePool` is set,
/// so that the Gateway can send a request to the pod the picker chose: a `cleave-router`
/// container beside the worker, dispatching to that worker only (`--decode` on loopback) and
/// to the instance's prefill pods (Kubernetes discovery, selector `…,serving.cleave.dev/pool=
/// prefill`) for disaggregated prefill. It runs as the router's ServiceAccount (it lists pods)
/// and reads the router's ConfigMap (model, served name, policy, API keys).
pub fn serve_openai(isvc: &InferenceService, image: &str, template: &mut PodTemplateSpec) {
    if !isvc.spec.gateway.inference_pool {
        return;
    }
    let name = isvc.name_any();
    let Some(spec) = template.spec.as_mut() else {
        return;
    };
    let mut c = pods::router_container(
        isvc,
        image,
        "openai",
        OPENAI_PORT_NAME,
        vec![
            "--decode".into(),
            format!("http://127.0.0.1:{}", pods::GRPC_PORT),
            "--discovery".into(),
            "kubernetes".into(),
            "--kube-namespace".into(),
            isvc.namespace().unwrap_or_default(),
            "--kube-selector".into(),
            format!(
                "{},{}={}",
                names::instance_selector(&name),
                names::POOL,
                Component::Prefill.as_str()
            ),
        ],
    );
    let worker_mounts = spec
        .containers
        .first()
        .and_then(|w| w.volume_mounts.clone())
        .unwrap_or_default();
    let mut mounts = worker_mounts;
    if let Some((volume, mount)) = pods::api_keys_volume(isvc) {
        spec.volumes.get_or_insert_with(Vec::new).push(volume);
        mounts.push(mount);
    }
    c.volume_mounts = Some(mounts);
    spec.containers.push(c);
    spec.service_account_name = Some(names::router_account(&name));
    spec.automount_service_account_token = Some(true);
}

/// Adds the gateway objects to `out` when `spec.gateway.inferencePool` is set; call after the
/// router's objects (it extends the router's Role).
pub fn render(
    isvc: &InferenceService,
    image: &str,
    model: &model::ModelMount,
    owner: &OwnerReference,
    out: &mut Desired,
) -> Result<(), RenderError> {
    if !isvc.spec.gateway.inference_pool {
        return Ok(());
    }
    let name = isvc.name_any();
    let ns = isvc.namespace().unwrap_or_default();
    let data = epp_env(isvc, &model.model_path)?;
    let hash = config_hash(&data);
    out.config_maps.push(ConfigMap {
        metadata: objects::meta(epp_name(&name), &ns, epp_labels(&name), owner),
        data: Some(data),
        ..Default::default()
    });

    // The router's pod (model volume, init container, security, ServiceAccount) with the
    // picker's container settings.
    let mut template = pods::router_template(isvc, image, model, &hash);
    if let Some(meta) = template.metadata.as_mut() {
        meta.labels = Some(epp_labels(&name));
    }
    let tcp = |period| Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::String("grpc".into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        ..Default::default()
    };
    for c in template
        .spec
        .iter_mut()
        .flat_map(|s| s.containers.iter_mut())
    {
        c.name = "epp".into();
        c.args = None;
        c.env_from = Some(vec![EnvFromSource {
            config_map_ref: Some(k8s_openapi::api::core::v1::ConfigMapEnvSource {
                name: epp_name(&name),
                optional: None,
            }),
            ..Default::default()
        }]);
        c.ports = Some(vec![ContainerPort {
            name: Some("grpc".into()),
            container_port: EPP_PORT,
            protocol: Some("TCP".into()),
            ..Default::default()
        }]);
        c.readiness_probe = Some(tcp(5));
        c.liveness_probe = Some(Probe {
            initial_delay_seconds: Some(15),
            ..tcp(10)
        });
    }
    out.deployments.push(objects::deployment(
        epp_name(&name),
        &ns,
        epp_labels(&name),
        epp_selector(&name),
        1,
        template,
        owner,
    ));
    out.services.push(Service {
        metadata: objects::meta(epp_name(&name), &ns, epp_labels(&name), owner),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            selector: Some(epp_selector(&name)),
            ports: Some(vec![ServicePort {
                name: Some("grpc".into()),
                port: EPP_PORT,
                target_port: Some(IntOrString::String("grpc".into())),
                protocol: Some("TCP".into()),
                app_protocol: Some("kubernetes.io/h2c".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    });
    out.inference_pools.push(inference_pool(isvc, owner));
    let account = names::router_account(&name);
    let role = out
        .roles
        .iter_mut()
        .find(|r| r.metadata.name.as_deref() == Some(account.as_str()))
        .ok_or(RenderError::NoRouterRole)?;
    role.rules.get_or_insert_with(Vec::new).push(PolicyRule {
        api_groups: Some(vec!["inference.networking.k8s.io".into()]),
        resources: Some(vec!["inferencepools".into()]),
        verbs: vec!["get".into(), "list".into(), "watch".into()],
        ..Default::default()
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::desired;
    use super::super::tests::{deployment, inputs, isvc as chat, pod_labels, spec};
    use super::*;

    /// The render tests' service, with or without its InferencePool (fail-open).
    fn isvc(gateway: bool) -> InferenceService {
        let mut s = spec();
        s.gateway.inference_pool = gateway;
        s.gateway.failure_mode = FailureMode::FailOpen;
        s.model.chat_template = Some("{{ messages[0].content }}".into());
        chat(s)
    }

    #[test]
    fn off_by_default() {
        let d = desired(&isvc(false), &inputs()).expect("renders");
        assert!(d.inference_pools.is_empty());
        assert!(!d
            .deployments
            .iter()
            .any(|o| o.metadata.name.as_deref() == Some("chat-epp")));
        let rules = d.roles[0].rules.as_ref().unwrap();
        assert!(!rules
            .iter()
            .any(|r| r.resources.as_ref().unwrap()[0] == "inferencepools"));
    }

    fn decode_pod(d: &Desired) -> k8s_openapi::api::core::v1::PodSpec {
        let dep = deployment(d, "chat-decode");
        let template = &dep.spec.as_ref().unwrap().template;
        template.spec.clone().expect("the decode pod spec")
    }

    #[test]
    fn decode_pods_answer_the_openai_api_only_behind_a_gateway() {
        let plain = decode_pod(&desired(&isvc(false), &inputs()).expect("renders"));
        assert_eq!(plain.containers.len(), 1);
        assert_eq!(plain.automount_service_account_token, Some(false));

        let pod = decode_pod(&desired(&isvc(true), &inputs()).expect("renders"));
        assert_eq!(pod.containers.len(), 2, "worker + OpenAI sidecar");
        let c = &pod.containers[1];
        assert_eq!(c.name, "openai");
        assert_eq!(
            c.command.as_deref(),
            Some(&["cleave-router".to_string()][..])
        );
        let args = c.args.clone().unwrap();
        let flag = |f: &str| args[args.iter().position(|a| a == f).expect(f) + 1].clone();
        assert_eq!(flag("--decode"), "http://127.0.0.1:50051");
        assert_eq!(flag("--discovery"), "kubernetes");
        assert_eq!(
            flag("--kube-selector"),
            "app.kubernetes.io/instance=chat,serving.cleave.dev/pool=prefill"
        );
        let port = &c.ports.as_ref().unwrap()[0];
        assert_eq!(
            (port.name.as_deref(), port.container_port),
            (Some(OPENAI_PORT_NAME), pods::ROUTER_HTTP_PORT)
        );
        assert_eq!(
            c.env_from.as_ref().unwrap()[0]
                .config_map_ref
                .as_ref()
                .unwrap()
                .name,
            "chat-router"
        );
        assert_eq!(
            c.volume_mounts, pod.containers[0].volume_mounts,
            "the sidecar reads the worker's model (its tokenizer)"
        );
        assert_eq!(pod.service_account_name.as_deref(), Some("chat-router"));
        assert_eq!(pod.automount_service_account_token, Some(true));
        // The sidecar's flags parse as the router's own.
        let mut argv = vec!["--model".to_string(), "m".into()];
        argv.extend(args);
        cleave_config::router::RouterConfig::from_flags(argv).expect("router flags");
    }

    #[test]
    fn multi_node_decode_groups_are_refused_behind_a_gateway() {
        let mut i = isvc(true);
        i.spec.decode.parallelism.nodes_per_group = 2;
        let f = crate::validate::validate(&i.spec);
        assert!(
            f.errors.iter().any(|e| e.contains("gateway.inferencePool")),
            "{:?}",
            f.errors
        );
    }

    #[test]
    fn renders_the_pool_the_picker_and_its_access() {
        let d = desired(&isvc(true), &inputs()).expect("renders");
        let pool = &d.inference_pools[0];
        assert_eq!(pool.metadata.name.as_deref(), Some("chat-pool"));
        let spec = &pool.data["spec"];
        assert_eq!(
            spec["selector"]["matchLabels"],
            json!({"app.kubernetes.io/instance": "chat", "app.kubernetes.io/component": "decode"})
        );
        assert_eq!(
            spec["targetPorts"],
            json!([{"number": pods::ROUTER_HTTP_PORT}])
        );
        assert_eq!(
            spec["endpointPickerRef"],
            json!({"kind": "Service", "name": "chat-epp", "port": {"number": 9002}, "failureMode": "FailOpen"})
        );
        // The picker's config parses as the router's own flags.
        let cm = d
            .config_maps
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some("chat-epp"))
            .expect("epp config");
        let env = cm.data.as_ref().unwrap();
        assert_eq!(env["CLEAVE_MODE"], "endpoint-picker");
        assert_eq!(env["CLEAVE_EPP_POOL"], "chat-pool");
        assert_eq!(env["CLEAVE_EPP_LISTEN"], "0.0.0.0:9002");
        assert_eq!(env["CLEAVE_KUBE_NAMESPACE"], "ml");
        // The picker renders chat requests with the same template as the router.
        assert_eq!(env["CLEAVE_CHAT_TEMPLATE"], "{{ messages[0].content }}");
        let dep = deployment(&d, "chat-epp");
        let spec = dep.spec.as_ref().unwrap();
        assert_eq!(spec.replicas, Some(1));
        let pod = spec.template.spec.as_ref().unwrap();
        assert_eq!(pod.service_account_name.as_deref(), Some("chat-router"));
        let c = &pod.containers[0];
        assert_eq!(
            c.command.as_deref(),
            Some(&["cleave-router".to_string()][..])
        );
        assert_eq!(c.ports.as_ref().unwrap()[0].container_port, EPP_PORT);
        let labels = pod_labels(dep);
        for (k, v) in spec.selector.match_labels.as_ref().unwrap() {
            assert_eq!(labels.get(k), Some(v), "the selector matches the pods");
        }
        assert!(
            !labels.contains_key(names::POOL),
            "the picker is no worker pod"
        );
        let svc = d
            .services
            .iter()
            .find(|s| s.metadata.name.as_deref() == Some("chat-epp"))
            .expect("epp service");
        assert_eq!(
            svc.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
            EPP_PORT
        );
        let rules = d.roles[0].rules.as_ref().unwrap();
        assert!(rules.iter().any(|r| {
            r.api_groups.as_deref() == Some(&["inference.networking.k8s.io".to_string()][..])
                && r.resources.as_deref() == Some(&["inferencepools".to_string()][..])
        }));
    }
}
