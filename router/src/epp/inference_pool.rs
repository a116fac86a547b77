//! The pool's members from the Kubernetes API: the `InferencePool`
//! (`inference.networking.k8s.io/v1`) names a label selector (`spec.selector.matchLabels`) and
//! target ports (`spec.targetPorts[].number`); every ready pod it selects gives one member per
//! target port, `podIP:port` ([`pod_members`]).
//!
//! Pods are judged as the router's own discovery judges them ([`crate::discovery::kube`]:
//! ready, not terminating, an IP, not a follower rank of a worker group). A pod labelled
//! `serving.cleave.dev/pool=decode` is a cleave decode worker, followed on its gRPC `Watch`;
//! a cleave prefill worker cannot take an HTTP request and is skipped; any other pod is a
//! vLLM/SGLang-style server whose metrics are scraped at `http://podIP:port<metrics_path>`.
//!
//! [`KubePool::start`] reads the pool and lists its pods (an error if the pool is missing), then follows
//! a pod watch and, every `relist`, reads the pool again and lists everything (a watch can miss
//! a deletion); a changed selector or port list restarts the watch.

use std::collections::{BTreeMap, HashMap};
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use serde::Deserialize;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

use super::pool::{Backend, Member, Pool};
use crate::discovery::kube::{grpc_port, pod_host, PodState, POOL_LABEL};

pub use cleave_config::epp::{
    INFERENCE_POOL_GROUP as GROUP, INFERENCE_POOL_KIND as KIND, INFERENCE_POOL_VERSION as VERSION,
};

/// The InferencePool API resource.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(GROUP, VERSION, KIND),
        cleave_config::epp::INFERENCE_POOL_PLURAL,
    )
}

/// Why the pool could not be followed.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The API refused or could not be reached.
    #[error("the Kubernetes API")]
    Kube(#[from] kube::Error),
    /// The named InferencePool does not exist.
    #[error("no InferencePool {name:?} in namespace {namespace:?}")]
    NotFound {
        /// The pool's name.
        name: String,
        /// Its namespace.
        namespace: String,
    },
    /// The pool's spec cannot be used.
    #[error("InferencePool {name:?}: {why}")]
    BadSpec {
        /// The pool's name.
        name: String,
        /// What is wrong.
        why: String,
    },
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Spec {
    selector: Selector,
    target_ports: Vec<Port>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Selector {
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct Port {
    number: i32,
}

/// What the pool selects: a pod label selector and the target ports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `k=v,k2=v2` from `matchLabels`.
    pub selector: String,
    /// The ports every selected pod serves on.
    pub ports: Vec<i32>,
}

/// Reads an InferencePool object's spec.
pub fn target(name: &str, object: &DynamicObject) -> Result<Target, PoolError> {
    let bad = |why: String| PoolError::BadSpec {
        name: name.to_string(),
        why,
    };
    let spec = object
        .data
        .get("spec")
        .ok_or_else(|| bad("it has no spec".into()))?;
    let spec: Spec =
        serde_json::from_value(spec.clone()).map_err(|e| bad(format!("its spec: {e}")))?;
    if spec.selector.match_labels.is_empty() {
        return Err(bad(
            "spec.selector.matchLabels is empty (it would select every pod)".into(),
        ));
    }
    if spec.target_ports.is_empty() {
        return Err(bad("spec.targetPorts is empty".into()));
    }
    if let Some(p) = spec
        .target_ports
        .iter()
        .find(|p| !(1..=65535).contains(&p.number))
    {
        return Err(bad(format!("target port {} is out of range", p.number)));
    }
    let selector = spec
        .selector
        .match_labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    Ok(Target {
        selector,
        ports: spec.target_ports.iter().map(|p| p.number).collect(),
    })
}

/// The members `pod` gives for `target`, or why it gives none now.
pub fn pod_members(
    pod: &Pod,
    target: &Target,
    metrics_path: &str,
) -> Result<Vec<Member>, PodState> {
    let kind = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(POOL_LABEL))
        .cloned();
    if let Some(k) = kind.as_deref().filter(|k| *k != "decode") {
        return Err(PodState::Invalid(format!(
            "a cleave {k} pod ({POOL_LABEL}={k}) cannot serve HTTP requests"
        )));
    }
    let host = pod_host(pod)?;
    Ok(target
        .ports
        .iter()
        .map(|port| Member {
            destination: format!("{host}:{port}"),
            backend: match kind {
                Some(_) => Backend::Cleave {
                    grpc: format!("http://{host}:{}", grpc_port(pod)),
                },
                None => Backend::Metrics {
                    url: format!("http://{host}:{port}{metrics_path}"),
                },
            },
        })
        .collect())
}

fn pod_name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

fn listing(pods: &[Pod], target: &Target, metrics_path: &str) -> HashMap<String, Vec<Member>> {
    pods.iter()
        .filter_map(|p| match pod_members(p, target, metrics_path) {
            Ok(m) => Some((pod_name(p), m)),
            Err(PodState::Invalid(why)) => {
                tracing::debug!(pod = %pod_name(p), %why, "not a pool member");
                None
            }
            Err(_) => None,
        })
        .collect()
}

/// Follows one InferencePool's pods into a [`Pool`].
pub struct KubePool {
    pools: Api<DynamicObject>,
    pods: Api<Pod>,
    name: String,
    namespace: String,
    /// How often the pool and its pods are read again besides the watch.
    pub relist_every: Duration,
    /// The path of the model servers' metrics.
    pub metrics_path: String,
}

impl KubePool {
    /// The pool `name` in `namespace` (default: the client's).
    pub fn new(client: Client, namespace: Option<&str>, name: &str) -> KubePool {
        let namespace = namespace
            .unwrap_or_else(|| client.default_namespace())
            .to_string();
        KubePool {
            pools: Api::namespaced_with(client.clone(), &namespace, &resource()),
            pods: Api::namespaced(client, &namespace),
            name: name.to_string(),
            namespace,
            relist_every: Duration::from_secs(30),
            metrics_path: "/metrics".into(),
        }
    }

    /// The namespace followed.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    async fn read(&self) -> Result<Target, PoolError> {
        match self.pools.get_opt(&self.name).await? {
            Some(obj) => target(&self.name, &obj),
            None => Err(PoolError::NotFound {
                name: self.name.clone(),
                namespace: self.namespace.clone(),
            }),
        }
    }

    async fn list(&self, target: &Target) -> Result<HashMap<String, Vec<Member>>, kube::Error> {
        let pods = self
            .pods
            .list(&ListParams::default().labels(&target.selector))
            .await?;
        Ok(listing(&pods.items, target, &self.metrics_path))
    }

    /// Reads the pool, lists its pods into `pool`, then follows both until `shutdown`.
    pub async fn start(
        self,
        pool: Arc<Pool>,
        shutdown: CancellationToken,
    ) -> Result<Target, PoolError> {
        let target = self.read().await?;
        pool.reconcile(self.list(&target).await?);
        tracing::info!(pool = %self.name, namespace = %self.namespace, selector = %target.selector, ports = ?target.ports, "InferencePool read");
        let first = target.clone();
        pool.cluster()
            .clone()
            .spawn(self.follow(target, pool, shutdown));
        Ok(first)
    }

    async fn follow(self, mut target: Target, pool: Arc<Pool>, shutdown: CancellationToken) {
        let mut relist = tokio::time::interval(self.relist_every);
        relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        relist.tick().await; // immediate; the listing was just done
        loop {
            let config = watcher::Config::default().labels(&target.selector);
            let mut events = pin!(watcher::watcher(self.pods.clone(), config).default_backoff());
            let mut initial: Option<Vec<Pod>> = None;
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = relist.tick() => {
                        match self.read().await {
                            Ok(t) => {
                                let changed = t != target;
                                target = t;
                                match self.list(&target).await {
                                    Ok(l) => pool.reconcile(l),
                                    Err(e) => tracing::warn!(error = %e, "listing pool pods failed"),
                                }
                                if changed {
                                    tracing::info!(selector = %target.selector, ports = ?target.ports, "InferencePool changed");
                                    break;
                                }
                            }
                            Err(e) => tracing::warn!(error = %e, "reading the InferencePool failed"),
                        }
                    }
                    event = events.next() => match event {
                        None => return,
                        Some(Err(e)) => tracing::warn!(error = %e, "watching pool pods failed; retrying"),
                        Some(Ok(Event::Init)) => initial = Some(Vec::new()),
                        Some(Ok(Event::InitApply(p))) => initial.get_or_insert_with(Vec::new).push(p),
                        Some(Ok(Event::InitDone)) => {
                            let pods = initial.take().unwrap_or_default();
                            pool.reconcile(listing(&pods, &target, &self.metrics_path));
                        }
                        Some(Ok(Event::Apply(p))) => {
                            let name = pod_name(&p);
                            match pod_members(&p, &target, &self.metrics_path) {
                                Ok(m) => pool.set(&name, m),
                                Err(why) => {
                                    tracing::debug!(pod = %name, ?why, "pod not serving");
                                    pool.delete(&name);
                                }
                            }
                        }
                        Some(Ok(Event::Delete(p))) => pool.delete(&pod_name(&p)),
                    },
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pool_object(spec: serde_json::Value) -> DynamicObject {
        let mut o = DynamicObject::new("p", &resource());
        o.data = json!({ "spec": spec });
        o
    }

    fn pod(labels: serde_json::Value, ready: bool, ip: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "pod-0", "labels": labels},
            "spec": {"containers": [{"name": "c", "ports": [{"name": "grpc", "containerPort": 50060}]}]},
            "status": {
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
            }
        }))
        .expect("pod")
    }

    #[test]
    fn reads_the_v1_spec() {
        let t = target(
            "p",
            &pool_object(json!({
                "selector": {"matchLabels": {"app": "vllm", "tier": "a"}},
                "targetPorts": [{"number": 8000}, {"number": 8001}],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}
            })),
        )
        .expect("target");
        assert_eq!(
            t,
            Target {
                selector: "app=vllm,tier=a".into(),
                ports: vec![8000, 8001]
            }
        );
        for (spec, needle) in [
            (
                json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}),
                "empty",
            ),
            (
                json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}),
                "targetPorts",
            ),
            (
                json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]}),
                "range",
            ),
            (
                json!({"selector": {"app": "x"}, "targetPorts": [{"number": 1}]}),
                "matchLabels",
            ),
        ] {
            let e = target("p", &pool_object(spec)).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn pods_become_members_per_port() {
        let t = Target {
            selector: "app=x".into(),
            ports: vec![8000, 8001],
        };
        let vllm = pod_members(&pod(json!({"app": "x"}), true, "10.1.2.3"), &t, "/metrics")
            .expect("members");
        assert_eq!(vllm.len(), 2);
        assert_eq!(vllm[1].destination, "10.1.2.3:8001");
        assert_eq!(
            vllm[1].backend,
            Backend::Metrics {
                url: "http://10.1.2.3:8001/metrics".into()
            }
        );
        let cleave = pod_members(
            &pod(json!({"app": "x", POOL_LABEL: "decode"}), true, "fd00::1"),
            &t,
            "/metrics",
        )
        .expect("members");
        assert_eq!(cleave[0].destination, "[fd00::1]:8000");
        assert_eq!(
            cleave[0].backend,
            Backend::Cleave {
                grpc: "http://[fd00::1]:50060".into()
            }
        );
        assert_eq!(
            pod_members(&pod(json!({"app": "x"}), false, "10.1.2.3"), &t, "/m"),
            Err(PodState::Waiting("not ready"))
        );
        assert!(matches!(
            pod_members(
                &pod(json!({"app": "x", POOL_LABEL: "prefill"}), true, "10.1.2.3"),
                &t,
                "/m"
            ),
            Err(PodState::Invalid(_))
        ));
    }
}
