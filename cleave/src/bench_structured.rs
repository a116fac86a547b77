//! `cleave bench structured`: what constrained decoding costs. Decode inter-token latency
//! (p50/p99) and tok/s at 1 and 16 concurrent requests, unconstrained and with every request
//! carrying its own JSON schema, measured in the same run and interleaved; and how long a new
//! schema takes to compile (the time a request with a new schema waits before its first token).

use std::time::{Duration, Instant};

use clap::Args;
use cleave_engine::engine::{Engine, EngineConfig, GenerateRequest, SeqEvent};
use cleave_engine::load::Loaded;
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::constrain::{Constraint, LazyGrammars};
use cleave_text::sample::SamplingParams;
use serde_json::{json, Value};

use crate::ModelArgs;

/// Flags of `cleave bench structured`.
#[derive(Debug, Args)]
pub struct StructuredArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Concurrent requests per measurement.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub concurrency: Vec<usize>,
    /// Most tokens per request.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Repetitions (unconstrained and constrained alternate; all samples are pooled).
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Schemas compiled for the compile-time measurement.
    #[arg(long, default_value_t = 50)]
    pub compiles: usize,
}

/// A 20-property object schema whose property names carry `tag`, so that every request's
/// schema differs from the others'.
fn schema(tag: usize) -> Value {
    let mut props = serde_json::Map::new();
    for i in 0..20 {
        let p = match i % 4 {
            0 => json!({"type": "string", "maxLength": 12}),
            1 => json!({"type": "integer", "minimum": 0, "maximum": 9999}),
            2 => json!({"type": "boolean"}),
            _ => json!({"enum": ["low", "medium", "high"]}),
        };
        props.insert(format!("r{tag}_field_{i}"), p);
    }
    let names: Vec<&String> = props.keys().collect();
    json!({"type": "object", "properties": props, "required": names, "additionalProperties": false})
}

/// Token arrival times of one request.
type Times = Vec<Instant>;

/// Runs `n` requests together; returns each one's token arrival times and the wall time.
fn run(
    engine: &Engine,
    loaded: &Loaded,
    n: usize,
    gen: usize,
    constrained: bool,
    round: usize,
) -> anyhow::Result<(Vec<Times>, Duration)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let t0 = Instant::now();
    let mut rxs = Vec::with_capacity(n);
    for i in 0..n {
        let text = format!(
            "<|im_start|>user\nRequest {round}-{i}: describe item {i} as JSON.<|im_end|>\n<|im_start|>assistant\n"
        );
        let params = SamplingParams {
            max_tokens: gen,
            ignore_eos: !constrained,
            constraint: constrained.then(|| Constraint::JsonSchema {
                schema: schema(round * 1000 + i),
            }),
            ..Default::default()
        };
        let prompt = loaded.tokenizer.encode(&text, true);
        rxs.push(engine.submit(GenerateRequest::new(prompt, params))?.1);
    }
    let times = rt.block_on(async {
        let tasks: Vec<_> = rxs
            .into_iter()
            .map(|mut rx| {
                tokio::spawn(async move {
                    let mut t = Vec::new();
                    while let Some(ev) = rx.recv().await {
                        match ev {
                            SeqEvent::Token { .. } => t.push(Instant::now()),
                            SeqEvent::Done { .. } => break,
                            _ => {}
                        }
                    }
                    t
                })
            })
            .collect();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await?);
        }
        anyhow::Ok(out)
    })?;
    Ok((times, t0.elapsed()))
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Pooled samples of one (concurrency, constrained) cell.
#[derive(Default)]
struct Cell {
    itl_ms: Vec<f64>,
    tokens: usize,
    decode_s: f64,
}

impl Cell {
    fn add(&mut self, times: &[Times]) {
        // Decode: from the last first token to the last token of all.
        let start = times.iter().filter_map(|t| t.first()).max();
        let end = times.iter().filter_map(|t| t.last()).max();
        if let (Some(s), Some(e)) = (start, end) {
            self.decode_s += (*e - *s).as_secs_f64();
        }
        for t in times {
            self.tokens += t.len().saturating_sub(1);
            self.itl_ms
                .extend(t.windows(2).map(|w| (w[1] - w[0]).as_secs_f64() * 1e3));
        }
    }

    fn summary(&mut self) -> (f64, f64, f64) {
        self.itl_ms.sort_by(f64::total_cmp);
        (
            percentile(&self.itl_ms, 0.5),
            percentile(&self.itl_ms, 0.99),
            self.tokens as f64 / self.decode_s.max(1e-9),
        )
    }
}

/// Runs the benchmark and prints its table.
pub fn bench_structured(args: StructuredArgs) -> anyhow::Result<()> {
    let loaded = crate::load::load(&args.model)?;
    let max = args.concurrency.iter().copied().max().unwrap_or(1);
    let engine = Engine::start(
        loaded.model.clone(),
        loaded.tokenizer.clone(),
        EngineConfig {
            tiers: Default::default(),
            scheduler: SchedulerConfig {
                max_running: max.max(16),
                ..Default::default()
            },
            ..Default::default()
        },
    );
    // Compile time of a new 20-property schema, after the one-off vocabulary trie.
    let grammars = LazyGrammars::new(loaded.tokenizer.clone(), None);
    let t = Instant::now();
    grammars.get().map_err(anyhow::Error::msg)?;
    let trie_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut compile_ms: Vec<f64> = (0..args.compiles.max(1))
        .map(|i| {
            let c = Constraint::JsonSchema { schema: schema(i) };
            let t = Instant::now();
            let mut m = grammars.compile(&c).map_err(anyhow::Error::msg)?;
            // The first mask is part of what a new schema costs before its first token.
            m.take_mask().map_err(anyhow::Error::msg)?;
            Ok(t.elapsed().as_secs_f64() * 1e3)
        })
        .collect::<anyhow::Result<_>>()?;
    compile_ms.sort_by(f64::total_cmp);
    // Warm-up.
    run(&engine, &loaded, 1, 4, true, 0)?;
    println!(
        "threads {}  simd {}  {} tokens at most per request, greedy",
        args.model.threads,
        cleave_engine::kernels::simd_path(),
        args.gen_tokens
    );
    println!(
        "{:<14}{:<14}{:>12}{:>12}{:>10}{:>12}",
        "concurrency", "output", "ITL p50 ms", "ITL p99 ms", "tok/s", "p50 ratio"
    );
    for &n in &args.concurrency {
        let mut cells = [Cell::default(), Cell::default()];
        for r in 0..args.repeat.max(1) {
            for (k, constrained) in [false, true].into_iter().enumerate() {
                let (times, _) = run(&engine, &loaded, n, args.gen_tokens, constrained, r + 1)?;
                cells[k].add(&times);
            }
        }
        let free = cells[0].summary();
        let json = cells[1].summary();
        println!(
            "{n:<14}{:<14}{:>12.2}{:>12.2}{:>10.1}{:>12}",
            "free", free.0, free.1, free.2, "1.00x"
        );
        println!(
            "{n:<14}{:<14}{:>12.2}{:>12.2}{:>10.1}{:>11.2}x",
            "own schema",
            json.0,
            json.1,
            json.2,
            json.0 / free.0
        );
    }
    println!(
        "schema compile + first mask (20 properties): p50 {:.2} ms, p99 {:.2} ms over {}; vocabulary trie once per process: {trie_ms:.1} ms",
        percentile(&compile_ms, 0.5),
        percentile(&compile_ms, 0.99),
        compile_ms.len()
    );
    Ok(())
}
