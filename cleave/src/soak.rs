//! `cleave soak`: mixed traffic for a long time through a local `cleave up --restart-workers`
//! while a random worker is killed (SIGKILL) every `--kill-every` and restarted by `cleave up`.
//! Checks what must hold however long it runs: every request ends (success, a migrated stream,
//! or a clean error; none runs past its timeout, none is cut for length before its first token), the KV blocks in use return to zero on every
//! worker at the end, and no process panics. Exits non-zero when one of them fails.
//!
//! The traffic: chats, streamed chats, `n` = 2, long prompts and streams the client abandons
//! after a few chunks, from `--clients` concurrent clients with a fixed seed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use cleave_loadgen::scrape::sum_metric;
use cleave_types::duration::parse_positive_duration;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::bench_compare::resources::{descendants, is_worker};
use crate::bench_compare::start;
use crate::bench_overload::Sampler;

/// Flags of `cleave soak`.
#[derive(Debug, Clone, Args)]
pub struct SoakArgs {
    /// GGUF model (default: the cached default model).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model_path: Option<PathBuf>,
    /// The `cleave up` flags of the fleet (`--restart-workers` is added).
    #[arg(long, default_value = "--prefill 1 --decode 2 --threads 1")]
    pub up: String,
    /// How long the traffic runs.
    #[arg(long, value_parser = parse_positive_duration, default_value = "30m")]
    pub duration: Duration,
    /// A random worker is killed this often.
    #[arg(long, value_parser = parse_positive_duration, default_value = "2m")]
    pub kill_every: Duration,
    /// Concurrent clients.
    #[arg(long, default_value_t = 4)]
    pub clients: usize,
    /// A request still running after this long is a hang.
    #[arg(long, value_parser = parse_positive_duration, default_value = "120s")]
    pub request_timeout: Duration,
    /// Seed of the traffic mix and of the choice of victims.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// What one request is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Chat,
    Stream,
    N2,
    LongPrompt,
    Cancelled,
}

const KINDS: [Kind; 5] = [
    Kind::Chat,
    Kind::Stream,
    Kind::N2,
    Kind::LongPrompt,
    Kind::Cancelled,
];

/// How a request ended: "ok", "abandoned" (a cancellation that went as planned), "hang", or
/// the error's kind.
type Outcome = String;

#[derive(Default)]
struct Tally {
    by_kind: BTreeMap<(Kind, Outcome), usize>,
}

fn body(kind: Kind, model: &str, rng: &mut StdRng) -> serde_json::Value {
    let topic = ["rivers", "bread", "stars", "clocks", "maps"][rng.gen_range(0..5)];
    let mut text = format!("Write a few sentences about {topic}.");
    if kind == Kind::LongPrompt {
        text = format!(
            "{} {text}",
            "The archive holds letters, ledgers and maps from many centuries. ".repeat(40)
        );
    }
    let stream = matches!(kind, Kind::Stream | Kind::LongPrompt | Kind::Cancelled);
    json!({
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": rng.gen_range(16..48),
        "temperature": if rng.gen_bool(0.5) { 0.0 } else { 0.8 },
        "seed": rng.gen_range(0..1000),
        "n": if kind == Kind::N2 { 2 } else { 1 },
        "stream": stream,
        "stream_options": if stream { json!({"include_usage": true}) } else { json!(null) },
    })
}

/// Sends one request of `kind` and says how it ended.
async fn one(client: &reqwest::Client, url: &str, kind: Kind, body: serde_json::Value) -> Outcome {
    let request = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_string());
    let resp = match request.send().await {
        Ok(r) => r,
        Err(e) if e.is_timeout() => return "hang".into(),
        Err(_) => return "connect".into(),
    };
    let status = resp.status();
    if !status.is_success() {
        return format!("http_{}", status.as_u16());
    }
    let n = body["n"].as_u64().unwrap_or(1) as usize;
    if !body["stream"].as_bool().unwrap_or(false) {
        return match resp.bytes().await {
            Ok(b) => match serde_json::from_slice::<serde_json::Value>(&b) {
                Ok(_) if empty_length(&String::from_utf8_lossy(&b)) => "empty_length".into(),
                Ok(v) if v["choices"].as_array().map(Vec::len) == Some(n) => "ok".into(),
                _ => "bad_body".into(),
            },
            Err(e) if e.is_timeout() => "hang".into(),
            Err(_) => "body_error".into(),
        };
    }
    let mut resp = resp;
    let (mut text, mut chunks) = (String::new(), 0usize);
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => {
                chunks += 1;
                text.push_str(&String::from_utf8_lossy(&c));
                if kind == Kind::Cancelled && chunks >= 3 {
                    return "abandoned".into(); // dropping `resp` closes the stream
                }
            }
            Ok(None) => break,
            Err(e) if e.is_timeout() => return "hang".into(),
            Err(_) => return "stream_cut".into(),
        }
    }
    if text.contains("\"error\"") {
        // OpenAI's in-stream error event (e.g. no worker left to migrate to).
        let kind = text
            .split("\"type\":\"")
            .nth(1)
            .and_then(|t| t.split('"').next())
            .unwrap_or("unknown");
        return format!("stream_error:{kind}");
    }
    if !text.contains("data: [DONE]") {
        return "no_done".into();
    }
    if empty_length(&text) {
        return "empty_length".into();
    }
    "ok".into()
}

/// An answer cut for length before its first token: never right (every request here asks for
/// at least 16 tokens), the sign of a request the engine dropped instead of queueing.
fn empty_length(body: &str) -> bool {
    let compact: String = body.chars().filter(|c| !c.is_whitespace()).collect();
    compact.contains("\"finish_reason\":\"length\"") && compact.contains("\"completion_tokens\":0,")
}

/// Kills a random worker with SIGKILL; returns its pid.
fn kill_one(up_pid: u32, rng: &mut StdRng) -> Option<u32> {
    let proc_root = Path::new("/proc");
    let workers: Vec<u32> = descendants(proc_root, up_pid)
        .into_iter()
        .filter(|&p| is_worker(proc_root, p))
        .collect();
    if workers.is_empty() {
        return None;
    }
    let pid = workers[rng.gen_range(0..workers.len())];
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    killed.then_some(pid)
}

/// Entry point of `cleave soak`.
pub fn soak(args: SoakArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.clients >= 1, "--clients must be at least 1");
    let model = match &args.model_path {
        Some(p) => p.clone(),
        None => crate::fetch::fetch_default_model(false)?,
    };
    let mut flags: Vec<String> = args.up.split_whitespace().map(String::from).collect();
    flags.push("--restart-workers".into());
    eprintln!("== cleave up {}", flags.join(" "));
    let mut up = start(&model.display().to_string(), &flags)?;
    let sampler = Sampler::start(up.child.id());
    // Scan the fleet's log for panics while it runs.
    let panics = Arc::new(Mutex::new(Vec::<String>::new()));
    let log = up.log.take().context("cleave up's log")?;
    let p = panics.clone();
    std::thread::spawn(move || {
        for line in log.iter() {
            let line = line.unwrap_or_else(|l| l);
            if line.contains("panicked") {
                p.lock().expect("panics").push(line);
            }
        }
    });
    let base = up.base.trim_end_matches('/').to_string();
    let root = base.strip_suffix("/v1").unwrap_or(&base).to_string();
    let rt = tokio::runtime::Runtime::new()?;
    let up_pid = up.child.id();
    let started = Instant::now();
    let (tally, kills, migrations, blocks) = rt.block_on(async {
        let model = crate::bench_serve::served_model(&base).await?;
        let client = reqwest::Client::builder()
            .timeout(args.request_timeout)
            .build()?;
        let deadline = started + args.duration;
        let tally = Arc::new(Mutex::new(Tally::default()));
        let mut tasks = tokio::task::JoinSet::new();
        for c in 0..args.clients {
            let (client, model, tally) = (client.clone(), model.clone(), tally.clone());
            let url = format!("{base}/chat/completions");
            let mut rng = StdRng::seed_from_u64(args.seed.wrapping_mul(1000) + c as u64);
            tasks.spawn(async move {
                while Instant::now() < deadline {
                    let kind = KINDS[rng.gen_range(0..KINDS.len())];
                    let outcome = one(&client, &url, kind, body(kind, &model, &mut rng)).await;
                    *tally
                        .lock()
                        .expect("tally")
                        .by_kind
                        .entry((kind, outcome))
                        .or_default() += 1;
                }
            });
        }
        let mut rng = StdRng::seed_from_u64(args.seed ^ 0x6b696c6c);
        let mut kills = 0usize;
        let mut next_kill = started + args.kill_every;
        while next_kill < deadline {
            tokio::time::sleep_until(next_kill.into()).await;
            if let Some(pid) = kill_one(up_pid, &mut rng) {
                kills += 1;
                eprintln!(
                    "[{:>5.0}s] killed worker pid {pid}",
                    started.elapsed().as_secs_f64()
                );
            }
            next_kill += args.kill_every;
        }
        while tasks.join_next().await.is_some() {}
        // Every request has ended; the restarted workers are back. Blocks in use must drain.
        let http = reqwest::Client::new();
        let mut blocks = Vec::new();
        for (role, url) in &up.workers {
            let mut used = None;
            for _ in 0..120 {
                let text = match http.get(url).send().await {
                    Ok(r) => r.text().await.unwrap_or_default(),
                    Err(_) => String::new(),
                };
                used = sum_metric(&text, "cleave_kv_blocks_used", None);
                if used == Some(0.0) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            blocks.push((role.clone(), url.clone(), used));
        }
        let text = http
            .get(format!("{root}/metrics"))
            .send()
            .await?
            .text()
            .await?;
        let migrations = sum_metric(&text, "cleave_router_migrations_total", None).unwrap_or(0.0);
        let tally = std::mem::take(&mut *tally.lock().expect("tally"));
        anyhow::Ok((tally, kills, migrations, blocks))
    })?;
    let peaks = std::mem::take(&mut *sampler.peaks.lock().expect("peaks"));
    drop(sampler);
    drop(up);
    let panics = panics.lock().expect("panics").clone();
    report(
        &args,
        started.elapsed(),
        &tally,
        kills,
        migrations,
        &blocks,
        &panics,
        peaks.peak(),
    )
}

#[allow(clippy::too_many_arguments)]
fn report(
    args: &SoakArgs,
    ran: Duration,
    tally: &Tally,
    kills: usize,
    migrations: f64,
    blocks: &[(String, String, Option<f64>)],
    panics: &[String],
    (router_rss, worker_rss): (u64, u64),
) -> anyhow::Result<()> {
    println!(
        "soak: {:.0} s, {} clients, a worker killed every {:?} ({kills} kills), cleave up {}",
        ran.as_secs_f64(),
        args.clients,
        args.kill_every,
        args.up
    );
    let mut outcomes: BTreeMap<&str, usize> = BTreeMap::new();
    println!("{:<11} {:>7}  outcomes", "kind", "count");
    for kind in KINDS {
        let mine: Vec<(&str, usize)> = tally
            .by_kind
            .iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|((_, o), n)| (o.as_str(), *n))
            .collect();
        let total: usize = mine.iter().map(|(_, n)| n).sum();
        let text: Vec<String> = mine.iter().map(|(o, n)| format!("{o} {n}")).collect();
        println!(
            "{:<11} {total:>7}  {}",
            format!("{kind:?}"),
            text.join(", ")
        );
        for (o, n) in mine {
            *outcomes.entry(o).or_default() += n;
        }
    }
    let total: usize = outcomes.values().sum();
    println!("all         {total:>7}  {outcomes:?}");
    println!("streams migrated by the router: {migrations:.0}");
    println!(
        "peak RSS: router {:.0} MiB, largest worker {:.0} MiB",
        router_rss as f64 / (1 << 20) as f64,
        worker_rss as f64 / (1 << 20) as f64
    );
    let mut failed = Vec::new();
    let empty = outcomes.get("empty_length").copied().unwrap_or(0);
    if empty > 0 {
        failed.push(format!("{empty} answers cut for length with no token"));
    }
    let hangs = outcomes.get("hang").copied().unwrap_or(0);
    if hangs > 0 {
        failed.push(format!(
            "{hangs} requests ran past {:?}",
            args.request_timeout
        ));
    }
    for (role, url, used) in blocks {
        println!("KV blocks in use at the end: {role} {url}: {used:?}");
        if *used != Some(0.0) {
            failed.push(format!("{role} ({url}) still holds {used:?} KV blocks"));
        }
    }
    println!("panics in the fleet's log: {}", panics.len());
    for p in panics.iter().take(5) {
        println!("  {p}");
    }
    if !panics.is_empty() {
        failed.push(format!("{} panics", panics.len()));
    }
    if failed.is_empty() {
        println!("soak passed: every request ended, blocks returned to zero, no panic");
        Ok(())
    } else {
        anyhow::bail!("soak failed: {}", failed.join("; "))
    }
}
