//! Helpers for cleave's tests against a real Kubernetes API server.
//!
//! Cluster tests read `KUBECONFIG` (scripts/kube-cluster writes one; any other cluster works
//! too). Without it they skip, printing why, unless `CLEAVE_REQUIRE_CLUSTER=1` (set by
//! scripts/test), where they fail: CI must not pass by skipping them.
//!
//! ```no_run
//! # async fn t() {
//! let Some(client) = cleave_testkube::client("my_test").await else { return };
//! let ns = cleave_testkube::TestNamespace::create(&client, "my-test").await;
//! // ... objects in ns.name ...
//! ns.delete().await;
//! # }
//! ```

#![forbid(unsafe_code)]
// A test helper: it reads the test environment (KUBECONFIG, CLEAVE_REQUIRE_CLUSTER).
#![allow(clippy::disallowed_methods)]

pub mod upstream;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, PostParams};
use kube::Client;

/// Set to `1` where cluster tests must run (CI).
pub const REQUIRE_ENV: &str = "CLEAVE_REQUIRE_CLUSTER";

/// Whether cluster tests must run rather than skip.
pub fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1")
}

/// A client for the cluster `KUBECONFIG` names; `None` (after printing why) when there is
/// none and the cluster is not required. Panics with a clear message when it is required but
/// missing or unreachable.
pub async fn client(test: &str) -> Option<Client> {
    let kubeconfig = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty());
    let Some(path) = kubeconfig else {
        if required() {
            panic!(
                "{test}: KUBECONFIG is not set but {REQUIRE_ENV}=1: start a cluster with \
                 `scripts/kube-cluster start DIR` and `. DIR/env` (see docs/kubernetes-testing.md)"
            );
        }
        eprintln!("skipping {test}: KUBECONFIG is not set (see docs/kubernetes-testing.md)");
        return None;
    };
    let path = std::path::PathBuf::from(path);
    let client = async {
        let config = kube::Config::from_kubeconfig(&kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| e.to_string())?;
        let client = Client::try_from(config).map_err(|e| e.to_string())?;
        client
            .apiserver_version()
            .await
            .map_err(|e| format!("the API server does not answer: {e}"))?;
        Ok::<_, String>(client)
    }
    .await;
    match client {
        Ok(c) => Some(c),
        Err(e) => panic!("{test}: the cluster of KUBECONFIG={}: {e}", path.display()),
    }
}

/// A namespace of its own for one test; [`TestNamespace::delete`] removes it (and what is in
/// it). A namespace left behind by a failed test is deleted on drop from a helper thread.
pub struct TestNamespace {
    /// Its name (`<prefix>-<unique suffix>`).
    pub name: String,
    client: Client,
    deleted: bool,
}

impl TestNamespace {
    /// Creates `<prefix>-<unique suffix>`; panics when the API server refuses.
    pub async fn create(client: &Client, prefix: &str) -> TestNamespace {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            "{}-{:x}-{:x}{}",
            prefix.to_lowercase(),
            std::process::id(),
            nanos & 0xffff,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"cleave.dev/test": "true"}}
        }))
        .expect("a namespace object");
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("creating test namespace {name}: {e}"));
        TestNamespace {
            name,
            client: client.clone(),
            deleted: false,
        }
    }

    /// Deletes the namespace (the namespace controller removes its objects afterwards).
    pub async fn delete(mut self) {
        self.deleted = true;
        delete_namespace(self.client.clone(), &self.name).await;
    }
}

async fn delete_namespace(client: Client, name: &str) {
    let api = Api::<Namespace>::all(client);
    if let Err(e) = api.delete(name, &DeleteParams::background()).await {
        eprintln!("deleting test namespace {name}: {e}");
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if self.deleted {
            return;
        }
        // The test's runtime may be the one being dropped: use a fresh client on a thread.
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    if let Ok(client) = Client::try_default().await {
                        delete_namespace(client, &name).await;
                    }
                });
            }
        })
        .join();
    }
}
