//! Object names and labels (the labels are the contract with the router's discovery).

use std::collections::BTreeMap;

/// Which part of an InferenceService an object belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Component {
    /// Prefill workers.
    Prefill,
    /// Decode workers.
    Decode,
    /// The router.
    Router,
}

impl Component {
    /// `prefill`, `decode` or `router`.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Prefill => "prefill",
            Component::Decode => "decode",
            Component::Router => "router",
        }
    }

    /// The binary the component's container runs.
    pub fn binary(self) -> &'static str {
        match self {
            Component::Prefill => "cleave-prefill",
            Component::Decode => "cleave-decode",
            Component::Router => "cleave-router",
        }
    }
}

/// The label naming the InferenceService.
pub const INSTANCE: &str = "app.kubernetes.io/instance";
/// The worker pool label the router's discovery reads.
pub const POOL: &str = "serving.cleave.dev/pool";
/// The group index label of StatefulSet-based multi-node groups.
pub const GROUP: &str = "serving.cleave.dev/group";
/// The operator's field manager and `managed-by` value.
pub const MANAGER: &str = "cleave-operator";

/// Labels on every object of an InferenceService's component.
pub fn labels(name: &str, c: Component) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "cleave".to_string()),
        (INSTANCE.to_string(), name.to_string()),
        (
            "app.kubernetes.io/component".to_string(),
            c.as_str().to_string(),
        ),
        (
            "app.kubernetes.io/managed-by".to_string(),
            MANAGER.to_string(),
        ),
    ])
}

/// Pod labels: `labels` plus the pool label on workers.
pub fn pod_labels(name: &str, c: Component) -> BTreeMap<String, String> {
    let mut l = labels(name, c);
    if c != Component::Router {
        l.insert(POOL.to_string(), c.as_str().to_string());
    }
    l
}

/// Selector of a component's pods.
pub fn selector(name: &str, c: Component) -> BTreeMap<String, String> {
    BTreeMap::from([
        (INSTANCE.to_string(), name.to_string()),
        (
            "app.kubernetes.io/component".to_string(),
            c.as_str().to_string(),
        ),
    ])
}

/// `app.kubernetes.io/instance=<name>`, the router's `--kube-selector`.
pub fn instance_selector(name: &str) -> String {
    format!("{INSTANCE}={name}")
}

/// `<name>-<component>`: Deployment, Service, ConfigMap and LeaderWorkerSet name.
pub fn workload(name: &str, c: Component) -> String {
    format!("{name}-{}", c.as_str())
}

/// ConfigMap of a component.
pub fn config_map(name: &str, c: Component) -> String {
    workload(name, c)
}

/// StatefulSet of multi-node group `i`.
pub fn group(name: &str, c: Component, i: i32) -> String {
    format!("{name}-{}-g{i}", c.as_str())
}

/// The router's ServiceAccount (and Role, RoleBinding): pods get/list/watch for discovery.
pub fn router_account(name: &str) -> String {
    format!("{name}-router")
}
