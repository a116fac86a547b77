//! `cleave bench compare` against real `cleave up` fleets (the default model): each
//! configuration's resources are read from its running processes and metrics, and ratios are
//! withheld for a configuration whose compute differs from the baseline's.

use std::process::Command;

#[test]
fn compare_states_measured_resources_and_withholds_ratios_across_unequal_compute() {
    let model = cleave_text::gguf::default_model_path();
    assert!(
        model.exists(),
        "run `cleave model fetch` first (scripts/test does)"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_cleave"))
        .args([
            "bench",
            "compare",
            "--config",
            "two-threads=--prefill 0 --decode 1 --threads 2 --kv-blocks 64",
            "--config",
            "pd=--prefill 1 --decode 1 --kv-blocks 64",
            "--config",
            "one-thread=--prefill 0 --decode 1 --kv-blocks 64",
            "--requests",
            "2",
            "--concurrency",
            "2",
            "--input-len",
            "32",
            "--output-len",
            "4",
            "--warmup",
            "0",
            "--no-progress",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let resources: Vec<&str> = stdout
        .lines()
        .filter(|l| l.trim_start().starts_with("resources"))
        .collect();
    assert_eq!(resources.len(), 3, "{stdout}");
    // Measured, not just declared: the router and one decode worker with two matmul threads;
    // router + two single-thread workers; router + one single-thread worker.
    assert!(
        resources[0].contains("2 processes, 2 compute threads, 64 KV blocks (64 on decode"),
        "{}",
        resources[0]
    );
    assert!(
        resources[1].contains("3 processes, 2 compute threads, 128 KV blocks (64 on decode"),
        "{}",
        resources[1]
    );
    assert!(
        resources[2].contains("2 processes, 1 compute thread, 64 KV blocks"),
        "{}",
        resources[2]
    );
    for r in &resources {
        assert!(r.contains("measured: processes, threads and cores from /proc; KV blocks from the workers' /metrics"), "{r}");
    }
    // Loud about the unequal one, in the output and on stderr; its ratios are withheld, the
    // equal-compute configuration's are printed.
    assert!(stdout.contains("UNEQUAL COMPUTE"), "{stdout}");
    assert!(
        stdout.contains("one-thread: 1 compute threads vs 2"),
        "{stdout}"
    );
    assert!(stderr.contains("UNEQUAL COMPUTE"), "{stderr}");
    let ratios = stdout
        .split("== ratios against two-threads")
        .nth(1)
        .unwrap_or_else(|| panic!("no ratios section:\n{stdout}"));
    let pd_row = ratios
        .lines()
        .find(|l| l.starts_with("pd "))
        .unwrap_or_else(|| panic!("no ratio row for pd:\n{ratios}"));
    assert!(pd_row.contains('×'), "{pd_row}");
    let withheld = ratios
        .lines()
        .find(|l| l.starts_with("one-thread "))
        .unwrap_or_else(|| panic!("no row for one-thread:\n{ratios}"));
    assert!(
        withheld.contains("ratios withheld") && !withheld.contains('×'),
        "{withheld}"
    );

    // Bad configuration flags fail before anything starts, naming the configuration.
    let out = Command::new(env!("CARGO_BIN_EXE_cleave"))
        .args([
            "bench",
            "compare",
            "--config",
            "a=--prefill 0",
            "--config",
            "b=--prefil 1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--config b") && e.contains("--prefil"), "{e}");
}
