//! Offline checks: the examples parse and validate, and the chart and everything the operator
//! renders pass `helm lint --strict` and Kubernetes 1.30 schemas (`kubernetes-validate --strict`).

use crate::common;

use std::process::Command;

use cleave_operator::render::{desired, fixed_groups, Inputs};
use cleave_operator::validate::validate;
use kube::Resource;

fn rendered_examples_yaml() -> String {
    let mut docs = Vec::new();
    for (file, mut isvc) in common::examples() {
        isvc.metadata.namespace = Some("default".into());
        isvc.metadata.uid = Some("00000000-0000-0000-0000-000000000001".into());
        for lws in [false, true] {
            let inputs = Inputs {
                default_image: "cleave:test".into(),
                fetch_image: "curl:test".into(),
                lws_available: lws,
                prefill_groups: fixed_groups(&isvc.spec.prefill),
                decode_groups: 2,
            };
            let d = desired(&isvc, &inputs).unwrap_or_else(|e| panic!("{file}: {e}"));
            let mut push = |v: serde_json::Value| docs.push(serde_yaml::to_string(&v).unwrap());
            macro_rules! all {
                ($v:expr) => {
                    for o in &$v {
                        let mut j = serde_json::to_value(o).unwrap();
                        j["apiVersion"] = serde_json::json!(api_version(o));
                        j["kind"] = serde_json::json!(kind(o));
                        push(j);
                    }
                };
            }
            fn api_version<K: Resource<DynamicType = ()>>(_: &K) -> String {
                K::api_version(&()).into_owned()
            }
            fn kind<K: Resource<DynamicType = ()>>(_: &K) -> String {
                K::kind(&()).into_owned()
            }
            all!(d.config_maps);
            all!(d.services);
            all!(d.deployments);
            all!(d.stateful_sets);
            all!(d.service_accounts);
            all!(d.roles);
            all!(d.role_bindings);
        }
    }
    docs.join("---\n")
}

#[test]
fn examples_are_valid_specs() {
    let examples = common::examples();
    assert!(examples.len() >= 3);
    for (file, isvc) in examples {
        let f = validate(&isvc.spec);
        assert!(f.errors.is_empty(), "{file}: {:?}", f.errors);
    }
}

#[test]
fn chart_lints_and_renders_valid_kubernetes_1_30_objects() {
    let Some(helm) = common::tool("helm", "chart check") else {
        return;
    };
    let chart = common::root().join("charts/cleave");
    common::run(Command::new(&helm).arg("lint").arg("--strict").arg(&chart));
    let rendered = common::run(
        Command::new(&helm)
            .args(["template", "t"])
            .arg(&chart)
            .args(["--include-crds", "--namespace", "cleave-system"])
            .args(["--set", "replicaCount=2"]),
    );
    assert!(rendered.contains("kind: ClusterRole"));
    assert!(rendered.contains("readOnlyRootFilesystem: true"));
    let dir = std::env::temp_dir().join(format!("cleave-chart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let chart_file = dir.join("chart.yaml");
    std::fs::write(&chart_file, rendered).unwrap();
    let objects_file = dir.join("rendered.yaml");
    std::fs::write(&objects_file, rendered_examples_yaml()).unwrap();
    let Some(validator) = common::tool("kubernetes-validate", "chart check") else {
        return;
    };
    let out = common::run(
        Command::new(validator)
            .args(["-k", "1.30.0", "--strict"])
            .arg(&chart_file)
            .arg(&objects_file),
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.contains("failed"), "{out}");
}
