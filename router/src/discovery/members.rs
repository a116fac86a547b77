//! The workers a discovery source added to the [`Cluster`], by the source's key (an etcd key,
//! a pod name): shared by [`super::etcd`] and [`super::kube`].

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cleave_kv_index::WorkerId;
use tokio_util::sync::CancellationToken;

use crate::dispatch::Cluster;
use crate::place::Role;

/// What a discovery source says about one worker.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Record {
    /// The worker's role.
    pub role: Role,
    /// Its gRPC endpoint.
    pub endpoint: String,
}

/// The workers one discovery source added, by key; each is followed (`watch::follow`) until
/// it is removed or `shutdown`.
pub(crate) struct Members {
    cluster: Arc<Cluster>,
    pub(crate) shutdown: CancellationToken,
    by_key: HashMap<String, (WorkerId, Record)>,
    next_id: u64,
}

impl Members {
    /// No members yet; ids are handed out from `first_id` up.
    pub(crate) fn new(cluster: Arc<Cluster>, shutdown: CancellationToken, first_id: u64) -> Self {
        Members {
            cluster,
            shutdown,
            by_key: HashMap::new(),
            next_id: first_id,
        }
    }

    /// Adds `key`'s worker, or replaces it when its record changed.
    pub(crate) fn put(&mut self, key: &str, record: Record) {
        if let Some((_, old)) = self.by_key.get(key) {
            if *old == record {
                return;
            }
            self.delete(key);
        }
        let id = WorkerId(self.next_id);
        self.next_id += 1;
        if let Err(e) = self.cluster.add(id, record.role, &record.endpoint) {
            tracing::warn!(%key, endpoint = %record.endpoint, error = %e, "bad worker endpoint");
            return;
        }
        tracing::info!(worker = %id, %key, endpoint = %record.endpoint, role = ?record.role, "worker discovered");
        self.cluster.spawn(crate::watch::follow(
            self.cluster.clone(),
            id,
            self.shutdown.clone(),
        ));
        self.by_key.insert(key.to_string(), (id, record));
    }

    /// Removes `key`'s worker, if any.
    pub(crate) fn delete(&mut self, key: &str) {
        if let Some((id, record)) = self.by_key.remove(key) {
            tracing::info!(worker = %id, %key, endpoint = %record.endpoint, "worker gone");
            self.cluster.remove(id);
        }
    }

    /// Makes the members exactly `listing`.
    pub(crate) fn reconcile(&mut self, listing: Vec<(String, Record)>) {
        let keep: HashSet<&String> = listing.iter().map(|(k, _)| k).collect();
        let gone: Vec<String> = self
            .by_key
            .keys()
            .filter(|k| !keep.contains(k))
            .cloned()
            .collect();
        for k in gone {
            self.delete(&k);
        }
        for (k, r) in listing {
            self.put(&k, r);
        }
    }
}
