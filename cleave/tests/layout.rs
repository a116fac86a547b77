//! The workspace's test layout: each crate's integration tests are one binary
//! (`tests/integration.rs`, with `autotests = false`), so a file under `tests/` runs only when
//! that root declares it. This check fails on a file that would silently never be compiled.

use std::path::{Path, PathBuf};

/// The modules a crate's `tests/` folder holds: `NAME.rs` files and `NAME/mod.rs` folders.
fn test_modules(tests: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(tests)
        .unwrap_or_else(|e| panic!("{}: {e}", tests.display()))
        .filter_map(|e| {
            let path = e.ok()?.path();
            let stem = path.file_stem()?.to_str()?.to_owned();
            let module =
                path.extension().is_some_and(|x| x == "rs") || path.join("mod.rs").is_file();
            (module && stem != "integration").then_some(stem)
        })
        .collect();
    names.sort();
    names
}

fn crates_with_one_test_binary() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut crates: Vec<PathBuf> = std::fs::read_dir(&root)
        .expect("the workspace root")
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| p.join("tests/integration.rs").is_file())
        .collect();
    crates.sort();
    crates
}

#[test]
fn every_file_under_a_crates_tests_is_declared_in_its_integration_binary() {
    let crates = crates_with_one_test_binary();
    assert!(crates.len() >= 7, "found only {crates:?}");
    for krate in crates {
        let manifest = std::fs::read_to_string(krate.join("Cargo.toml")).expect("Cargo.toml");
        assert!(
            manifest.contains("autotests = false"),
            "{}: tests/integration.rs without `autotests = false` compiles each file twice",
            krate.display()
        );
        let root = std::fs::read_to_string(krate.join("tests/integration.rs")).expect("root");
        let declared: Vec<&str> = root
            .lines()
            .filter_map(|l| l.strip_prefix("mod ")?.strip_suffix(';'))
            .collect();
        for module in test_modules(&krate.join("tests")) {
            assert!(
                declared.contains(&module.as_str()),
                "{}/tests/{module}: not declared in tests/integration.rs, so it never runs",
                krate.display()
            );
        }
    }
}
