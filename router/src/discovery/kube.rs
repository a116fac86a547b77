//! Workers from the Kubernetes API: the pods matching a label selector in one namespace (the
//! operator labels worker pods `serving.cleave.dev/pool: prefill | decode`). A pod counts while
//! its `Ready` condition is `True`, it has a pod IP and it is not terminating; its endpoint is
//! `http://<podIP>:<container port named grpc, else 50051>` ([`pod_state`]).
//!
//! [`Kube::connect`] lists the pods; [`Discovery::start`] adds the ready ones, then follows a
//! watch (kube-runtime's watcher, which re-lists by itself when its watch expires) and, because
//! a watch can still miss a deletion, lists everything again every [`Kube::relist_every`].

use std::net::IpAddr;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;

use super::members::{Members, Record};
use super::Discovery;
use crate::dispatch::Cluster;
use crate::place::Role;

/// Ids of Kubernetes-discovered workers start here, above any static or etcd worker's.
pub const FIRST_ID: u64 = 1 << 40;
/// The label naming a worker pod's pool (its role).
pub const POOL_LABEL: &str = "serving.cleave.dev/pool";
/// LeaderWorkerSet's label of a pod's index in its group (0: the leader).
pub const LWS_INDEX_LABEL: &str = "leaderworkerset.sigs.k8s.io/worker-index";
/// The operator's label of a StatefulSet group's pods (their rank is the pod index).
pub const GROUP_LABEL: &str = "serving.cleave.dev/group";
/// The StatefulSet controller's label of a pod's ordinal (Kubernetes 1.28+).
pub const POD_INDEX_LABEL: &str = "apps.kubernetes.io/pod-index";
/// The name of the container port the workers serve gRPC on.
pub const GRPC_PORT_NAME: &str = "grpc";
/// The gRPC port when no container port is named [`GRPC_PORT_NAME`].
pub const DEFAULT_GRPC_PORT: i32 = 50051;

/// Why Kubernetes discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// No client configuration (neither in-cluster nor KUBECONFIG) or the API refused.
    #[error("the Kubernetes API")]
    Kube(#[from] kube::Error),
    /// An empty label selector would take every pod of the namespace for a worker.
    #[error("an empty pod label selector")]
    NoSelector,
}

/// What a pod means to the router.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PodState {
    /// A worker that serves at this record.
    Serving(Record),
    /// A worker pod that does not serve now (not ready, no IP yet, terminating).
    Waiting(&'static str),
    /// Not a worker pod the router can use (no or an unknown pool label, a bad pod IP).
    Invalid(String),
}

/// Decides whether and where `pod` serves.
pub fn pod_state(pod: &Pod) -> PodState {
    let pool = pod.metadata.labels.as_ref().and_then(|l| l.get(POOL_LABEL));
    let role = match pool.map(String::as_str) {
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        Some(other) => return PodState::Invalid(format!("unknown {POOL_LABEL} {other:?}")),
        None => return PodState::Invalid(format!("no {POOL_LABEL} label")),
    };
    let host = match pod_host(pod) {
        Ok(h) => h,
        Err(state) => return state,
    };
    let port = grpc_port(pod);
    PodState::Serving(Record {
        role,
        endpoint: format!("http://{host}:{port}"),
    })
}

/// The host part of a serving pod's endpoints (an IPv4 address, or an IPv6 one in brackets),
/// or why it does not serve: terminating, a follower rank of a worker group, not ready, no or a
/// bad pod IP. Shared with the endpoint picker's pool members.
pub fn pod_host(pod: &Pod) -> Result<String, PodState> {
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(PodState::Waiting("terminating"));
    }
    // A follower rank of a multi-node worker group: only the group's leader serves requests.
    let labels = pod.metadata.labels.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    let follower = label(LWS_INDEX_LABEL).is_some_and(|i| i != "0")
        || (label(GROUP_LABEL).is_some() && label(POD_INDEX_LABEL).is_some_and(|i| i != "0"));
    if follower {
        return Err(PodState::Waiting("a follower rank of a worker group"));
    }
    let status = pod.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    if !ready {
        return Err(PodState::Waiting("not ready"));
    }
    let Some(ip) = status
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|ip| !ip.is_empty())
    else {
        return Err(PodState::Waiting("no pod IP"));
    };
    match ip.parse::<IpAddr>() {
        Ok(IpAddr::V4(v4)) => Ok(v4.to_string()),
        Ok(IpAddr::V6(v6)) => Ok(format!("[{v6}]")),
        Err(_) => Err(PodState::Invalid(format!("pod IP {ip:?} is no IP address"))),
    }
}

/// A worker pod's gRPC port: its container port named [`GRPC_PORT_NAME`], else
/// [`DEFAULT_GRPC_PORT`].
pub fn grpc_port(pod: &Pod) -> i32 {
    pod.spec
        .iter()
        .flat_map(|s| &s.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some(GRPC_PORT_NAME))
        .map_or(DEFAULT_GRPC_PORT, |p| p.container_port)
}

fn pod_name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

/// The serving pods of `pods`, by name.
fn serving(pods: &[Pod]) -> Vec<(String, Record)> {
    pods.iter()
        .filter_map(|p| match pod_state(p) {
            PodState::Serving(r) => Some((pod_name(p), r)),
            PodState::Waiting(_) => None,
            PodState::Invalid(why) => {
                tracing::debug!(pod = %pod_name(p), %why, "not a worker pod");
                None
            }
        })
        .collect()
}

/// Kubernetes discovery, connected and with the initial listing done.
pub struct Kube {
    api: Api<Pod>,
    namespace: String,
    selector: String,
    /// How often all matching pods are listed again.
    pub relist_every: Duration,
    listing: Vec<(String, Record)>,
}

impl Kube {
    /// Connects with in-cluster config or KUBECONFIG and lists the pods; `namespace` defaults
    /// to the client's.
    pub async fn connect(namespace: Option<&str>, selector: &str) -> Result<Kube, KubeError> {
        Kube::with_client(Client::try_default().await?, namespace, selector).await
    }

    /// Like [`Kube::connect`] with a given client.
    pub async fn with_client(
        client: Client,
        namespace: Option<&str>,
        selector: &str,
    ) -> Result<Kube, KubeError> {
        let selector = selector.trim();
        if selector.is_empty() {
            return Err(KubeError::NoSelector);
        }
        let namespace = namespace
            .unwrap_or_else(|| client.default_namespace())
            .to_string();
        let api = Api::<Pod>::namespaced(client, &namespace);
        let listing = list(&api, selector).await?;
        Ok(Kube {
            api,
            namespace,
            selector: selector.to_string(),
            relist_every: Duration::from_secs(30),
            listing,
        })
    }

    /// The namespace watched.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
}

async fn list(api: &Api<Pod>, selector: &str) -> Result<Vec<(String, Record)>, kube::Error> {
    let pods = api.list(&ListParams::default().labels(selector)).await?;
    Ok(serving(&pods.items))
}

impl Discovery for Kube {
    fn start(
        self: Box<Self>,
        cluster: Arc<Cluster>,
        shutdown: CancellationToken,
    ) -> Result<(), crate::dispatch::BadEndpoint> {
        let Kube {
            api,
            selector,
            relist_every,
            listing,
            ..
        } = *self;
        let mut members = Members::new(cluster.clone(), shutdown, FIRST_ID);
        members.reconcile(listing);
        cluster.spawn(follow(api, selector, relist_every, members));
        Ok(())
    }
}

/// Applies the watch's events and re-lists every `relist_every` until shutdown.
async fn follow(api: Api<Pod>, selector: String, relist_every: Duration, mut members: Members) {
    let shutdown = members.shutdown.clone();
    let config = watcher::Config::default().labels(&selector);
    let mut events = pin!(watcher::watcher(api.clone(), config).default_backoff());
    let mut relist = tokio::time::interval(relist_every);
    relist.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    relist.tick().await; // the first tick is immediate; the listing was just done
                         // Pods of a watcher (re)start, reconciled at once when it is complete.
    let mut initial: Option<Vec<Pod>> = None;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = relist.tick() => match list(&api, &selector).await {
                Ok(listing) => members.reconcile(listing),
                Err(e) => tracing::warn!(error = %e, "listing worker pods failed"),
            },
            event = events.next() => match event {
                None => return,
                Some(Err(e)) => tracing::warn!(error = %e, "watching worker pods failed; retrying"),
                Some(Ok(Event::Init)) => initial = Some(Vec::new()),
                Some(Ok(Event::InitApply(pod))) => initial.get_or_insert_with(Vec::new).push(pod),
                Some(Ok(Event::InitDone)) => {
                    members.reconcile(serving(&initial.take().unwrap_or_default()));
                }
                Some(Ok(Event::Apply(pod))) => {
                    let name = pod_name(&pod);
                    match pod_state(&pod) {
                        PodState::Serving(r) => members.put(&name, r),
                        PodState::Waiting(why) => {
                            tracing::debug!(pod = %name, %why, "worker pod not serving");
                            members.delete(&name);
                        }
                        PodState::Invalid(why) => {
                            tracing::warn!(pod = %name, %why, "ignoring a pod that is no worker");
                            members.delete(&name);
                        }
                    }
                }
                Some(Ok(Event::Delete(pod))) => members.delete(&pod_name(&pod)),
            },
        }
    }
}

#[cfg(test)]
#[path = "kube_tests.rs"]
mod tests;
