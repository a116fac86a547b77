//! Workers from etcd: every key under the prefix (`<prefix><role>/<id>`, written by workers
//! under a lease) holds `{"role":"decode","endpoint":"http://host:port"}`. [`Etcd::connect`]
//! lists the prefix; [`Discovery::start`] adds those workers, then follows an etcd watch from
//! the listed revision (PUT adds or replaces, DELETE — a revoked or expired lease — removes)
//! and re-lists every [`Etcd::relist_every`] to reconcile what a watch may have missed across
//! reconnects.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use tokio_util::sync::CancellationToken;

use super::members::Members;
pub use super::members::Record;
use super::Discovery;
use crate::dispatch::Cluster;

/// Ids of etcd-discovered workers start here, above any static worker's.
pub const FIRST_ID: u64 = 1 << 32;

/// Why etcd discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// etcd could not be reached or refused a request.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// No endpoints were given.
    #[error("no etcd endpoints")]
    NoEndpoints,
}

/// Parses a key's value; `None` (logged) when it is not a worker record.
pub fn parse(key: &str, value: &[u8]) -> Option<Record> {
    match serde_json::from_slice::<Record>(value) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!(%key, error = %e, "ignoring an etcd key that is no worker record");
            None
        }
    }
}

pub use cleave_config::router::split_endpoints;

/// etcd discovery, connected and with the initial listing done.
pub struct Etcd {
    client: Client,
    prefix: String,
    /// How often the whole prefix is listed again.
    pub relist_every: Duration,
    listing: Vec<(String, Record)>,
    revision: i64,
}

impl Etcd {
    /// Connects to `endpoints` and lists `prefix`.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<Etcd, EtcdError> {
        if endpoints.is_empty() {
            return Err(EtcdError::NoEndpoints);
        }
        let mut client = Client::connect(endpoints, None).await?;
        let (listing, revision) = list(&mut client, prefix).await?;
        Ok(Etcd {
            client,
            prefix: prefix.to_string(),
            relist_every: Duration::from_secs(10),
            listing,
            revision,
        })
    }
}

async fn list(
    client: &mut Client,
    prefix: &str,
) -> Result<(Vec<(String, Record)>, i64), etcd_client::Error> {
    let r = client
        .get(prefix, Some(GetOptions::new().with_prefix()))
        .await?;
    let revision = r.header().map(|h| h.revision()).unwrap_or(0);
    let listing = r
        .kvs()
        .iter()
        .filter_map(|kv| {
            let key = String::from_utf8_lossy(kv.key()).into_owned();
            parse(&key, kv.value()).map(|rec| (key, rec))
        })
        .collect();
    Ok((listing, revision))
}

impl Discovery for Etcd {
    fn start(
        self: Box<Self>,
        cluster: Arc<Cluster>,
        shutdown: CancellationToken,
    ) -> Result<(), crate::dispatch::BadEndpoint> {
        let Etcd {
            client,
            prefix,
            relist_every,
            listing,
            revision,
        } = *self;
        let mut members = Members::new(cluster.clone(), shutdown, FIRST_ID);
        members.reconcile(listing);
        cluster.spawn(follow(client, prefix, relist_every, revision, members));
        Ok(())
    }
}

/// Watches from `revision + 1`; on a broken watch or every `relist_every`, lists again and
/// watches from the new revision.
async fn follow(
    mut client: Client,
    prefix: String,
    relist_every: Duration,
    mut revision: i64,
    mut members: Members,
) {
    let shutdown = members.shutdown.clone();
    let mut backoff = Duration::from_millis(200);
    loop {
        let opts = WatchOptions::new()
            .with_prefix()
            .with_start_revision(revision + 1);
        let watched = tokio::select! {
            _ = shutdown.cancelled() => return,
            w = client.watch(prefix.as_str(), Some(opts)) => w,
        };
        match watched {
            Ok((_watcher, mut stream)) => {
                backoff = Duration::from_millis(200);
                let relist = tokio::time::sleep(relist_every);
                tokio::pin!(relist);
                loop {
                    let msg = tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = &mut relist => break,
                        m = stream.message() => m,
                    };
                    let resp = match msg {
                        Ok(Some(r)) if !r.canceled() => r,
                        Ok(_) => {
                            tracing::warn!("etcd watch ended; listing again");
                            break;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "etcd watch broke; listing again");
                            break;
                        }
                    };
                    for ev in resp.events() {
                        let Some(kv) = ev.kv() else { continue };
                        let key = String::from_utf8_lossy(kv.key()).into_owned();
                        revision = revision.max(kv.mod_revision());
                        match ev.event_type() {
                            EventType::Put => {
                                if let Some(r) = parse(&key, kv.value()) {
                                    members.put(&key, r);
                                }
                            }
                            EventType::Delete => members.delete(&key),
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "etcd watch failed"),
        }
        // Re-list (also after a clean periodic break) and watch on from that revision.
        loop {
            let listed = tokio::select! {
                _ = shutdown.cancelled() => return,
                l = list(&mut client, &prefix) => l,
            };
            match listed {
                Ok((listing, rev)) => {
                    members.reconcile(listing);
                    revision = rev;
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "etcd listing failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::place::Role;
    use cleave_kv_index::WorkerId;

    #[test]
    fn record_format() {
        let r = parse(
            "/cleave/workers/decode/ab",
            br#"{"role":"decode","endpoint":"http://10.0.0.1:50051"}"#,
        )
        .unwrap();
        assert_eq!(r.role, Role::Decode);
        assert_eq!(r.endpoint, "http://10.0.0.1:50051");
        let p = parse("k", br#"{"role":"prefill","endpoint":"http://h:1"}"#).unwrap();
        assert_eq!(p.role, Role::Prefill);
        assert!(parse("k", b"not json").is_none());
        assert!(parse("k", br#"{"role":"nope","endpoint":"x"}"#).is_none());
        assert_eq!(
            split_endpoints(" http://a:2379, http://b:2379 ,"),
            vec!["http://a:2379", "http://b:2379"]
        );
    }

    #[tokio::test]
    async fn reconcile_adds_replaces_and_removes() {
        let cluster = Arc::new(Cluster::default());
        let mut m = Members::new(cluster.clone(), CancellationToken::new(), FIRST_ID);
        let rec = |e: &str| Record {
            role: Role::Decode,
            endpoint: e.into(),
        };
        m.reconcile(vec![
            ("a".into(), rec("http://127.0.0.1:1")),
            ("b".into(), rec("http://127.0.0.1:2")),
        ]);
        assert_eq!(cluster.all().len(), 2);
        m.put("a", rec("http://127.0.0.1:1"));
        assert!(
            cluster.get(WorkerId(FIRST_ID)).is_some(),
            "same record kept"
        );
        m.put("a", rec("http://127.0.0.1:3"));
        assert!(
            cluster.get(WorkerId(FIRST_ID)).is_none(),
            "changed one replaced"
        );
        m.reconcile(vec![("b".into(), rec("http://127.0.0.1:2"))]);
        let all = cluster.all();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].endpoint, "http://127.0.0.1:2");
        m.delete("b");
        assert!(cluster.all().is_empty());
        m.shutdown.cancel();
    }
}
