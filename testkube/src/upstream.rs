//! CRDs of other projects, vendored unmodified in `crds/upstream/`, installed for a test.

use std::time::{Duration, Instant};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, PostParams};
use kube::Client;
use serde_json::Value;

/// The Gateway API Inference Extension's InferencePool CRD (`inference.networking.k8s.io/v1`).
pub const INFERENCE_POOL_CRD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../crds/upstream/inference.networking.k8s.io_inferencepools.yaml"
);

/// Installs the vendored CRD at `path` (cluster-scoped; left installed for later runs) and
/// waits until it is Established. Servers before 1.25 know no CEL, and 1.20 rejects
/// empty-string schema defaults (it reads them as null): for those both are left out, and only
/// there. Panics with the reason when the server refuses it.
pub async fn install_crd(client: &Client, path: &str) {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let mut crd: Value =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path} is no YAML: {e}"));
    let version = client
        .apiserver_version()
        .await
        .expect("the server version");
    let minor: u32 = version.minor.trim_end_matches('+').parse().unwrap_or(0);
    if version.major == "1" && minor < 25 {
        strip_for_old_servers(&mut crd);
        eprintln!("Kubernetes 1.{minor}: CEL rules and empty-string defaults left out of {path}");
    }
    let crd: CustomResourceDefinition =
        serde_json::from_value(crd).unwrap_or_else(|e| panic!("{path} is no CRD: {e}"));
    let name = crd.metadata.name.clone().expect("a named CRD");
    let crds = Api::<CustomResourceDefinition>::all(client.clone());
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("creating the CRD {name}: {e}"),
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = crds.get(&name).await.expect("the CRD");
        let established = got
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
            });
        if established {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the CRD {name} never became Established"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn strip_for_old_servers(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.remove("x-kubernetes-validations");
            if m.get("default") == Some(&Value::String(String::new())) {
                m.remove("default");
            }
            m.values_mut().for_each(strip_for_old_servers);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_for_old_servers),
        _ => {}
    }
}
