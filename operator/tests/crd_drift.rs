//! `crds/` must hold exactly what the Rust types generate. Regenerate with
//! `CLEAVE_UPDATE_CRDS=1 cargo test -p cleave-operator --test integration crd_drift` (or
//! `cleave-operator crd > crds/inferenceservices.serving.cleave.dev.yaml`).

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use std::path::PathBuf;

fn crd_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../crds/inferenceservices.serving.cleave.dev.yaml")
}

#[test]
fn committed_crd_matches_the_types() {
    let generated = cleave_operator::crd::crd_yaml();
    let path = crd_file();
    if std::env::var("CLEAVE_UPDATE_CRDS").as_deref() == Ok("1") {
        std::fs::write(&path, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    assert!(
        committed == generated,
        "{} is out of date with operator/src/crd; regenerate it with CLEAVE_UPDATE_CRDS=1 cargo test -p cleave-operator --test integration crd_drift",
        path.display()
    );
}

#[test]
fn the_chart_ships_the_same_crd() {
    let chart = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/cleave/crds/inferenceservices.serving.cleave.dev.yaml");
    let generated = cleave_operator::crd::crd_yaml();
    if std::env::var("CLEAVE_UPDATE_CRDS").as_deref() == Ok("1") {
        std::fs::create_dir_all(chart.parent().unwrap()).unwrap();
        std::fs::write(&chart, &generated).unwrap();
    }
    let committed = std::fs::read_to_string(&chart)
        .unwrap_or_else(|e| panic!("reading {}: {e}", chart.display()));
    assert!(committed == generated, "{} is out of date", chart.display());
}
