//! Server-side apply of the rendered objects with one field manager, and pruning of owned
//! workloads the spec no longer wants.

use std::collections::BTreeSet;
use std::fmt::Debug;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::render::names::{self, MANAGER};
use crate::render::{gateway, objects, Desired};

/// Field manager of every write.
pub fn apply_params() -> PatchParams {
    PatchParams::apply(MANAGER).force()
}

async fn apply_one<K>(client: &Client, obj: &K) -> Result<K, kube::Error>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + Debug
        + Serialize
        + DeserializeOwned,
{
    let ns = obj.meta().namespace.clone().unwrap_or_default();
    let api: Api<K> = Api::namespaced(client.clone(), &ns);
    let mut body = serde_json::to_value(obj).map_err(kube::Error::SerdeError)?;
    body["apiVersion"] = K::api_version(&()).into();
    body["kind"] = K::kind(&()).into();
    api.patch(&obj.name_any(), &apply_params(), &Patch::Apply(&body))
        .await
}

/// What the API server returned for the workloads (with their status).
#[derive(Debug, Default)]
pub struct Applied {
    /// Deployments as stored.
    pub deployments: Vec<Deployment>,
    /// StatefulSets as stored.
    pub stateful_sets: Vec<StatefulSet>,
    /// LeaderWorkerSets as stored.
    pub leader_worker_sets: Vec<DynamicObject>,
}

/// Applies everything, config first so new pods see their config.
pub async fn apply_all(client: &Client, d: &Desired) -> Result<Applied, kube::Error> {
    for o in &d.config_maps {
        apply_one(client, o).await?;
    }
    for o in &d.service_accounts {
        apply_one(client, o).await?;
    }
    for o in &d.roles {
        apply_one(client, o).await?;
    }
    for o in &d.role_bindings {
        apply_one(client, o).await?;
    }
    for o in &d.services {
        apply_one(client, o).await?;
    }
    let mut out = Applied::default();
    for o in &d.deployments {
        out.deployments.push(apply_one(client, o).await?);
    }
    for o in &d.stateful_sets {
        out.stateful_sets.push(apply_one(client, o).await?);
    }
    let lws = objects::lws_resource();
    for o in &d.leader_worker_sets {
        let ns = o.metadata.namespace.clone().unwrap_or_default();
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &lws);
        out.leader_worker_sets.push(
            api.patch(&o.name_any(), &apply_params(), &Patch::Apply(o))
                .await?,
        );
    }
    let pools = gateway::inference_pool_resource();
    for o in &d.inference_pools {
        let ns = o.metadata.namespace.clone().unwrap_or_default();
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &pools);
        api.patch(&o.name_any(), &apply_params(), &Patch::Apply(o))
            .await
            .map_err(no_pool_crd)?;
    }
    Ok(out)
}

/// A 404 on an InferencePool means its CRD is not installed: say so, and how to fix it.
fn no_pool_crd(e: kube::Error) -> kube::Error {
    match e {
        kube::Error::Api(mut r) if r.code == 404 => {
            r.message = format!(
                "spec.gateway.inferencePool needs the InferencePool CRD \
                 (inferencepools.{}/v1) installed in the cluster: kubectl apply -f \
                 crds/upstream/inference.networking.k8s.io_inferencepools.yaml ({})",
                cleave_config::epp::INFERENCE_POOL_GROUP,
                r.message
            );
            kube::Error::Api(r)
        }
        e => e,
    }
}

async fn prune_kind<K>(
    api: Api<K>,
    selector: &str,
    keep: &BTreeSet<String>,
) -> Result<Vec<String>, kube::Error>
where
    K: Resource + Clone + Debug + DeserializeOwned,
{
    let mut deleted = Vec::new();
    for o in api.list(&ListParams::default().labels(selector)).await? {
        let name = o.name_any();
        if !keep.contains(&name) {
            api.delete(&name, &DeleteParams::background()).await?;
            deleted.push(name);
        }
    }
    Ok(deleted)
}

/// Deletes this instance's workloads that are not desired (a pool switched between
/// Deployment/StatefulSet/LeaderWorkerSet, or fewer StatefulSet groups). Returns their names.
pub async fn prune(
    client: &Client,
    ns: &str,
    name: &str,
    d: &Desired,
    lws_available: bool,
) -> Result<Vec<String>, kube::Error> {
    let selector = format!(
        "{},app.kubernetes.io/managed-by={MANAGER}",
        names::instance_selector(name)
    );
    let names_of = |v: Vec<Option<String>>| v.into_iter().flatten().collect::<BTreeSet<_>>();
    let mut deleted = prune_kind(
        Api::<Deployment>::namespaced(client.clone(), ns),
        &selector,
        &names_of(
            d.deployments
                .iter()
                .map(|o| o.metadata.name.clone())
                .collect(),
        ),
    )
    .await?;
    deleted.extend(
        prune_kind(
            Api::<StatefulSet>::namespaced(client.clone(), ns),
            &selector,
            &names_of(
                d.stateful_sets
                    .iter()
                    .map(|o| o.metadata.name.clone())
                    .collect(),
            ),
        )
        .await?,
    );
    // An isvc that turned spec.gateway off: its InferencePool goes (the CRD may be absent,
    // then there is nothing to delete).
    let pools = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        ns,
        &gateway::inference_pool_resource(),
    );
    match prune_kind(
        pools,
        &selector,
        &names_of(
            d.inference_pools
                .iter()
                .map(|o| o.metadata.name.clone())
                .collect(),
        ),
    )
    .await
    {
        Ok(gone) => deleted.extend(gone),
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(e),
    }
    if lws_available {
        deleted.extend(
            prune_kind(
                Api::<DynamicObject>::namespaced_with(client.clone(), ns, &objects::lws_resource()),
                &selector,
                &names_of(
                    d.leader_worker_sets
                        .iter()
                        .map(|o| o.metadata.name.clone())
                        .collect(),
                ),
            )
            .await?,
        );
    }
    Ok(deleted)
}
