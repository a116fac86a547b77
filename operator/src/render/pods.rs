//! Pod templates of workers and routers.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapEnvSource, Container, ContainerPort, EnvFromSource, EnvVar,
    EnvVarSource, HTTPGetAction, ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec,
    Probe, SecretVolumeSource, SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::model::ModelMount;
use super::names::{self, Component};
use crate::crd::{InferenceService, PoolSpec};

/// The worker's gRPC port (named `grpc`, per the discovery contract).
pub const GRPC_PORT: i32 = 50051;
/// The worker's HTTP port (`/health`, `/ready`, `/metrics`).
pub const WORKER_HTTP_PORT: i32 = 8080;
/// The router's HTTP port (OpenAI API and `/metrics`).
pub const ROUTER_HTTP_PORT: i32 = 8000;
/// Non-root uid the images run as.
pub const RUN_AS: i64 = 65532;
/// Where the router's API-key file is mounted.
pub const API_KEYS_DIR: &str = "/etc/cleave/api-keys";
/// Where the internal mutual-TLS Secret is mounted in router and worker pods.
pub const INTERNAL_TLS_DIR: &str = "/etc/cleave/internal-tls";
/// Annotation carrying the hash of the pod's ConfigMap, so config changes roll pods.
pub const CONFIG_HASH: &str = "serving.cleave.dev/config-hash";

/// The [`CONFIG_HASH`] a Deployment's pod template carries, if any.
pub fn config_hash(d: &k8s_openapi::api::apps::v1::Deployment) -> Option<&str> {
    let meta = d.spec.as_ref()?.template.metadata.as_ref()?;
    meta.annotations
        .as_ref()?
        .get(CONFIG_HASH)
        .map(String::as_str)
}

fn port(name: &str, n: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: n,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

fn probe(path: &str, port: &str, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::String(port.into()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        failure_threshold: Some(3),
        ..Default::default()
    }
}

/// Container hardening shared by every container the operator creates.
pub fn container_security() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn pod_security() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RUN_AS),
        run_as_group: Some(RUN_AS),
        fs_group: Some(RUN_AS),
        ..Default::default()
    }
}

fn env_from(config_map: String) -> Option<Vec<EnvFromSource>> {
    Some(vec![EnvFromSource {
        config_map_ref: Some(ConfigMapEnvSource {
            name: config_map,
            optional: Some(false),
        }),
        ..Default::default()
    }])
}

/// Every container's termination message is the tail of its log when it fails, so that the
/// isvc's status can say why (a missing model path, a bad flag) without `kubectl logs`.
pub const LOG_ON_ERROR: &str = "FallbackToLogsOnError";

fn with_init(model: &ModelMount) -> Option<Vec<Container>> {
    let init = model.init.clone()?;
    Some(vec![Container {
        security_context: Some(container_security()),
        termination_message_policy: Some(LOG_ON_ERROR.into()),
        ..init
    }])
}

/// A worker pod template for `component` (prefill or decode).
pub fn worker_template(
    isvc: &InferenceService,
    component: Component,
    pool: &PoolSpec,
    image: &str,
    model: &ModelMount,
    config_hash: &str,
    extra_labels: BTreeMap<String, String>,
) -> PodTemplateSpec {
    let name = isvc.metadata.name.clone().unwrap_or_default();
    let mut mounts = vec![model.mount.clone()];
    let mut volumes = vec![model.volume.clone()];
    for (volume, mount) in [internal_tls_volume(isvc), kv_disk_volume(pool)]
        .into_iter()
        .flatten()
    {
        volumes.push(volume);
        mounts.push(mount);
    }
    let mut labels = names::pod_labels(&name, component);
    labels.extend(extra_labels);
    let p = &pool.parallelism;
    let annotations = BTreeMap::from([
        (CONFIG_HASH.to_string(), config_hash.to_string()),
        (
            "serving.cleave.dev/parallelism".to_string(),
            format!(
                "tensor={},expert={},nodesPerGroup={}",
                p.tensor, p.expert, p.nodes_per_group
            ),
        ),
    ]);
    let container = Container {
        name: "worker".into(),
        image: Some(image.into()),
        command: Some(vec![component.binary().into()]),
        env_from: env_from(names::config_map(&name, component)),
        env: Some(worker_env(pool)),
        ports: Some(vec![
            port("grpc", GRPC_PORT),
            port("http", WORKER_HTTP_PORT),
        ]),
        readiness_probe: Some(probe("/ready", "http", 5)),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(30),
            ..probe("/health", "http", 10)
        }),
        resources: pool.resources.clone(),
        volume_mounts: Some(mounts),
        security_context: Some(container_security()),
        termination_message_policy: Some(LOG_ON_ERROR.into()),
        ..Default::default()
    };
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels),
            annotations: Some(annotations),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            init_containers: with_init(model),
            containers: vec![container],
            volumes: Some(volumes),
            node_selector: (!pool.node_selector.is_empty()).then(|| pool.node_selector.clone()),
            tolerations: (!pool.tolerations.is_empty()).then(|| pool.tolerations.clone()),
            security_context: Some(pod_security()),
            automount_service_account_token: Some(false),
            ..Default::default()
        }),
    }
}

/// Port of a worker group's leader listener (the workers' `--group-port` default).
pub const GROUP_PORT: i32 = 29400;

/// Membership of a StatefulSet group's pods (LeaderWorkerSet provides `LWS_*` instead): the
/// group size, the leader (pod 0, through the pool's headless Service, which publishes
/// not-ready addresses) and the rank (the pod-index label, Kubernetes 1.28+).
pub fn group_env(template: &mut PodTemplateSpec, size: i32, leader_pod: &str, service: &str) {
    let Some(c) = template
        .spec
        .as_mut()
        .and_then(|s| s.containers.first_mut())
    else {
        return;
    };
    let value = |name: &str, v: String| EnvVar {
        name: name.into(),
        value: Some(v),
        ..Default::default()
    };
    let env = c.env.get_or_insert_with(Vec::new);
    env.splice(
        0..0,
        [
            value("CLEAVE_GROUP_SIZE", size.to_string()),
            value(
                "CLEAVE_GROUP_LEADER",
                format!("{leader_pod}.{service}:{GROUP_PORT}"),
            ),
            // The rank is the pod name's ordinal: the pod-index label exists only from 1.28.
            EnvVar {
                name: "CLEAVE_GROUP_POD_NAME".into(),
                value_from: Some(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector {
                        field_path: "metadata.name".into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
        ],
    );
}

/// The pod's IP as `CLEAVE_KV_ADVERTISE` (workers listen on every interface; peers in other
/// pods dial this IP for KV transfers), then the pool's own variables (which may override it).
fn worker_env(pool: &PoolSpec) -> Vec<EnvVar> {
    let mut env = vec![EnvVar {
        name: "CLEAVE_KV_ADVERTISE".into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: "status.podIP".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }];
    env.extend(pool.env.iter().cloned());
    env
}

/// The router pod template; its args are the discovery flags of the kube contract.
pub fn router_template(
    isvc: &InferenceService,
    image: &str,
    model: &ModelMount,
    config_hash: &str,
) -> PodTemplateSpec {
    let name = isvc.metadata.name.clone().unwrap_or_default();
    let ns = isvc.metadata.namespace.clone().unwrap_or_default();
    let mut mounts = vec![model.mount.clone()];
    let mut volumes = vec![model.volume.clone()];
    for (volume, mount) in [api_keys_volume(isvc), internal_tls_volume(isvc)]
        .into_iter()
        .flatten()
    {
        volumes.push(volume);
        mounts.push(mount);
    }
    let mut container = router_container(
        isvc,
        image,
        "router",
        "http",
        vec![
            "--discovery".into(),
            "kubernetes".into(),
            "--kube-namespace".into(),
            ns,
            "--kube-selector".into(),
            names::instance_selector(&name),
        ],
    );
    container.volume_mounts = Some(mounts);
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(names::pod_labels(&name, Component::Router)),
            annotations: Some(BTreeMap::from([(
                CONFIG_HASH.to_string(),
                config_hash.to_string(),
            )])),
            ..Default::default()
        }),
        spec: Some(PodSpec {
            service_account_name: Some(names::router_account(&name)),
            init_containers: with_init(model),
            containers: vec![container],
            volumes: Some(volumes),
            security_context: Some(pod_security()),
            ..Default::default()
        }),
    }
}

/// The API-key Secret's volume and its mount in a router container, when the spec names one.
pub fn api_keys_volume(isvc: &InferenceService) -> Option<(Volume, VolumeMount)> {
    let secret = isvc.spec.router.api_key_secret.as_ref()?;
    Some(secret_volume("api-keys", &secret.name, API_KEYS_DIR))
}

/// Where a worker's disk KV tier is mounted.
pub const KV_DISK_DIR: &str = "/var/cache/cleave/kv";

/// A pool's disk KV tier volume and its mount, when its `kvCache` has a disk.
pub fn kv_disk_volume(pool: &PoolSpec) -> Option<(Volume, VolumeMount)> {
    let v = &pool.kv_cache.as_ref()?.disk.as_ref()?.volume;
    let volume = Volume {
        name: "kv-disk".into(),
        empty_dir: v.empty_dir.clone(),
        host_path: v.host_path.clone(),
        persistent_volume_claim: v.persistent_volume_claim.clone(),
        ..Default::default()
    };
    let mount = VolumeMount {
        name: "kv-disk".into(),
        mount_path: KV_DISK_DIR.into(),
        ..Default::default()
    };
    Some((volume, mount))
}

/// The internal mutual-TLS Secret's volume and its mount (router and worker pods alike), when
/// the spec asks for internal TLS.
pub fn internal_tls_volume(isvc: &InferenceService) -> Option<(Volume, VolumeMount)> {
    let tls = isvc.spec.internal_tls.as_ref()?;
    Some(secret_volume(
        "internal-tls",
        &tls.secret_name,
        INTERNAL_TLS_DIR,
    ))
}

/// Secret `secret` as volume `name`, mounted read-only at `dir`.
fn secret_volume(name: &str, secret: &str, dir: &str) -> (Volume, VolumeMount) {
    (
        Volume {
            name: name.into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(secret.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        VolumeMount {
            name: name.into(),
            mount_path: dir.into(),
            read_only: Some(true),
            ..Default::default()
        },
    )
}

/// A `cleave-router` container named `name` serving the OpenAI API on [`ROUTER_HTTP_PORT`]
/// (port name `port_name`) from the router's ConfigMap, with `args`; no volume mounts.
pub fn router_container(
    isvc: &InferenceService,
    image: &str,
    name: &str,
    port_name: &str,
    args: Vec<String>,
) -> Container {
    let instance = isvc.metadata.name.clone().unwrap_or_default();
    Container {
        name: name.into(),
        image: Some(image.into()),
        command: Some(vec!["cleave-router".into()]),
        args: Some(args),
        env_from: env_from(names::config_map(&instance, Component::Router)),
        ports: Some(vec![port(port_name, ROUTER_HTTP_PORT)]),
        readiness_probe: Some(probe("/ready", port_name, 5)),
        liveness_probe: Some(Probe {
            initial_delay_seconds: Some(15),
            ..probe("/health", port_name, 10)
        }),
        resources: isvc.spec.router.resources.clone(),
        security_context: Some(container_security()),
        termination_message_policy: Some(LOG_ON_ERROR.into()),
        ..Default::default()
    }
}

/// How long a terminating router keeps serving after SIGTERM (its `--drain-period`): clients
/// reach routers through a Service, and kube-proxy drops a terminating pod from it meanwhile,
/// while the router's `Connection: close` moves kept-alive clients to the routers that stay.
pub const ROUTER_DRAIN_SECONDS: u32 = 5;
