//! The workers the router knows: their gRPC channels (this registry is dispatch's), the
//! placement state they feed ([`PlacementState`], its own owner and lock), and the router's
//! background tasks. Discovery adds and removes workers here; watchers and event feeds reach the
//! placement state through [`Cluster::placement`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_kv_index::WorkerId;
use tokio_util::task::TaskTracker;
use tonic::transport::Channel;

use crate::place::state::PlacementState;
use crate::place::{PolicyKind, Role};

/// One known worker.
#[derive(Clone, Debug)]
pub struct WorkerEntry {
    /// Its id in the index and the load view.
    pub id: WorkerId,
    /// Its role.
    pub role: Role,
    /// Its gRPC endpoint (`http://host:port`).
    pub endpoint: String,
    pub(crate) channel: Channel,
}

/// A worker endpoint the router cannot make a channel to.
pub use cleave_tls::BadEndpoint;

/// The router's workers (see the module's documentation).
pub struct Cluster {
    placement: Arc<PlacementState>,
    workers: Mutex<BTreeMap<WorkerId, WorkerEntry>>,
    /// Mutual TLS on the channels to the workers (`--internal-tls-*`).
    tls: Option<cleave_tls::Mutual>,
    /// The router's background tasks (worker watches, discovery, KV-event feeds, reloads):
    /// owned here, so shutdown can wait for them ([`Cluster::finish_tasks`]).
    tasks: TaskTracker,
}

impl Default for Cluster {
    fn default() -> Self {
        Cluster::with_placement(PlacementState::default())
    }
}

impl Cluster {
    /// Workers placed through `placement`.
    pub fn with_placement(placement: PlacementState) -> Self {
        Cluster {
            placement: Arc::new(placement),
            workers: Mutex::new(BTreeMap::new()),
            tls: None,
            tasks: TaskTracker::new(),
        }
    }

    /// Workers placed with `policy` ([`PlacementState::for_policy`]).
    pub fn for_policy(policy: PolicyKind) -> Self {
        Cluster::with_placement(PlacementState::for_policy(policy))
    }

    /// Opens the channels to workers added from now on over mutual TLS with `tls`.
    pub fn with_internal_tls(mut self, tls: Option<cleave_tls::Mutual>) -> Self {
        self.tls = tls;
        self
    }

    /// The placement state: prefix index, load view, in-flight overlay.
    pub fn placement(&self) -> &Arc<PlacementState> {
        &self.placement
    }

    /// Runs `task` as one of the router's own tasks (a background task, or a request's relay);
    /// it must end when the router's shutdown token is cancelled or its request ends.
    pub fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tasks.spawn(task)
    }

    /// The router's tasks still running (background ones and requests' relays).
    pub fn background_tasks(&self) -> usize {
        self.tasks.len()
    }

    /// After shutdown was signalled: waits up to `patience` for the router's tasks to end
    /// ([`cleave_telemetry::finish_tasks`]).
    pub async fn finish_tasks(&self, patience: Duration) {
        cleave_telemetry::finish_tasks(&self.tasks, patience).await;
    }

    /// Adds (or replaces) a worker; it takes part in placement once it is healthy.
    pub fn add(&self, id: WorkerId, role: Role, endpoint: &str) -> Result<(), BadEndpoint> {
        let channel =
            cleave_tls::lazy_channel(endpoint, self.tls.as_ref(), Duration::from_secs(2))?;
        self.workers.lock().expect("workers").insert(
            id,
            WorkerEntry {
                id,
                role,
                endpoint: endpoint.to_string(),
                channel,
            },
        );
        self.placement.add_worker(id, role);
        Ok(())
    }

    /// Removes a worker and everything known about it.
    pub fn remove(&self, id: WorkerId) {
        self.workers.lock().expect("workers").remove(&id);
        self.placement.remove_worker(id);
    }

    /// A worker's entry.
    pub fn get(&self, id: WorkerId) -> Option<WorkerEntry> {
        self.workers.lock().expect("workers").get(&id).cloned()
    }

    /// Every worker.
    pub fn all(&self) -> Vec<WorkerEntry> {
        self.workers
            .lock()
            .expect("workers")
            .values()
            .cloned()
            .collect()
    }
}
