//! `cleave bench engine`: prefill and decode throughput of the engine at several batch sizes,
//! peak RSS, and — when `llama-cpp-python` is installed — llama.cpp on the same file, prompt and
//! thread count, measured in the same run so the ratios mean something on a noisy machine.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use cleave_engine::engine::{Engine, EngineConfig, GenerateRequest, SeqEvent};
use cleave_engine::load::Loaded;
use cleave_engine::schedule::SchedulerConfig;
use cleave_text::sample::SamplingParams;
use serde::Serialize;

use crate::ModelArgs;

mod context;
use context::ContextRow;

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Tokens generated per sequence in the decode measurements.
    #[arg(long, default_value_t = 64)]
    pub gen_tokens: usize,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    pub batches: Vec<usize>,
    /// Repetitions of each measurement (the best is reported).
    #[arg(long, default_value_t = 2)]
    pub repeat: usize,
    /// Prompt lengths at which to measure prefill speed and the decode inter-token latency that
    /// follows (batch 1), e.g. `512,8192,32768`; none by default.
    #[arg(long, value_delimiter = ',')]
    pub context: Vec<usize>,
    /// KV cache element type (llama.cpp is measured with the same type: `-ctk/-ctv`).
    #[arg(long, value_enum, default_value = "f16")]
    pub kv_dtype: cleave_types::choices::KvDtype,
    /// Skip llama.cpp even if llama-cpp-python is installed.
    #[arg(long)]
    pub no_llama_cpp: bool,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    threads: usize,
    simd: &'static str,
    prompt_tokens: usize,
    gen_tokens: usize,
    prefill_tok_s: f64,
    decode_tok_s: Vec<(usize, f64)>,
    contexts: Vec<ContextRow>,
    kv_dtype: &'static str,
    /// KV pool reserved for the runs (MiB).
    kv_pool_mib: f64,
    /// The model file's size (MiB).
    file_mib: f64,
    /// Weight bytes a decode step reads per token.
    weight_bytes_per_token: u64,
    /// This machine's read bandwidth with the run's threads (GB/s), measured in the run.
    read_gb_s: f64,
    /// Multiply-adds of a prefill token's matrix work (none for an MoE file).
    matmul_macs_per_token: Option<u64>,
    /// The int8 dot-product rate of the run's threads on the backend's own instructions
    /// (GMAC/s), measured in the run; none on the scalar backend.
    int8_peak_gmacs: Option<f64>,
    /// The instructions of that measurement.
    int8_peak_instructions: Option<&'static str>,
    peak_rss_mib: f64,
    llama_cpp: Option<LlamaCpp>,
    /// Why llama.cpp was not measured, when it was not.
    llama_cpp_missing: Option<String>,
}

#[derive(Debug, Serialize, serde::Deserialize)]
struct LlamaCpp {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    #[serde(default)]
    contexts: Vec<ContextRow>,
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog while the committee debates the \
    budget for next year's infrastructure, weighing the cost of new servers against the \
    expected growth in traffic and the price of electricity in each region. ";

fn prompt(loaded: &Loaded, tag: usize, len: usize) -> Vec<u32> {
    let mut ids = loaded.tokenizer.encode(&format!("Request {tag}: "), false);
    let body = loaded.tokenizer.encode(&TEXT.repeat(len / 20 + 2), false);
    ids.extend(body);
    ids.truncate(len);
    ids
}

/// An engine with a pool of `blocks` KV blocks of `kv_dtype`.
fn engine(loaded: &Loaded, kv_dtype: cleave_types::choices::KvDtype, blocks: usize) -> Engine {
    let config = EngineConfig {
        tiers: Default::default(),
        num_blocks: blocks,
        kv_dtype,
        scheduler: SchedulerConfig {
            prefix_caching: false,
            step_tokens: 512,
            ..Default::default()
        },
        ..Default::default()
    };
    Engine::start(loaded.model.clone(), loaded.tokenizer.clone(), config)
}

/// Runs `prompts` together; returns (time to the last first token, time of the rest, tokens
/// generated after every sequence had its first token).
fn run_batch(
    engine: &Engine,
    prompts: Vec<Vec<u32>>,
    gen: usize,
) -> anyhow::Result<(Duration, Duration, usize)> {
    let params = SamplingParams {
        max_tokens: gen,
        ignore_eos: true,
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let t0 = Instant::now();
    let mut rxs = Vec::new();
    for p in prompts {
        rxs.push(engine.submit(GenerateRequest::new(p, params.clone()))?.1);
    }
    rt.block_on(async {
        let mut counts = vec![0usize; rxs.len()];
        // First tokens.
        for (i, rx) in rxs.iter_mut().enumerate() {
            match rx.recv().await {
                Some(SeqEvent::Token { .. }) => counts[i] += 1,
                other => anyhow::bail!("unexpected event {other:?}"),
            }
        }
        let t1 = Instant::now();
        let mut after = 0;
        for rx in rxs.iter_mut() {
            while let Some(ev) = rx.recv().await {
                match ev {
                    SeqEvent::Token { .. } => after += 1,
                    SeqEvent::Done { .. } => break,
                    _ => {}
                }
            }
        }
        Ok((t1 - t0, t1.elapsed(), after))
    })
}

fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(f64::NAN)
}

const LLAMA_CPP_SCRIPT: &str = r#"
import json, sys, time
import llama_cpp, numpy as np
from llama_cpp import Llama
path, threads, gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
data = json.loads(sys.stdin.read())
prompt, contexts = data["prompt"], data["contexts"]
n_ctx = max([2048] + [len(c) + gen + 64 for c in contexts])
# Flash attention on, as llama.cpp is usually run (and as it needs for a quantized V cache); the
# KV cache in the ggml type cleave is measured with.
kv = int(sys.argv[5])
llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
            n_ubatch=512, flash_attn=True, type_k=kv, type_v=kv, verbose=False)
def greedy():
    # The last token's logits (Llama.scores holds only n_batch rows without logits_all).
    p = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return int(np.ctypeslib.as_array(p, shape=(llm.n_vocab(),)).argmax())
def run(p, n):
    llm.reset()
    t = time.perf_counter(); llm.eval(p); prefill = len(p) / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(n):
        llm.eval([greedy()])
    return prefill, (time.perf_counter() - t) / n
best_p, best_d = 0.0, 0.0
for _ in range(int(sys.argv[4])):
    best_p = max(best_p, run(prompt, 1)[0])
    best_d = max(best_d, 1.0 / run(prompt[:16], gen)[1])
rows = []
for c in contexts:
    p_best, itl_best = 0.0, float("inf")
    for _ in range(int(sys.argv[4])):
        p, itl = run(c, max(gen, 2))
        p_best, itl_best = max(p_best, p), min(itl_best, itl)
    rows.append({"context": len(c), "prefill_tok_s": p_best, "itl_ms": itl_best * 1e3})
print(json.dumps({"prefill_tok_s": best_p, "decode_tok_s": best_d, "contexts": rows}))
"#;

/// llama.cpp's numbers on the same file, or why there are none (said in the report: a missing
/// baseline never disappears silently).
fn llama_cpp(
    path: &str,
    threads: usize,
    prompt: &[u32],
    contexts: &[Vec<u32>],
    gen: usize,
    repeat: usize,
    kv: cleave_types::choices::KvDtype,
) -> Result<LlamaCpp, String> {
    use cleave_types::choices::KvDtype;
    // ggml's type ids.
    let ggml_type = match kv {
        KvDtype::F32 => 0,
        KvDtype::F16 => 1,
        KvDtype::Q8_0 => 8,
    };
    let probe = Command::new("python3")
        .args(["-c", "import llama_cpp"])
        .output()
        .map_err(|e| format!("python3 could not be started: {e}"))?;
    if !probe.status.success() {
        return Err(match crashed(&probe.status) {
            Some(why) => format!("importing llama_cpp {why}"),
            None => "llama-cpp-python is not installed (pip install llama-cpp-python, built as \
                     docs/engine.md says)"
                .into(),
        });
    }
    let mut child = Command::new("python3")
        .args([
            "-c",
            LLAMA_CPP_SCRIPT,
            path,
            &threads.to_string(),
            &gen.to_string(),
            &repeat.to_string(),
            &ggml_type.to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("python3 could not be started: {e}"))?;
    use std::io::Write;
    let input = serde_json::json!({ "prompt": prompt, "contexts": contexts }).to_string();
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(input.as_bytes())
            .map_err(|e| format!("writing the prompt to llama-cpp-python: {e}"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for llama-cpp-python: {e}"))?;
    if let Some(why) = crashed(&out.status) {
        return Err(format!("llama.cpp {why}"));
    }
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().last().unwrap_or("no message");
        return Err(format!("llama-cpp-python failed ({}): {last}", out.status));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("llama-cpp-python printed no result ({e})"))
}

/// Why a process died of a signal, with the likely cause for the CPU-feature signals.
fn crashed(status: &std::process::ExitStatus) -> Option<String> {
    use std::os::unix::process::ExitStatusExt;
    let sig = status.signal()?;
    let name = match sig {
        4 => "SIGILL",
        11 => "SIGSEGV",
        6 => "SIGABRT",
        9 => "SIGKILL",
        _ => "a signal",
    };
    let hint = if sig == 4 || sig == 11 {
        ": a native (-march=native) build uses instructions this machine advertises but does not \
         allow (AMX in VMs); rebuild llama.cpp with GGML_NATIVE=OFF and AMX off (docs/engine.md)"
    } else {
        ""
    };
    Some(format!("crashed with {name} ({sig}){hint}"))
}

pub fn bench_engine(args: BenchArgs) -> anyhow::Result<()> {
    let path = match &args.model.model {
        Some(p) => p.clone(),
        None => crate::fetch::fetch_default_model(false)?,
    };
    let margs = ModelArgs {
        model: Some(path.clone()),
        threads: args.model.threads,
    };
    let loaded = crate::load::load(&margs)?;
    // The pool holds what the runs need, as llama.cpp's is sized by its context: the longest
    // prompt, or every batch's sequences, whichever is more.
    let bs = cleave_engine::kv::DEFAULT_BLOCK_SIZE;
    let per_seq = |len: usize| (len + args.gen_tokens + 2).div_ceil(bs) + 1;
    let longest = args.context.iter().copied().max().unwrap_or(0);
    let batch = args.batches.iter().copied().max().unwrap_or(1);
    let blocks = per_seq(longest.max(args.prompt_tokens)).max(batch * per_seq(16));
    let layout = loaded.model.kv_layout(bs, args.kv_dtype);
    layout.check()?;
    let block_bytes = layout.block_bytes();
    let engine = engine(&loaded, args.kv_dtype, blocks);
    let p = prompt(&loaded, 0, args.prompt_tokens);
    let repeat = args.repeat.max(1);
    // Warm-up (page in the weights, size the buffers).
    run_batch(&engine, vec![p.clone()], 2)?;
    let mut prefill = 0.0f64;
    for _ in 0..repeat {
        let (ttft, _, _) = run_batch(&engine, vec![p.clone()], 1)?;
        prefill = prefill.max(p.len() as f64 / ttft.as_secs_f64());
    }
    let mut decode = Vec::new();
    for &b in &args.batches {
        let mut best = 0.0f64;
        for r in 0..repeat {
            let prompts = (0..b)
                .map(|i| prompt(&loaded, 1000 * r + i + 1, 16))
                .collect();
            let (_, t, n) = run_batch(&engine, prompts, args.gen_tokens)?;
            best = best.max(n as f64 / t.as_secs_f64());
        }
        decode.push((b, best));
    }
    let contexts = context::measure(&engine, &loaded, &args.context, args.gen_tokens, repeat)?;
    // The engine publishes its stats after the step that finished the last request.
    let mut stats = engine.stats();
    for _ in 0..200 {
        if stats.running == 0 && stats.waiting == 0 {
            break;
        }
        // A benchmark waiting for the engine to drain between measurements.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(Duration::from_millis(5));
        stats = engine.stats();
    }
    anyhow::ensure!(stats.pool.used == 0, "KV blocks leaked: {:?}", stats.pool);
    let llama = if args.no_llama_cpp {
        Err("--no-llama-cpp".to_string())
    } else {
        llama_cpp(
            path.to_str().context("model path is not UTF-8")?,
            args.model.threads,
            &p,
            &args
                .context
                .iter()
                .map(|&len| prompt(&loaded, 7, len))
                .collect::<Vec<_>>(),
            args.gen_tokens,
            repeat,
            args.kv_dtype,
        )
    };
    let (llama, llama_missing) = match llama {
        Ok(l) => (Some(l), None),
        Err(why) => (None, Some(why)),
    };
    // Before the bandwidth measurement's 1 GiB buffer.
    let peak_rss = peak_rss_mib();
    let peak = cleave_engine::kernels::int8_peak_gmacs(args.model.threads);
    let cost = context::weight_cost(&path)?;
    let report = Report {
        model: path.display().to_string(),
        threads: args.model.threads,
        simd: cleave_engine::kernels::simd_path(),
        prompt_tokens: p.len(),
        gen_tokens: args.gen_tokens,
        prefill_tok_s: prefill,
        decode_tok_s: decode,
        contexts,
        kv_dtype: args.kv_dtype.as_str(),
        kv_pool_mib: (blocks * block_bytes) as f64 / (1 << 20) as f64,
        file_mib: std::fs::metadata(&path).map_or(f64::NAN, |m| m.len() as f64 / (1 << 20) as f64),
        weight_bytes_per_token: cost.bytes_per_token,
        read_gb_s: context::read_bandwidth(args.model.threads),
        matmul_macs_per_token: cost.matmul_macs_per_token,
        int8_peak_gmacs: peak.map(|p| p.0),
        int8_peak_instructions: peak.map(|p| p.1),
        peak_rss_mib: peak_rss,
        llama_cpp: llama,
        llama_cpp_missing: llama_missing,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    print_table(&report);
    Ok(())
}

fn print_table(r: &Report) {
    println!("model {}  threads {}  simd {}", r.model, r.threads, r.simd);
    println!(
        "prompt {} tokens, {} generated tokens per sequence, greedy",
        r.prompt_tokens, r.gen_tokens
    );
    println!(
        "{:<28}{:>12}{:>12}{:>10}",
        "measure", "cleave", "llama.cpp", "ratio"
    );
    if let Some(why) = &r.llama_cpp_missing {
        println!("llama.cpp not measured: {why}");
    }
    let lc = r.llama_cpp.as_ref();
    let row = |name: &str, ours: f64, theirs: Option<f64>| match theirs {
        Some(t) => println!("{name:<28}{ours:>12.1}{t:>12.1}{:>9.2}x", ours / t),
        None => println!("{name:<28}{ours:>12.1}{:>12}{:>10}", "-", "-"),
    };
    row(
        "prefill tok/s",
        r.prefill_tok_s,
        lc.map(|l| l.prefill_tok_s),
    );
    let b1 = r.decode_tok_s.iter().find(|d| d.0 == 1).map(|d| d.1);
    for &(b, t) in &r.decode_tok_s {
        row(
            &format!("decode tok/s, batch {b}"),
            t,
            if b == 1 {
                lc.map(|l| l.decode_tok_s)
            } else {
                None
            },
        );
    }
    if let Some(b1) = b1 {
        for &(b, t) in r.decode_tok_s.iter().filter(|d| d.0 > 1) {
            println!(
                "{:<28}{:>11.2}x",
                format!("batch {b} / batch 1 (ours)"),
                t / b1
            );
        }
    }
    for c in &r.contexts {
        let theirs = lc.and_then(|l| l.contexts.iter().find(|o| o.context == c.context));
        row(
            &format!("prefill tok/s at {}", c.context),
            c.prefill_tok_s,
            theirs.map(|o| o.prefill_tok_s),
        );
        // Lower is better: the ratio is theirs over ours, so above 1 means faster here too.
        match theirs {
            Some(o) => println!(
                "{:<28}{:>12.1}{:>12.1}{:>9.2}x",
                format!("decode ITL ms at {}", c.context),
                c.itl_ms,
                o.itl_ms,
                o.itl_ms / c.itl_ms
            ),
            None => println!(
                "{:<28}{:>12.1}{:>12}{:>10}",
                format!("decode ITL ms at {}", c.context),
                c.itl_ms,
                "-",
                "-"
            ),
        }
    }
    let limit = r.read_gb_s * 1e9 / r.weight_bytes_per_token as f64;
    println!(
        "read bandwidth {:.1} GB/s ({} threads), weights {:.0} MiB per token: decode limit {:.1} tok/s; batch 1 at {:.2}x of it",
        r.read_gb_s,
        r.threads,
        r.weight_bytes_per_token as f64 / (1 << 20) as f64,
        limit,
        r.decode_tok_s
            .iter()
            .find(|d| d.0 == 1)
            .map_or(f64::NAN, |d| d.1 / limit)
    );
    if let (Some(peak), Some(what), Some(macs)) = (
        r.int8_peak_gmacs,
        r.int8_peak_instructions,
        r.matmul_macs_per_token,
    ) {
        let work = r.prefill_tok_s * macs as f64 / 1e9;
        println!(
            "int8 dot peak {peak:.1} GMAC/s ({} threads, {what}); prefill's matrix work {work:.1} GMAC/s = {:.0}% of it",
            r.threads,
            100.0 * work / peak
        );
    }
    println!(
        "KV {} pool {:.0} MiB, file {:.0} MiB; peak RSS {:.0} MiB ({:.2}x file + pool)",
        r.kv_dtype,
        r.kv_pool_mib,
        r.file_mib,
        r.peak_rss_mib,
        r.peak_rss_mib / (r.file_mib + r.kv_pool_mib)
    );
}

/// Flags of `cleave bench kv-transfer`.
#[derive(Debug, Args)]
pub struct KvTransferArgs {
    /// Bytes of one KV block (default: the default model's f32 block, 30 layers × K,V × 16
    /// tokens × 3 KV heads × 64 dims × 4 bytes).
    #[arg(long, default_value_t = 737_280)]
    pub block_bytes: usize,
    /// MiB moved per shape and backend.
    #[arg(long, default_value_t = 512)]
    pub mib: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Also measure the TTFT breakdown of disaggregated requests with prompts of this many
    /// tokens (0: skip).
    #[arg(long, default_value_t = 1024)]
    pub ttft_prompt_tokens: usize,
    /// GGUF file or Hugging Face directory for the TTFT breakdown (default: the cached default model).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: Option<std::path::PathBuf>,
}

/// Our transports' GB/s on KV-block-shaped transfers, next to memcpy and ucx_perftest.
pub fn bench_kv_transfer(args: KvTransferArgs) -> anyhow::Result<()> {
    use cleave_kv_transfer::bench::{bench, BenchConfig};
    let config = BenchConfig {
        block_bytes: args.block_bytes,
        bytes_per_shape: args.mib << 20,
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = rt.block_on(bench(&config))?;
    drop(rt);
    let ttft = if args.ttft_prompt_tokens > 0 {
        let model = match args.model {
            Some(p) => p,
            None => crate::fetch::fetch_default_model(false)?,
        };
        ttft_breakdown(model, args.ttft_prompt_tokens, 3)?
    } else {
        Vec::new()
    };
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["ttft_breakdown"] = serde_json::Value::Array(ttft);
        println!("{v}");
    } else {
        println!("{}", report.table());
        if !ttft.is_empty() {
            println!("TTFT of a disaggregated request (decode worker's view), seconds:");
            println!(
                "{:>8} {:>8} {:>10} {:>10} {:>10} {:>8}",
                "prompt", "queue", "prefill", "kv tail", "1st step", "ttft"
            );
            for t in &ttft {
                println!(
                    "{:>8} {:>8.4} {:>10.4} {:>10.4} {:>10.4} {:>8.4}",
                    t["prompt_tokens"],
                    t["queue_s"].as_f64().unwrap_or(0.0),
                    t["prefill_compute_s"].as_f64().unwrap_or(0.0),
                    t["kv_transfer_tail_s"].as_f64().unwrap_or(0.0),
                    t["first_decode_s"].as_f64().unwrap_or(0.0),
                    t["ttft_s"].as_f64().unwrap_or(0.0)
                );
            }
        }
    }
    Ok(())
}

/// TTFT of disaggregated requests by phase: starts a prefill and a decode worker in this
/// process (real gRPC, the default transport) and sends `n` fresh prompts of `tokens` tokens.
pub fn ttft_breakdown(
    model: std::path::PathBuf,
    tokens: usize,
    n: usize,
) -> anyhow::Result<Vec<serde_json::Value>> {
    use cleave_proto::v1 as pb;
    use cleave_worker::{run, WorkerConfig};
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let config = WorkerConfig {
            prefill_tokens_while_decoding: 0,
            prefill_timeout: Duration::from_secs(120),
            local_fallback: false,
            ..WorkerConfig::defaults(model.clone())
        };
        let stop = tokio_util::sync::CancellationToken::new();
        let prefill = run(cleave_prefill_worker::SERVICE, config.clone(), stop.clone()).await?;
        let decode = run(cleave_decode_worker::SERVICE, config, stop.clone()).await?;
        let tok = cleave_text::ModelText::open(&model)?.tokenizer;
        let mut client = cleave_proto::v1::decode_worker_client::DecodeWorkerClient::connect(
            format!("http://{}", decode.grpc_addr),
        )
        .await?;
        let mut out = Vec::new();
        for i in 0..n {
            let mut prompt = tok.encode(&format!("Request {i}. "), false);
            prompt.extend(tok.encode(&TEXT.repeat(tokens / 20 + 2), false));
            prompt.truncate(tokens);
            let req = pb::GenerateRequest {
                request_id: format!("ttft-{i}"),
                prompt,
                params: Some(pb::SamplingParams {
                    max_tokens: 2,
                    top_p: 1.0,
                    ignore_eos: true,
                    ..Default::default()
                }),
                prefill_endpoint: Some(format!("http://{}", prefill.grpc_addr)),
                resume: Vec::new(),
            };
            let mut stream = client.generate(req).await?.into_inner();
            while let Some(ev) = stream.message().await? {
                if let Some(pb::generate_event::Event::Finished(f)) = ev.event {
                    let t = f
                        .ttft
                        .context("no TTFT breakdown (was the request disaggregated?)")?;
                    out.push(serde_json::json!({
                        "prompt_tokens": f.prompt_tokens,
                        "queue_s": t.queue_seconds,
                        "prefill_compute_s": t.prefill_seconds,
                        "kv_transfer_tail_s": t.transfer_seconds,
                        "first_decode_s": t.first_decode_seconds,
                        "ttft_s": t.total_seconds,
                        "transport": format!("{:?}", decode.state.transport.backend()),
                    }));
                }
            }
        }
        stop.cancel();
        Ok(out)
    })
}
