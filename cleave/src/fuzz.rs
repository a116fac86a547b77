//! `cleave fuzz`: random and mutated inputs against the parsers that face the outside, in
//! process, with the real code behind each one.
//!
//! Targets (one file each under `fuzz/`):
//! - `api`: OpenAI request bodies (valid bodies mutated as JSON and as bytes, wrong shapes,
//!   edge numbers, deep nesting, invalid UTF-8, 10 MB bodies) through the router's real HTTP
//!   layer (tokenizer, chat template, validation, SSE) over a backend that streams canned
//!   tokens, or over HTTP to a running endpoint (`--url`);
//! - `grpc`: `Generate` and `Prefill` messages, generated and byte-mutated, sent raw to a real
//!   decode worker and a real prefill worker serving a tiny random-weight model;
//! - `kv-wire`: the KV transport's TCP frames sent raw to a real transport's listener, plus
//!   region descriptors and write plans as a peer would send them;
//! - `gguf`: mutated GGUF files through the parser, `model inspect` and the model loader;
//! - `chat`: random conversations and tool lists through every chat template available.
//!
//! What counts as a failure: a panic, a hang (a case that does not finish within its
//! timeout), a 5xx other than 503/504 or an error body that is not OpenAI's shape, a gRPC
//! `INTERNAL`/`UNKNOWN` status or a stream that ends without its last event, a server that is
//! unhealthy or holds KV blocks after the campaign. Each case draws from its own generator
//! seeded by `(seed, case)`, so `--seed S --start N --iterations 1` replays case N alone.
//!
//! The generators are written here rather than taken from a fuzzing framework: libFuzzer
//! (`cargo fuzz`) needs a nightly toolchain and a separate build per target, while these must
//! run on stable inside the test command and against servers in the same process.

pub mod api;
pub mod chat;
pub mod gguf;
pub mod grpc;
pub mod kv_wire;
pub mod mutate;

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Flags of `cleave fuzz`.
#[derive(Debug, Clone, Args)]
pub struct FuzzArgs {
    /// What to fuzz.
    #[arg(long, value_enum, default_value = "all")]
    pub target: Target,
    /// Seed of the campaign; each case's generator is derived from it and the case number.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Cases per target (0: until interrupted).
    #[arg(long, default_value_t = 10_000)]
    pub iterations: u64,
    /// The first case number (to replay one case: `--start N --iterations 1`).
    #[arg(long, default_value_t = 0)]
    pub start: u64,
    /// `api` only: send the bodies over HTTP to this running endpoint (e.g.
    /// `http://127.0.0.1:8000`) instead of the in-process router.
    #[arg(long)]
    pub url: Option<String>,
    /// The model whose tokenizer and chat template the in-process router uses; default: the
    /// cached default model.
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,
}

/// A fuzz target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    /// Every target below, one after the other.
    All,
    /// OpenAI HTTP request bodies.
    Api,
    /// Worker gRPC messages.
    Grpc,
    /// KV transport frames and descriptors.
    KvWire,
    /// GGUF files.
    Gguf,
    /// Chat template input.
    Chat,
}

/// Which cases to run: `start..start + iterations` (unbounded when `iterations` is 0).
#[derive(Debug, Clone, Copy)]
pub struct Cases {
    /// Campaign seed.
    pub seed: u64,
    /// First case.
    pub start: u64,
    /// How many (0: unbounded).
    pub iterations: u64,
}

impl Cases {
    /// The case numbers to run.
    pub fn range(&self) -> std::ops::Range<u64> {
        let end = match self.iterations {
            0 => u64::MAX,
            n => self.start.saturating_add(n),
        };
        self.start..end
    }

    /// The generator of case `case`.
    pub fn rng(&self, case: u64) -> StdRng {
        StdRng::seed_from_u64(self.seed ^ case.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

/// What one target's campaign did.
#[derive(Debug)]
pub struct Tally {
    /// The target's name.
    pub target: &'static str,
    /// Cases run.
    pub cases: u64,
    /// Cases by outcome (HTTP status, gRPC code, parse error kind...).
    pub outcomes: BTreeMap<String, u64>,
    /// Failed cases (all of them are counted; the first few are described).
    pub failed: u64,
    /// Descriptions of the first failures, with their case numbers.
    pub failures: Vec<String>,
    started: Instant,
    /// Wall time of the campaign.
    pub elapsed: Duration,
}

/// Failures described in full; later ones are only counted.
const DESCRIBED: usize = 20;

impl Tally {
    /// An empty tally for `target`.
    pub fn new(target: &'static str) -> Self {
        Tally {
            target,
            cases: 0,
            outcomes: BTreeMap::new(),
            failed: 0,
            failures: Vec::new(),
            started: Instant::now(),
            elapsed: Duration::ZERO,
        }
    }

    /// Counts a case that ended acceptably.
    pub fn ok(&mut self, outcome: impl Into<String>) {
        self.cases += 1;
        *self.outcomes.entry(outcome.into()).or_default() += 1;
        self.elapsed = self.started.elapsed();
    }

    /// Counts a failed case and describes it (input shortened).
    pub fn fail(&mut self, case: u64, what: impl fmt::Display) {
        self.cases += 1;
        self.failed += 1;
        *self.outcomes.entry("FAILED".into()).or_default() += 1;
        if self.failures.len() < DESCRIBED {
            let text = what.to_string();
            let short: String = text.chars().take(600).collect();
            let more = if short.len() < text.len() { " …" } else { "" };
            self.failures.push(format!("case {case}: {short}{more}"));
        }
        self.elapsed = self.started.elapsed();
    }

    /// A failure that is no single case's (the server after the campaign).
    pub fn fail_after(&mut self, what: impl fmt::Display) {
        self.failed += 1;
        if self.failures.len() < DESCRIBED {
            self.failures.push(format!("after the campaign: {what}"));
        }
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        writeln!(
            f,
            "{}: {} cases in {:.1} s ({:.0}/s), {} failed",
            self.target,
            self.cases,
            secs,
            self.cases as f64 / secs,
            self.failed
        )?;
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        writeln!(f, "  outcomes: {}", outcomes.join(", "))?;
        for line in &self.failures {
            writeln!(f, "  {line}")?;
        }
        Ok(())
    }
}

/// Where `scripts/llama-vocab` puts llama.cpp's reference files (vocabulary GGUFs, and chat
/// templates in `templates/`): `$CLEAVE_LLAMA_VOCAB_DIR`, else `~/.cache/cleave/llama-vocab`.
// Where a script put reference files: a tool's location, not a serving setting.
#[allow(clippy::disallowed_methods)]
pub fn llama_vocab_dir() -> std::path::PathBuf {
    match std::env::var_os("CLEAVE_LLAMA_VOCAB_DIR") {
        Some(d) => d.into(),
        None => std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/cleave/llama-vocab"),
    }
}

/// Runs `f`, turning a panic into its message.
pub fn unwound<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// Runs `cleave fuzz`: each chosen target in turn; fails when any case failed.
pub fn fuzz(args: FuzzArgs) -> anyhow::Result<()> {
    let cases = Cases {
        seed: args.seed,
        start: args.start,
        iterations: args.iterations,
    };
    let targets = match args.target {
        Target::All => vec![
            Target::Api,
            Target::Grpc,
            Target::KvWire,
            Target::Gguf,
            Target::Chat,
        ],
        t => vec![t],
    };
    let mut failed = 0;
    for target in targets {
        let tally = run_target(target, cases, &args)?;
        print!("{tally}");
        failed += tally.failed;
    }
    anyhow::ensure!(failed == 0, "{failed} fuzz cases failed");
    Ok(())
}

/// One target's campaign.
pub fn run_target(target: Target, cases: Cases, args: &FuzzArgs) -> anyhow::Result<Tally> {
    let model = args
        .model
        .clone()
        .unwrap_or_else(cleave_text::gguf::default_model_path);
    match target {
        Target::Api => match &args.url {
            Some(url) => api::fuzz_url(url, cases),
            None => api::fuzz_in_process(&model, cases),
        },
        Target::Grpc => grpc::fuzz(cases),
        Target::KvWire => kv_wire::fuzz(cases),
        Target::Gguf => gguf::fuzz(cases),
        Target::Chat => chat::fuzz(&model, cases),
        Target::All => unreachable!("expanded by the caller"),
    }
}
