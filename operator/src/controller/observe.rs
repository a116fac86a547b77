//! Reading the cluster: readiness of applied workloads, LeaderWorkerSet availability, and the
//! pools' queue depth from the workers' Prometheus endpoints.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams};
use kube::Client;

use super::apply::Applied;
use crate::render::names::{self, Component};
use crate::render::pods::WORKER_HTTP_PORT;
use crate::scale::{sum_metric, QUEUE_METRIC};

/// Whether the API server serves leaderworkerset.x-k8s.io/v1 (capability detection: 1.20 test
/// servers do not, so multi-node groups fall back to StatefulSets).
pub async fn lws_available(client: &Client) -> bool {
    client
        .list_api_group_resources("leaderworkerset.x-k8s.io/v1")
        .await
        .map(|r| r.resources.iter().any(|x| x.name == "leaderworkersets"))
        .unwrap_or(false)
}

/// Ready groups of a pool among the applied workloads.
pub fn ready_groups(applied: &Applied, name: &str, c: Component) -> i32 {
    let workload = names::workload(name, c);
    if let Some(d) = applied
        .deployments
        .iter()
        .find(|d| d.metadata.name.as_deref() == Some(&workload))
    {
        return d
            .status
            .as_ref()
            .and_then(|s| s.ready_replicas)
            .unwrap_or(0);
    }
    if let Some(l) = applied
        .leader_worker_sets
        .iter()
        .find(|l| l.metadata.name.as_deref() == Some(&workload))
    {
        return l.data["status"]["readyReplicas"].as_i64().unwrap_or(0) as i32;
    }
    let prefix = format!("{workload}-g");
    applied
        .stateful_sets
        .iter()
        .filter(|s| {
            s.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .filter(|s| {
            let want = s.spec.as_ref().and_then(|x| x.replicas).unwrap_or(1);
            let ready = s
                .status
                .as_ref()
                .and_then(|x| x.ready_replicas)
                .unwrap_or(0);
            ready >= want
        })
        .count() as i32
}

fn pod_ready(p: &Pod) -> Option<String> {
    let status = p.status.as_ref()?;
    let ready = status
        .conditions
        .as_ref()?
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if ready {
        status.pod_ip.clone()
    } else {
        None
    }
}

/// Why the instance's pods are not running (at most three distinct problems).
pub async fn pod_problems(
    client: &Client,
    ns: &str,
    name: &str,
) -> Result<Vec<crate::problems::Problem>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = format!("{}={name}", names::INSTANCE);
    let list = pods.list(&ListParams::default().labels(&selector)).await?;
    Ok(crate::problems::of_pods(&list.items, 3))
}

/// Sum of `cleave_worker_queue_depth` over the pool's ready pods; `None` when no pod answered.
pub async fn pool_queue_depth(
    client: &Client,
    http: &reqwest::Client,
    ns: &str,
    name: &str,
    c: Component,
) -> Result<Option<f64>, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = names::selector(name, c)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let mut total = None;
    for pod in pods.list(&ListParams::default().labels(&selector)).await? {
        let Some(ip) = pod_ready(&pod) else { continue };
        let url = format!("http://{ip}:{WORKER_HTTP_PORT}/metrics");
        match scrape(http, &url).await {
            Some(v) => *total.get_or_insert(0.0) += v,
            None => tracing::debug!(%url, "no queue depth from worker"),
        }
    }
    Ok(total)
}

/// One worker's queue depth.
pub async fn scrape(http: &reqwest::Client, url: &str) -> Option<f64> {
    let resp = http
        .get(url)
        .timeout(Duration::from_secs(2))
        .send()
        .await
        .ok()?;
    let text = resp.error_for_status().ok()?.text().await.ok()?;
    sum_metric(&text, QUEUE_METRIC)
}
