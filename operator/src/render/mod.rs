//! The reconciler's pure core: (InferenceService, observed state) → the objects that should
//! exist. No I/O here; the controller applies the result with server-side apply.

pub mod config;
mod error;
pub mod gateway;
pub mod model;
pub mod names;
pub mod objects;
pub mod pods;

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::DynamicObject;
use kube::{Resource, ResourceExt};
use sha2::{Digest, Sha256};

use crate::crd::{InferenceService, KvBackend, PoolSpec, ServiceType};
pub use error::RenderError;
use names::Component;

/// What the operator knows beyond the spec.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// Image of the cleave binaries when the spec names none.
    pub default_image: String,
    /// Image of the URL-source download init container (needs sh, curl, sha256sum).
    pub fetch_image: String,
    /// Whether the LeaderWorkerSet CRD is installed.
    pub lws_available: bool,
    /// Worker groups per pool, as decided (spec replicas, or the autoscaler's count).
    pub prefill_groups: i32,
    /// Decode groups.
    pub decode_groups: i32,
}

/// Everything that should exist for one InferenceService.
#[derive(Clone, Debug, Default)]
pub struct Desired {
    /// Rendered worker and router configuration.
    pub config_maps: Vec<ConfigMap>,
    /// Headless pool Services and the router Service.
    pub services: Vec<Service>,
    /// Single-node pools and the router.
    pub deployments: Vec<Deployment>,
    /// Multi-node groups without LeaderWorkerSet: one per group.
    pub stateful_sets: Vec<StatefulSet>,
    /// Multi-node pools with LeaderWorkerSet.
    pub leader_worker_sets: Vec<DynamicObject>,
    /// The router's ServiceAccount.
    pub service_accounts: Vec<ServiceAccount>,
    /// The router's Role.
    pub roles: Vec<Role>,
    /// The router's RoleBinding.
    pub role_bindings: Vec<RoleBinding>,
    /// The InferencePool (`spec.gateway.inferencePool`).
    pub inference_pools: Vec<DynamicObject>,
}

/// Groups a pool runs when not autoscaled: `replicas`, default 1.
pub fn fixed_groups(pool: &PoolSpec) -> i32 {
    pool.replicas.unwrap_or(1)
}

/// A short digest of a ConfigMap's data, put in the pod template's annotations so that a changed
/// setting rolls the pods.
fn config_hash(data: &BTreeMap<String, String>) -> String {
    let mut h = Sha256::new();
    for (k, v) in data {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(v.as_bytes());
        h.update([0]);
    }
    format!("{:x}", h.finalize())[..16].to_string()
}

fn config_map(
    isvc: &InferenceService,
    c: Component,
    data: BTreeMap<String, String>,
) -> (ConfigMap, String) {
    let name = isvc.name_any();
    let ns = isvc.namespace().unwrap_or_default();
    let owner = isvc.controller_owner_ref(&()).unwrap_or_default();
    let hash = config_hash(&data);
    let cm = ConfigMap {
        metadata: objects::meta(
            names::config_map(&name, c),
            &ns,
            names::labels(&name, c),
            &owner,
        ),
        data: Some(data),
        ..Default::default()
    };
    (cm, hash)
}

fn worker_config(
    isvc: &InferenceService,
    pool: &PoolSpec,
    model_path: &str,
    c: Component,
) -> Result<BTreeMap<String, String>, RenderError> {
    let backend = match isvc.spec.kv_transfer.backend {
        KvBackend::Auto => "auto",
        KvBackend::Ucx => "ucx",
        KvBackend::Tcp => "tcp",
    };
    let mut settings = vec![
        ("model", model_path.to_string()),
        ("grpc_addr", format!("0.0.0.0:{}", pods::GRPC_PORT)),
        ("http_addr", format!("0.0.0.0:{}", pods::WORKER_HTTP_PORT)),
        ("transport", backend.to_string()),
    ];
    if let Some(t) = pool.threads {
        settings.push(("threads", t.to_string()));
    }
    if let Some(b) = pool.kv_blocks {
        settings.push(("kv_blocks", b.to_string()));
    }
    if let Some(m) = &pool.kv_memory {
        settings.push(("kv_memory", m.clone()));
    }
    if let Some(d) = isvc.spec.model.kv_dtype {
        settings.push(("kv_dtype", d.as_flag().to_string()));
    }
    settings.extend(kv_cache_settings(pool));
    settings.extend(internal_tls_settings(isvc));
    let (mut env, _) = config::worker_env(&settings).map_err(RenderError::settings(c.as_str()))?;
    // UCX's default crash handler prints a backtrace from inside the signal handler, which
    // allocates: a crash inside malloc then hangs the pod instead of letting it restart. A pool's
    // own `env` can set it back.
    env.insert("UCX_HANDLE_ERRORS".into(), "none".into());
    if let Some(ucx) = &isvc.spec.kv_transfer.ucx {
        if let Some(t) = &ucx.transports {
            env.insert("UCX_TLS".into(), t.clone());
        }
        if let Some(d) = &ucx.net_devices {
            env.insert("UCX_NET_DEVICES".into(), d.clone());
        }
    }
    Ok(env)
}

/// The `--kv-host-memory` / `--kv-disk-*` settings of a pool's `kvCache` (the disk tier's
/// volume is mounted at [`pods::KV_DISK_DIR`]).
fn kv_cache_settings(pool: &PoolSpec) -> Vec<(&'static str, String)> {
    let Some(kv) = &pool.kv_cache else {
        return Vec::new();
    };
    let mut settings = Vec::new();
    if let Some(m) = &kv.host_memory {
        settings.push(("kv_host_memory", m.clone()));
    }
    if let Some(d) = &kv.disk {
        settings.push(("kv_disk_dir", pods::KV_DISK_DIR.to_string()));
        settings.push(("kv_disk_size", d.size.clone()));
        if let Some(n) = d.min_uses {
            settings.push(("kv_disk_min_uses", n.to_string()));
        }
    }
    settings
}

/// The `--internal-tls-*` settings for the mounted Secret ([`pods::INTERNAL_TLS_DIR`]), when
/// the spec asks for internal TLS (the same for the router and both pools).
fn internal_tls_settings(isvc: &InferenceService) -> Vec<(&'static str, String)> {
    use cleave_config::internal_tls::{SECRET_CA, SECRET_CERT, SECRET_KEY};
    let Some(tls) = &isvc.spec.internal_tls else {
        return Vec::new();
    };
    let file = |name: &str| format!("{}/{name}", pods::INTERNAL_TLS_DIR);
    let mut settings = vec![
        ("internal_tls_cert", file(SECRET_CERT)),
        ("internal_tls_key", file(SECRET_KEY)),
        ("internal_tls_ca", file(SECRET_CA)),
    ];
    if let Some(name) = &tls.server_name {
        settings.push(("internal_tls_server_name", name.clone()));
    }
    settings
}

/// What the router and the endpoint picker read of the model besides its path: the name clients
/// send and the chat template.
fn model_text_settings(isvc: &InferenceService) -> Vec<(&'static str, String)> {
    let m = &isvc.spec.model;
    let mut settings = Vec::new();
    if let Some(n) = &m.served_name {
        settings.push(("served_model_name", n.clone()));
    }
    if let Some(t) = &m.chat_template {
        settings.push(("chat_template", t.clone()));
    }
    settings
}

fn router_config(
    isvc: &InferenceService,
    model_path: &str,
) -> Result<BTreeMap<String, String>, RenderError> {
    let r = &isvc.spec.router;
    let mut settings = vec![
        ("listen", format!("0.0.0.0:{}", pods::ROUTER_HTTP_PORT)),
        ("model", model_path.to_string()),
        ("policy", r.policy.as_flag().to_string()),
        ("drain_period", format!("{}s", pods::ROUTER_DRAIN_SECONDS)),
    ];
    settings.extend(model_text_settings(isvc));
    if let Some(n) = r.max_in_flight {
        settings.push(("max_in_flight", n.to_string()));
    }
    if let Some(n) = r.max_queue {
        settings.push(("max_queue", n.to_string()));
    }
    if let Some(n) = r.queue_timeout_seconds {
        settings.push(("queue_timeout", format!("{n}s")));
    }
    if let Some(s) = &r.api_key_secret {
        settings.push(("api_keys_file", format!("{}/{}", pods::API_KEYS_DIR, s.key)));
    }
    settings.extend(internal_tls_settings(isvc));
    Ok(config::router_env(&settings)
        .map_err(RenderError::settings("router"))?
        .0)
}

fn pool_objects(
    isvc: &InferenceService,
    c: Component,
    pool: &PoolSpec,
    groups: i32,
    inputs: &Inputs,
    model: &model::ModelMount,
    out: &mut Desired,
) -> Result<(), RenderError> {
    let name = isvc.name_any();
    let ns = isvc.namespace().unwrap_or_default();
    let owner = isvc.controller_owner_ref(&()).unwrap_or_default();
    let image = isvc.spec.image.as_deref().unwrap_or(&inputs.default_image);
    let (cm, hash) = config_map(isvc, c, worker_config(isvc, pool, &model.model_path, c)?);
    out.config_maps.push(cm);
    out.services
        .push(objects::pool_service(&name, &ns, c, &owner));
    let mut template = pods::worker_template(isvc, c, pool, image, model, &hash, BTreeMap::new());
    if c == Component::Decode {
        gateway::serve_openai(isvc, image, &mut template);
    }
    let size = pool.parallelism.nodes_per_group as i32;
    if size == 1 {
        out.deployments.push(objects::deployment(
            names::workload(&name, c),
            &ns,
            names::labels(&name, c),
            names::selector(&name, c),
            groups,
            template,
            &owner,
        ));
    } else if inputs.lws_available {
        out.leader_worker_sets.push(objects::leader_worker_set(
            &name, &ns, c, groups, size, &template, &owner,
        ));
    } else {
        for i in 0..groups {
            out.stateful_sets.push(objects::group_stateful_set(
                &name,
                &ns,
                c,
                i,
                size,
                template.clone(),
                &owner,
            ));
        }
    }
    Ok(())
}

/// The objects an InferenceService should own. `Err` says why none can be rendered.
pub fn desired(isvc: &InferenceService, inputs: &Inputs) -> Result<Desired, RenderError> {
    let name = isvc.name_any();
    let ns = isvc.namespace().ok_or(RenderError::NoNamespace)?;
    let owner = isvc.controller_owner_ref(&()).ok_or(RenderError::NoUid)?;
    let model = model::model_mount(&isvc.spec.model.source, &inputs.fetch_image)?;
    let mut out = Desired::default();
    let spec = &isvc.spec;
    pool_objects(
        isvc,
        Component::Prefill,
        &spec.prefill,
        inputs.prefill_groups,
        inputs,
        &model,
        &mut out,
    )?;
    pool_objects(
        isvc,
        Component::Decode,
        &spec.decode,
        inputs.decode_groups,
        inputs,
        &model,
        &mut out,
    )?;

    let image = spec.image.as_deref().unwrap_or(&inputs.default_image);
    let (cm, hash) = config_map(
        isvc,
        Component::Router,
        router_config(isvc, &model.model_path)?,
    );
    out.config_maps.push(cm);
    let service_type = match spec.router.service_type {
        ServiceType::ClusterIP => "ClusterIP",
        ServiceType::NodePort => "NodePort",
        ServiceType::LoadBalancer => "LoadBalancer",
    };
    out.services
        .push(objects::router_service(&name, &ns, service_type, &owner));
    out.deployments.push(objects::deployment(
        names::workload(&name, Component::Router),
        &ns,
        names::labels(&name, Component::Router),
        names::selector(&name, Component::Router),
        spec.router.replicas,
        pods::router_template(isvc, image, &model, &hash),
        &owner,
    ));
    let (sa, role, binding) = objects::router_rbac(&name, &ns, &owner);
    out.service_accounts.push(sa);
    out.roles.push(role);
    out.role_bindings.push(binding);
    gateway::render(isvc, image, &model, &owner, &mut out)?;
    Ok(out)
}

/// The router's in-cluster OpenAI base URL.
pub fn router_endpoint(isvc: &InferenceService) -> String {
    format!(
        "http://{}.{}.svc:{}/v1",
        names::workload(&isvc.name_any(), Component::Router),
        isvc.namespace().unwrap_or_default(),
        pods::ROUTER_HTTP_PORT
    )
}
