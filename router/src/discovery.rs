//! How the router learns its workers: [`Static`] (a list, for `cleave up` and tests) and
//! [`etcd::Etcd`] (workers register under a lease) and [`kube::Kube`] (ready pods found by
//! label), all behind one trait.

use std::sync::Arc;

use cleave_kv_index::WorkerId;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{BadEndpoint, Cluster};
use crate::place::Role;

pub mod etcd;
pub mod kube;
mod members;

pub use members::Record;

/// Finds workers and keeps the cluster's membership current until `shutdown`.
pub trait Discovery: Send + 'static {
    /// Starts discovering; returns once the initial membership is known.
    fn start(
        self: Box<Self>,
        cluster: Arc<Cluster>,
        shutdown: CancellationToken,
    ) -> Result<(), BadEndpoint>;
}

/// A fixed list of workers.
#[derive(Clone, Debug, Default)]
pub struct Static {
    /// `(role, gRPC endpoint)` of every worker.
    pub workers: Vec<(Role, String)>,
}

impl Discovery for Static {
    fn start(
        self: Box<Self>,
        cluster: Arc<Cluster>,
        shutdown: CancellationToken,
    ) -> Result<(), BadEndpoint> {
        for (i, (role, endpoint)) in self.workers.into_iter().enumerate() {
            let id = WorkerId(i as u64);
            cluster.add(id, role, &endpoint)?;
            cluster.spawn(crate::watch::follow(cluster.clone(), id, shutdown.clone()));
        }
        Ok(())
    }
}
