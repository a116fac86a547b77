//! Workload, Service and RBAC objects around the pod templates.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment, StatefulSet,
    StatefulSetSpec,
};
use k8s_openapi::api::core::v1::{
    PodTemplateSpec, Service, ServiceAccount, ServicePort, ServiceSpec,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use serde_json::json;

use super::names::{self, Component};
use super::pods::{GRPC_PORT, ROUTER_HTTP_PORT, WORKER_HTTP_PORT};

/// Metadata of an owned object.
pub fn meta(
    name: String,
    ns: &str,
    labels: BTreeMap<String, String>,
    owner: &OwnerReference,
) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: Some(ns.to_string()),
        labels: Some(labels),
        owner_references: Some(vec![owner.clone()]),
        ..Default::default()
    }
}

fn service_port(name: &str, port: i32) -> ServicePort {
    ServicePort {
        name: Some(name.into()),
        port,
        target_port: Some(IntOrString::String(name.into())),
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

/// Headless Service of a worker pool (stable DNS for pods and groups).
pub fn pool_service(name: &str, ns: &str, c: Component, owner: &OwnerReference) -> Service {
    Service {
        metadata: meta(names::workload(name, c), ns, names::labels(name, c), owner),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(names::selector(name, c)),
            publish_not_ready_addresses: Some(true),
            ports: Some(vec![
                service_port("grpc", GRPC_PORT),
                service_port("http", WORKER_HTTP_PORT),
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The router Service.
pub fn router_service(name: &str, ns: &str, type_: &str, owner: &OwnerReference) -> Service {
    let c = Component::Router;
    Service {
        metadata: meta(names::workload(name, c), ns, names::labels(name, c), owner),
        spec: Some(ServiceSpec {
            type_: Some(type_.into()),
            selector: Some(names::selector(name, c)),
            ports: Some(vec![service_port("http", ROUTER_HTTP_PORT)]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A Deployment of `replicas` pods.
pub fn deployment(
    name: String,
    ns: &str,
    labels: BTreeMap<String, String>,
    selector: BTreeMap<String, String>,
    replicas: i32,
    template: PodTemplateSpec,
    owner: &OwnerReference,
) -> Deployment {
    Deployment {
        metadata: meta(name, ns, labels, owner),
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..Default::default()
            },
            // One new pod at a time, and never one fewer than wanted: a pool of one (the usual
            // decode or router count on CPUs) keeps its pod until the replacement is Ready, so
            // there is always a routable worker during a rollout. The replacement counts as
            // available only MIN_READY_SECONDS after it is Ready: time for routers to discover
            // a new worker (and a new router its workers) before the old pod goes.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".into()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(1)),
                    max_unavailable: Some(IntOrString::Int(0)),
                }),
            }),
            template,
            min_ready_seconds: Some(MIN_READY_SECONDS),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Seconds a new pod must be Ready before a rollout removes an old one.
pub const MIN_READY_SECONDS: i32 = 5;

/// StatefulSet of one multi-node group: `size` pods started and replaced together
/// (Parallel pod management; the group index is a label).
pub fn group_stateful_set(
    name: &str,
    ns: &str,
    c: Component,
    index: i32,
    size: i32,
    mut template: PodTemplateSpec,
    owner: &OwnerReference,
) -> StatefulSet {
    let mut selector = names::selector(name, c);
    selector.insert(names::GROUP.into(), index.to_string());
    let mut labels = names::labels(name, c);
    labels.insert(names::GROUP.into(), index.to_string());
    let sts = names::group(name, c, index);
    super::pods::group_env(
        &mut template,
        size,
        &format!("{sts}-0"),
        &names::workload(name, c),
    );
    if let Some(m) = template.metadata.as_mut() {
        m.labels
            .get_or_insert_with(BTreeMap::new)
            .insert(names::GROUP.into(), index.to_string());
    }
    StatefulSet {
        metadata: meta(sts, ns, labels, owner),
        spec: Some(StatefulSetSpec {
            replicas: Some(size),
            service_name: Some(names::workload(name, c)),
            pod_management_policy: Some("Parallel".into()),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..Default::default()
            },
            template,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1).
pub fn lws_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet"),
        "leaderworkersets",
    )
}

/// A LeaderWorkerSet of `groups` groups of `size` pods; a pod restart recreates its group.
pub fn leader_worker_set(
    name: &str,
    ns: &str,
    c: Component,
    groups: i32,
    size: i32,
    template: &PodTemplateSpec,
    owner: &OwnerReference,
) -> DynamicObject {
    let mut obj = DynamicObject::new(&names::workload(name, c), &lws_resource());
    obj.metadata = meta(names::workload(name, c), ns, names::labels(name, c), owner);
    obj.data = json!({
        "spec": {
            "replicas": groups,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": template,
            }
        }
    });
    obj
}

/// ServiceAccount, Role (pods get/list/watch) and RoleBinding for the router's discovery.
pub fn router_rbac(
    name: &str,
    ns: &str,
    owner: &OwnerReference,
) -> (ServiceAccount, Role, RoleBinding) {
    let account = names::router_account(name);
    let labels = names::labels(name, Component::Router);
    let sa = ServiceAccount {
        metadata: meta(account.clone(), ns, labels.clone(), owner),
        ..Default::default()
    };
    let role = Role {
        metadata: meta(account.clone(), ns, labels.clone(), owner),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["pods".into()]),
            verbs: vec!["get".into(), "list".into(), "watch".into()],
            ..Default::default()
        }]),
    };
    let binding = RoleBinding {
        metadata: meta(account.clone(), ns, labels, owner),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".into(),
            kind: "Role".into(),
            name: account.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account,
            namespace: Some(ns.to_string()),
            ..Default::default()
        }]),
    };
    (sa, role, binding)
}
