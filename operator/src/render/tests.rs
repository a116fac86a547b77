use kube::api::ObjectMeta;

use super::*;
use crate::crd::{InferenceServiceSpec, InternalTlsSpec, Parallelism, PathSource, SecretKeyRef};

pub(super) fn isvc(spec: InferenceServiceSpec) -> InferenceService {
    let mut i = InferenceService::new("chat", spec);
    i.metadata = ObjectMeta {
        name: Some("chat".into()),
        namespace: Some("ml".into()),
        uid: Some("uid-1".into()),
        ..Default::default()
    };
    i
}

pub(super) fn spec() -> InferenceServiceSpec {
    let mut s = InferenceServiceSpec::default();
    s.model.source.path = Some(PathSource {
        claim_name: Some("weights".into()),
        path: "m.gguf".into(),
    });
    s.prefill.replicas = Some(2);
    s.decode.replicas = Some(3);
    s
}

pub(super) fn inputs() -> Inputs {
    Inputs {
        default_image: "cleave:dev".into(),
        fetch_image: "curl".into(),
        lws_available: false,
        prefill_groups: 2,
        decode_groups: 3,
    }
}

/// The data of ConfigMap `name`.
fn config_data(d: &Desired, name: &str) -> std::collections::BTreeMap<String, String> {
    d.config_maps
        .iter()
        .find(|c| c.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no ConfigMap {name}"))
        .data
        .clone()
        .unwrap_or_default()
}

pub(super) fn deployment<'a>(d: &'a Desired, name: &str) -> &'a Deployment {
    d.deployments
        .iter()
        .find(|x| x.metadata.name.as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no deployment {name}"))
}

/// The labels of `dep`'s pods.
pub(super) fn pod_labels(dep: &Deployment) -> &std::collections::BTreeMap<String, String> {
    let template = &dep.spec.as_ref().unwrap().template;
    template.metadata.as_ref().unwrap().labels.as_ref().unwrap()
}

#[test]
fn single_node_pools_become_deployments_with_contract_labels() {
    let d = desired(&isvc(spec()), &inputs()).unwrap();
    assert_eq!(d.deployments.len(), 3);
    let dec = deployment(&d, "chat-decode");
    let ds = dec.spec.as_ref().unwrap();
    assert_eq!(ds.replicas, Some(3));
    let pod = pod_labels(dec);
    assert_eq!(pod["serving.cleave.dev/pool"], "decode");
    assert_eq!(pod["app.kubernetes.io/instance"], "chat");
    assert_eq!(pod["app.kubernetes.io/managed-by"], "cleave-operator");
    let c = &ds.template.spec.as_ref().unwrap().containers[0];
    assert_eq!(c.image.as_deref(), Some("cleave:dev"));
    assert_eq!(c.command.as_ref().unwrap()[0], "cleave-decode");
    let ports = c.ports.as_ref().unwrap();
    assert!(ports
        .iter()
        .any(|p| p.name.as_deref() == Some("grpc") && p.container_port == 50051));
    // Peers in other pods reach the KV transport at the pod's IP.
    let env = c.env.as_ref().unwrap();
    let kv = env
        .iter()
        .find(|e| e.name == "CLEAVE_KV_ADVERTISE")
        .unwrap();
    let field = kv.value_from.as_ref().unwrap().field_ref.as_ref().unwrap();
    assert_eq!(field.field_path, "status.podIP");
    let owner = &dec.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.uid.as_str(), owner.controller),
        ("uid-1", Some(true))
    );
    assert_eq!(
        deployment(&d, "chat-prefill")
            .spec
            .as_ref()
            .unwrap()
            .replicas,
        Some(2)
    );
    // Every object is owned (so deletion garbage-collects it).
    let all_owned = d
        .services
        .iter()
        .all(|s| s.metadata.owner_references.is_some())
        && d.config_maps
            .iter()
            .all(|s| s.metadata.owner_references.is_some());
    assert!(all_owned);
    assert_eq!(d.services.len(), 3);
    let headless = d
        .services
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("chat-decode"));
    assert_eq!(
        headless
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .cluster_ip
            .as_deref(),
        Some("None")
    );
}

#[test]
fn config_maps_hold_the_binaries_settings() {
    let mut s = spec();
    s.decode.kv_blocks = Some(128);
    s.prefill.kv_memory = Some("4Gi".into());
    s.router.queue_timeout_seconds = Some(3);
    s.model.chat_template = Some("gemma".into());
    s.model.kv_dtype = Some(crate::crd::KvCacheDtype::Q8_0);
    s.router.api_key_secret = Some(SecretKeyRef {
        name: "keys".into(),
        key: "list".into(),
    });
    let d = desired(&isvc(s), &inputs()).unwrap();
    let cm = |n: &str| config_data(&d, n);
    let dec = cm("chat-decode");
    assert_eq!(dec["CLEAVE_MODEL"], "/models/m.gguf");
    assert_eq!(dec["CLEAVE_KV_BLOCKS"], "128");
    assert!(
        !dec.contains_key("CLEAVE_KV_MEMORY"),
        "unset: the workers' auto"
    );
    assert_eq!(cm("chat-prefill")["CLEAVE_KV_MEMORY"], "4Gi");
    // Both pools store KV in the one type (their blocks move between them as bytes).
    assert_eq!(dec["CLEAVE_KV_DTYPE"], "q8_0");
    assert_eq!(cm("chat-prefill")["CLEAVE_KV_DTYPE"], "q8_0");
    assert_eq!(dec["CLEAVE_GRPC_ADDR"], "0.0.0.0:50051");
    assert_eq!(dec["UCX_HANDLE_ERRORS"], "none");
    assert!(!cm("chat-prefill").contains_key("CLEAVE_KV_BLOCKS"));
    let router = cm("chat-router");
    assert_eq!(router["CLEAVE_POLICY"], "prefix-optimistic");
    // A terminating router drains while kube-proxy drops it from the Service.
    assert_eq!(router["CLEAVE_DRAIN_PERIOD"], "5s");
    assert_eq!(router["CLEAVE_API_KEYS_FILE"], "/etc/cleave/api-keys/list");
    assert_eq!(router["CLEAVE_QUEUE_TIMEOUT"], "3s");
    assert_eq!(router["CLEAVE_CHAT_TEMPLATE"], "gemma");
    assert!(!dec.contains_key("CLEAVE_CHAT_TEMPLATE"));
    let r = deployment(&d, "chat-router");
    let args = r
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .containers[0]
        .args
        .clone()
        .unwrap();
    assert_eq!(
        args,
        [
            "--discovery",
            "kubernetes",
            "--kube-namespace",
            "ml",
            "--kube-selector",
            "app.kubernetes.io/instance=chat"
        ]
    );
}

#[test]
fn internal_tls_mounts_the_secret_in_every_pod_and_sets_the_flags() {
    let mounted = |d: &Desired, name: &str| {
        let pod = deployment(d, name)
            .spec
            .as_ref()
            .unwrap()
            .template
            .spec
            .clone();
        let pod = pod.unwrap();
        let volume = pod
            .volumes
            .unwrap_or_default()
            .into_iter()
            .find(|v| v.name == "internal-tls")
            .map(|v| v.secret.unwrap().secret_name.unwrap());
        let mount = pod.containers[0]
            .volume_mounts
            .clone()
            .unwrap_or_default()
            .into_iter()
            .find(|m| m.name == "internal-tls")
            .map(|m| (m.mount_path, m.read_only));
        (volume, mount)
    };
    let plain = desired(&isvc(spec()), &inputs()).unwrap();
    let mut s = spec();
    s.internal_tls = Some(InternalTlsSpec {
        secret_name: "chat-internal".into(),
        server_name: Some("chat.ml.svc".into()),
    });
    let d = desired(&isvc(s), &inputs()).unwrap();
    for name in ["chat-router", "chat-prefill", "chat-decode"] {
        assert_eq!(mounted(&plain, name), (None, None), "{name}");
        assert_eq!(
            mounted(&d, name),
            (
                Some("chat-internal".to_string()),
                Some(("/etc/cleave/internal-tls".to_string(), Some(true)))
            ),
            "{name}"
        );
        let cm = d
            .config_maps
            .iter()
            .find(|c| c.metadata.name.as_deref() == Some(name))
            .unwrap()
            .data
            .clone()
            .unwrap();
        assert_eq!(
            cm["CLEAVE_INTERNAL_TLS_CERT"],
            "/etc/cleave/internal-tls/tls.crt"
        );
        assert_eq!(
            cm["CLEAVE_INTERNAL_TLS_KEY"],
            "/etc/cleave/internal-tls/tls.key"
        );
        assert_eq!(
            cm["CLEAVE_INTERNAL_TLS_CA"],
            "/etc/cleave/internal-tls/ca.crt"
        );
        assert_eq!(cm["CLEAVE_INTERNAL_TLS_SERVER_NAME"], "chat.ml.svc");
    }
}

#[test]
fn model_changes_roll_pods_through_the_config_hash() {
    let hash = |s: InferenceServiceSpec| {
        let d = desired(&isvc(s), &inputs()).unwrap();
        let hash = pods::config_hash(deployment(&d, "chat-decode"));
        hash.expect("decode pods carry the config hash").to_string()
    };
    let a = hash(spec());
    let mut other = spec();
    other.model.source.path.as_mut().unwrap().path = "other.gguf".into();
    assert_ne!(a, hash(other));
    assert_eq!(a, hash(spec()), "rendering is deterministic");
}

#[test]
fn multi_node_groups_use_leader_worker_sets_or_stateful_sets() {
    let mut s = spec();
    s.decode.parallelism = Parallelism {
        tensor: 8,
        expert: 2,
        nodes_per_group: 2,
    };
    let d = desired(&isvc(s.clone()), &inputs()).unwrap();
    assert_eq!(d.stateful_sets.len(), 3, "one StatefulSet per decode group");
    let g1 = &d.stateful_sets[1];
    assert_eq!(g1.metadata.name.as_deref(), Some("chat-decode-g1"));
    let gs = g1.spec.as_ref().unwrap();
    assert_eq!(gs.replicas, Some(2));
    assert_eq!(gs.pod_management_policy.as_deref(), Some("Parallel"));
    assert_eq!(
        gs.selector.match_labels.as_ref().unwrap()[names::GROUP],
        "1"
    );
    // Membership: size, the leader pod through the pool's headless Service, rank = pod index.
    let env = gs.template.spec.as_ref().unwrap().containers[0]
        .env
        .clone()
        .unwrap();
    let var = |n: &str| env.iter().find(|e| e.name == n).unwrap().clone();
    assert_eq!(var("CLEAVE_GROUP_SIZE").value.as_deref(), Some("2"));
    assert_eq!(
        var("CLEAVE_GROUP_LEADER").value.as_deref(),
        Some("chat-decode-g1-0.chat-decode:29400")
    );
    let rank = var("CLEAVE_GROUP_POD_NAME")
        .value_from
        .unwrap()
        .field_ref
        .unwrap();
    assert_eq!(rank.field_path, "metadata.name");
    assert!(d
        .deployments
        .iter()
        .all(|x| x.metadata.name.as_deref() != Some("chat-decode")));

    let with_lws = Inputs {
        lws_available: true,
        ..inputs()
    };
    let d = desired(&isvc(s), &with_lws).unwrap();
    assert!(d.stateful_sets.is_empty());
    let lws = &d.leader_worker_sets[0];
    assert_eq!(lws.data["spec"]["replicas"], 3);
    assert_eq!(lws.data["spec"]["leaderWorkerTemplate"]["size"], 2);
    assert_eq!(lws.types.as_ref().unwrap().kind, "LeaderWorkerSet");
}

#[test]
fn unrenderable_specs_are_errors_not_panics() {
    let mut s = spec();
    s.model.source.path = None;
    let e = desired(&isvc(s), &inputs()).unwrap_err();
    assert!(matches!(e, RenderError::ModelSourceCount), "{e}");
    assert!(e.to_string().contains("exactly one"), "{e}");
    let mut no_uid = isvc(spec());
    no_uid.metadata.uid = None;
    assert!(matches!(
        desired(&no_uid, &inputs()),
        Err(RenderError::NoUid)
    ));
}

#[test]
fn the_policy_flag_is_the_crd_name() {
    use crate::crd::Policy;
    for p in [
        Policy::PrefixOptimistic,
        Policy::PrefixLoad,
        Policy::RoundRobin,
        Policy::LeastLoad,
        Policy::Random,
    ] {
        assert_eq!(serde_json::to_value(p).unwrap(), p.as_flag());
        // And the router's parser knows it.
        let flag = p.as_flag();
        assert!(
            <cleave_config::router::PolicyKind as clap::ValueEnum>::from_str(flag, false).is_ok(),
            "{flag}"
        );
    }
}

#[test]
fn a_kv_memory_the_workers_cannot_parse_is_refused_when_rendering() {
    let mut s = spec();
    s.decode.kv_memory = Some("lots".into());
    // As the status condition reports it: the error and its causes.
    let e = cleave_telemetry::error_chain(&desired(&isvc(s), &inputs()).unwrap_err());
    assert!(e.contains("decode") && e.contains("lots"), "{e}");
}

#[test]
fn a_pools_kv_cache_becomes_worker_flags_and_a_mounted_disk_volume() {
    use k8s_openapi::api::core::v1::HostPathVolumeSource;
    let mut s = spec();
    s.decode.kv_cache = Some(crate::crd::KvCacheSpec {
        host_memory: Some("2Gi".into()),
        disk: Some(crate::crd::KvDiskSpec {
            size: "20Gi".into(),
            min_uses: Some(3),
            volume: crate::crd::KvDiskVolume {
                host_path: Some(HostPathVolumeSource {
                    path: "/var/lib/cleave-kv".into(),
                    type_: Some("DirectoryOrCreate".into()),
                }),
                ..Default::default()
            },
        }),
    });
    let d = desired(&isvc(s), &inputs()).unwrap();
    let data = |n: &str| config_data(&d, n);
    let dec = data("chat-decode");
    assert_eq!(dec["CLEAVE_KV_HOST_MEMORY"], "2Gi");
    assert_eq!(dec["CLEAVE_KV_DISK_DIR"], crate::render::pods::KV_DISK_DIR);
    assert_eq!(dec["CLEAVE_KV_DISK_SIZE"], "20Gi");
    assert_eq!(dec["CLEAVE_KV_DISK_MIN_USES"], "3");
    assert!(!data("chat-prefill").contains_key("CLEAVE_KV_HOST_MEMORY"));
    let pod = deployment(&d, "chat-decode")
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .clone()
        .unwrap();
    let volume = pod
        .volumes
        .unwrap()
        .into_iter()
        .find(|v| v.name == "kv-disk")
        .expect("the disk tier's volume");
    assert_eq!(volume.host_path.unwrap().path, "/var/lib/cleave-kv");
    let mounts = pod.containers[0].volume_mounts.clone().unwrap();
    assert!(mounts
        .iter()
        .any(|m| m.name == "kv-disk" && m.mount_path == crate::render::pods::KV_DISK_DIR));
}

#[test]
fn a_kv_cache_size_the_workers_cannot_parse_is_refused_when_rendering() {
    let mut s = spec();
    s.prefill.kv_cache = Some(crate::crd::KvCacheSpec {
        host_memory: Some("plenty".into()),
        disk: None,
    });
    let e = cleave_telemetry::error_chain(&desired(&isvc(s), &inputs()).unwrap_err());
    assert!(e.contains("prefill") && e.contains("plenty"), "{e}");
}
