//! The fixed-seed sample of `cleave fuzz` that CI runs: every target, a few thousand cases
//! (the campaigns in the README run 10^5-10^6). A failure prints the cases with their numbers;
//! `cleave fuzz --target T --seed 1 --start N --iterations 1` replays one.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use cleave::fuzz::{run_target, Cases, FuzzArgs, Target};
use cleave_text::gguf::default_model_path;

fn sample(target: Target, iterations: u64) {
    let needs_model = matches!(target, Target::Api | Target::Chat);
    if needs_model && !default_model_path().exists() {
        let msg = format!(
            "model {} missing (run `cleave model fetch`)",
            default_model_path().display()
        );
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED: {msg}");
        return;
    }
    let args = FuzzArgs {
        target,
        seed: 1,
        iterations,
        start: 0,
        url: None,
        model: None,
    };
    let cases = Cases {
        seed: args.seed,
        start: 0,
        iterations,
    };
    let tally = run_target(target, cases, &args).expect("the target starts");
    eprint!("{tally}");
    assert_eq!(tally.cases, iterations);
    assert_eq!(tally.failed, 0, "{tally}");
}

#[test]
fn api_bodies() {
    sample(Target::Api, 4_000);
}

#[test]
fn worker_grpc_messages() {
    sample(Target::Grpc, 400);
}

#[test]
fn kv_transport_frames() {
    sample(Target::KvWire, 3_000);
}

#[test]
fn gguf_files() {
    sample(Target::Gguf, 600);
}

#[test]
fn chat_template_input() {
    sample(Target::Chat, 4_000);
}
