//! Shared by the operator's integration tests.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps
#![allow(dead_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use cleave_operator::crd::{self, InferenceService};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use kube::{Client, ResourceExt};

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The example specs.
pub fn examples() -> Vec<(String, InferenceService)> {
    let mut out = Vec::new();
    let mut paths: Vec<_> = std::fs::read_dir(root().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    for p in paths {
        let text = std::fs::read_to_string(&p).unwrap();
        let isvc: InferenceService = serde_yaml::from_str(&text).unwrap_or_unwrap(&p);
        out.push((p.file_name().unwrap().to_string_lossy().into_owned(), isvc));
    }
    out
}

trait UnwrapOr<T> {
    fn unwrap_or_unwrap(self, p: &Path) -> T;
}
impl<T> UnwrapOr<T> for Result<T, serde_yaml::Error> {
    fn unwrap_or_unwrap(self, p: &Path) -> T {
        self.unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }
}

/// A tool from PATH or the kube cache (scripts/kube-cluster build puts kubectl and helm there);
/// `None` after printing why (a failure when CLEAVE_REQUIRE_CLUSTER=1).
pub fn tool(name: &str, test: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let cache = std::env::var_os("CLEAVE_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/cleave")));
    if let Some(bin) = cache.map(|c| c.join("kube/bin")) {
        if let Ok(rd) = std::fs::read_dir(&bin) {
            dirs.extend(rd.flatten().map(|e| e.path()));
        }
        dirs.push(bin);
    }
    if let Some(p) = dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file()) {
        return Some(p);
    }
    let why = format!(
        "{test}: {name} not found (PATH or the kube cache; run scripts/kube-cluster build)"
    );
    if std::env::var("CLEAVE_REQUIRE_CLUSTER").as_deref() == Ok("1") {
        panic!("{why}");
    }
    eprintln!("skipping {why}");
    None
}

/// Runs a command, panicking with its output when it fails; returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Polls `f` every 500 ms until it returns `Some`, for up to two minutes; panics naming `what`.
pub async fn eventually<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    for _ in 0..240 {
        if let Some(v) = f().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Installs (server-side applies) cleave's InferenceService CRD and waits until it is Established.
pub async fn install_crd(client: &Client) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crd::crd();
    api.patch(
        &crd.name_any(),
        &PatchParams::apply("cleave-operator-test").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("installing the CRD");
    eventually("the CRD to be established", || async {
        let c = api.get(&crd.name_any()).await.ok()?;
        let ok = c
            .status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        ok.then_some(())
    })
    .await;
}

/// Runs the operator's controller against `client` until the returned token is cancelled, with
/// the test images; the handle ends when it stops.
pub fn start_controller(
    client: &Client,
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    use cleave_operator::controller::{self, Ctx, Settings};
    let stop = tokio_util::sync::CancellationToken::new();
    let ctx = std::sync::Arc::new(Ctx::new(
        client.clone(),
        Settings {
            default_image: "cleave:cluster-test".into(),
            fetch_image: "curl:cluster-test".into(),
        },
        cleave_operator::metrics::OperatorMetrics::default(),
    ));
    let s = stop.clone();
    let running = tokio::spawn(controller::run(ctx, async move { s.cancelled().await }));
    (stop, running)
}
