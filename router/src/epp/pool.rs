//! The endpoint picker's pool: the model servers it may pick, each an `ip:port` destination
//! that Envoy sends the request to, and a placement worker in the shared [`Cluster`] (prefix
//! index and load view) that the policy scores.
//!
//! A member's load comes from where its kind reports it ([`Backend`]): a cleave decode worker
//! streams KV events and load on its gRPC `Watch` ([`crate::watch::follow`], as for the HTTP
//! router); a vLLM- or SGLang-style server is scraped ([`super::scrape`]). Either way a member
//! is placed on only while healthy (Watch connected, or the last scrape answered).
//!
//! Members are keyed by a source key (a pod name; an address for static members); one key may
//! give several members (one per InferencePool target port).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use cleave_kv_index::WorkerId;
use tokio_util::sync::CancellationToken;

use super::scrape::{self, PromptBlocks, ScrapeConfig};
use crate::dispatch::Cluster;
use crate::place::Role;

/// Ids of pool members start here (the pool is the only source of workers in this mode).
pub const FIRST_ID: u64 = 1 << 41;

/// Where a member's load comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// A cleave decode worker: its gRPC endpoint (`http://ip:port`), followed with `Watch`.
    Cleave {
        /// The worker's gRPC endpoint.
        grpc: String,
    },
    /// A server exporting vLLM or SGLang metrics at this URL.
    Metrics {
        /// The `/metrics` URL.
        url: String,
    },
}

/// One endpoint of the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Where Envoy sends the request: `ip:port` (`[ipv6]:port`).
    pub destination: String,
    /// Where its load comes from.
    pub backend: Backend,
}

struct Entry {
    id: WorkerId,
    member: Member,
    stop: CancellationToken,
}

#[derive(Default)]
struct State {
    by_key: HashMap<String, Vec<Entry>>,
    destinations: BTreeMap<WorkerId, String>,
    next_id: u64,
}

/// The pool's members and the tasks that keep their load current.
pub struct Pool {
    cluster: Arc<Cluster>,
    scrape: ScrapeConfig,
    prompts: Arc<PromptBlocks>,
    shutdown: CancellationToken,
    state: Mutex<State>,
}

impl Pool {
    /// An empty pool over `cluster`; member tasks stop at `shutdown`.
    pub fn new(
        cluster: Arc<Cluster>,
        scrape: ScrapeConfig,
        prompts: Arc<PromptBlocks>,
        shutdown: CancellationToken,
    ) -> Pool {
        Pool {
            cluster,
            scrape,
            prompts,
            shutdown,
            state: Mutex::new(State {
                next_id: FIRST_ID,
                ..Default::default()
            }),
        }
    }

    /// Makes `key`'s members exactly `members`: unchanged ones keep their id and load, the
    /// others are removed or added.
    pub fn set(&self, key: &str, members: Vec<Member>) {
        let mut state = self.state.lock().expect("pool");
        let old = state.by_key.remove(key).unwrap_or_default();
        let mut kept = Vec::new();
        for e in old {
            if members.contains(&e.member) {
                kept.push(e);
            } else {
                self.drop_entry(&mut state, key, e);
            }
        }
        for m in members {
            if kept.iter().any(|e| e.member == m) {
                continue;
            }
            if let Some(e) = self.add_entry(&mut state, key, m) {
                kept.push(e);
            }
        }
        if !kept.is_empty() {
            state.by_key.insert(key.to_string(), kept);
        }
    }

    /// Removes `key`'s members.
    pub fn delete(&self, key: &str) {
        self.set(key, Vec::new());
    }

    /// Makes the whole pool exactly `listing` (key → members).
    pub fn reconcile(&self, listing: HashMap<String, Vec<Member>>) {
        let gone: Vec<String> = {
            let state = self.state.lock().expect("pool");
            state
                .by_key
                .keys()
                .filter(|k| !listing.contains_key(*k))
                .cloned()
                .collect()
        };
        for k in gone {
            self.delete(&k);
        }
        for (k, members) in listing {
            self.set(&k, members);
        }
    }

    /// The destination (`ip:port`) of worker `id`.
    pub fn destination(&self, id: WorkerId) -> Option<String> {
        self.state
            .lock()
            .expect("pool")
            .destinations
            .get(&id)
            .cloned()
    }

    /// Every member as `(worker id, destination)`, by id.
    pub fn destinations(&self) -> Vec<(WorkerId, String)> {
        let state = self.state.lock().expect("pool");
        state
            .destinations
            .iter()
            .map(|(id, d)| (*id, d.clone()))
            .collect()
    }

    /// The shared placement state.
    pub fn cluster(&self) -> &Arc<Cluster> {
        &self.cluster
    }

    fn add_entry(&self, state: &mut State, key: &str, member: Member) -> Option<Entry> {
        let id = WorkerId(state.next_id);
        state.next_id += 1;
        let endpoint = match &member.backend {
            Backend::Cleave { grpc } => grpc.clone(),
            Backend::Metrics { .. } => format!("http://{}", member.destination),
        };
        if let Err(e) = self.cluster.add(id, Role::Decode, &endpoint) {
            tracing::warn!(%key, %endpoint, error = %e, "bad pool member endpoint");
            return None;
        }
        let stop = self.shutdown.child_token();
        match &member.backend {
            Backend::Cleave { .. } => {
                self.cluster
                    .spawn(crate::watch::follow(self.cluster.clone(), id, stop.clone()));
            }
            Backend::Metrics { url } => {
                self.cluster.spawn(scrape::follow(
                    self.cluster.clone(),
                    id,
                    url.clone(),
                    self.scrape.clone(),
                    self.prompts.clone(),
                    stop.clone(),
                ));
            }
        }
        tracing::info!(worker = %id, %key, destination = %member.destination, backend = ?member.backend, "pool member added");
        state.destinations.insert(id, member.destination.clone());
        Some(Entry { id, member, stop })
    }

    fn drop_entry(&self, state: &mut State, key: &str, e: Entry) {
        tracing::info!(worker = %e.id, %key, destination = %e.member.destination, "pool member gone");
        e.stop.cancel();
        state.destinations.remove(&e.id);
        self.cluster.remove(e.id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn metrics(dest: &str) -> Member {
        Member {
            destination: dest.into(),
            backend: Backend::Metrics {
                url: format!("http://{dest}/metrics"),
            },
        }
    }

    #[tokio::test]
    async fn members_follow_set_delete_and_reconcile() {
        let cluster = Arc::new(Cluster::default());
        let pool = Pool::new(
            cluster.clone(),
            ScrapeConfig {
                interval: Duration::from_secs(3600),
                kv_capacity_blocks: 100,
            },
            Arc::default(),
            CancellationToken::new(),
        );
        let dests = |p: &Pool| -> Vec<String> {
            let mut d: Vec<String> = p.destinations().into_iter().map(|(_, d)| d).collect();
            d.sort();
            d
        };
        pool.set(
            "a",
            vec![metrics("10.0.0.1:8000"), metrics("10.0.0.1:8001")],
        );
        pool.set("b", vec![metrics("10.0.0.2:8000")]);
        assert_eq!(
            dests(&pool),
            ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000"]
        );
        assert_eq!(cluster.all().len(), 3);
        let id_a0 = pool.destinations()[0].0;
        // Unchanged members keep their id; a dropped port goes away.
        pool.set("a", vec![metrics("10.0.0.1:8000")]);
        assert_eq!(pool.destinations()[0].0, id_a0);
        assert_eq!(dests(&pool), ["10.0.0.1:8000", "10.0.0.2:8000"]);
        pool.reconcile([("b".to_string(), vec![metrics("10.0.0.2:9000")])].into());
        assert_eq!(dests(&pool), ["10.0.0.2:9000"]);
        assert_eq!(cluster.all().len(), 1);
        assert_eq!(pool.destination(id_a0), None);
        pool.delete("b");
        assert!(pool.destinations().is_empty());
        assert!(cluster.all().is_empty());
    }
}
