//! `cleave bench serve` against a real `cleave up` (router + one decode worker, the default
//! model): token timing parsed from the real SSE stream, then a tiny run writing JSON and PNGs.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use crate::support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cleave_loadgen::client::{send, Api, Target};
use cleave_loadgen::tokens::{PromptFormat, TokenMap};
use cleave_loadgen::workload::RequestSpec;
use support::{cleave, model_path, stderr_of_failure, stdout_of};

struct Up(Child);

impl Drop for Up {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cleave up` on a free port and returns it with its base URL (…/v1).
fn up(flags: &[&str]) -> (Up, String) {
    let mut child = cleave()
        .args(["up", "--port", "0", "--model"])
        .arg(model_path())
        .args(flags)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let up = Up(child);
    let mut lines = BufReader::new(stdout).lines();
    let line = lines.next().expect("cleave up printed nothing").unwrap();
    std::thread::spawn(move || for _ in lines {});
    let base = line
        .strip_prefix("cleave is up: ")
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    (up, base)
}

#[test]
fn sse_timing_from_a_real_endpoint_and_a_tiny_run_with_json_and_charts() {
    let (_up, base) = up(&["--prefill", "0", "--decode", "1"]);

    // One streamed request: 8 tokens → a TTFT and 7 inter-token gaps, usage with cached tokens.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let map = TokenMap::default();
    let spec = RequestSpec {
        prompt: map.prompt(&[(1, 24)], PromptFormat::Tokens),
        prompt_tokens: 24,
        max_tokens: 8,
        at: None,
    };
    let model = rt
        .block_on(cleave::bench_serve::served_model(&base))
        .unwrap();
    let target = Target {
        base: base.clone(),
        model,
        api: Api::Completions,
        ignore_eos: true,
        timeout: Duration::from_secs(120),
    };
    let client = reqwest::Client::new();
    let t0 = Instant::now();
    let (r1, r2) = rt.block_on(async {
        let r1 = send(&client, &target, &spec, t0).await;
        let r2 = send(&client, &target, &spec, t0).await;
        (r1, r2)
    });
    for r in [&r1, &r2] {
        assert_eq!(r.error, None, "{r:?}");
        assert_eq!(r.output_tokens, 8, "{r:?}");
        assert_eq!(r.itl_s.len(), 7, "{r:?}");
        assert_eq!(r.prompt_tokens, 24, "{r:?}");
        let ttft = r.ttft_s.unwrap();
        assert!(
            ttft > 0.0 && ttft + r.itl_s.iter().sum::<f64>() <= r.e2e_s + 1e-9,
            "{r:?}"
        );
    }
    // The same prompt again: the worker's prefix cache served its full 16-token block.
    assert!(r2.cached_tokens.unwrap() >= 16, "{r2:?}");
    // A chat request with a token prompt is a configuration error, not a panic.
    let chat = Target {
        api: Api::Chat,
        ..target
    };
    let r = rt.block_on(send(&client, &chat, &spec, t0));
    assert!(r.error.unwrap().starts_with("config"));
    // Chat with a text prompt: the role chunk (empty content) is not a token.
    let text = RequestSpec {
        prompt: map.prompt(&[(2, 12)], PromptFormat::Text),
        prompt_tokens: 12,
        max_tokens: 4,
        at: None,
    };
    let r = rt.block_on(send(&client, &chat, &text, t0));
    assert_eq!(r.error, None, "{r:?}");
    assert_eq!(r.output_tokens, 4, "{r:?}");
    assert!(!r.itl_s.is_empty() && r.itl_s.len() <= 3, "{r:?}");

    // A tiny synthetic run: JSON on stdout, three PNGs.
    let dir = std::env::temp_dir().join(format!("cleave-bench-serve-{}", std::process::id()));
    let out = stdout_of(
        cleave()
            .args([
                "bench",
                "serve",
                "--url",
                &base,
                "--requests",
                "4",
                "--rate",
                "4,8",
                "--input-len",
                "32",
                "--output-len",
                "4",
                "--prefix-fraction",
                "0.5",
                "--prefix-groups",
                "1",
                "--warmup",
                "1",
                "--json",
                "--no-progress",
                "--plot",
            ])
            .arg(&dir),
    );
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    let points = v["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    for p in points {
        assert_eq!(p["stats"]["ok"], 4, "{p}");
        assert!(p["stats"]["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
        assert_eq!(p["stats"]["itl_ms"]["n"], 4 * 3);
        // cleave's counters were read: placements all local (aggregated), a hit rate exists.
        assert_eq!(p["cleave"]["disaggregated_fraction"], 0.0, "{p}");
    }
    assert_eq!(points[0]["load"]["rate"], 4.0);
    assert!(
        v["header"]["model"].as_str().unwrap().contains("SmolLM2"),
        "{}",
        v["header"]
    );
    assert_eq!(v["header"]["quantization"], "Q4_1");
    assert!(v["header"]["machine"].as_str().unwrap().contains("cores"));
    for f in ["latency_vs_load.png", "ttft_cdf.png", "itl_cdf.png"] {
        let bytes = std::fs::read(dir.join(f)).unwrap();
        assert!(
            bytes.len() > 5000 && bytes.starts_with(b"\x89PNG"),
            "{f}: {} bytes",
            bytes.len()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);

    // Bad input: a clear error.
    let err = stderr_of_failure(cleave().args([
        "bench",
        "serve",
        "--url",
        "localhost:1",
        "--requests",
        "1",
    ]));
    assert!(err.contains("--url must start with http://"), "{err}");
}

#[test]
fn urls_configs_and_quantization_names_parse_or_fail_clearly() {
    use cleave::bench_compare::parse_config;
    use cleave::bench_serve::{guess_quantization, split_url};
    let (base, root) = split_url("http://h:1/v1/").unwrap();
    assert_eq!(
        (base.as_str(), root.as_str()),
        ("http://h:1/v1", "http://h:1")
    );
    assert_eq!(split_url("http://h:1").unwrap().0, "http://h:1/v1");
    assert!(split_url("h:1").is_err());
    let (name, flags) = parse_config("agg=--prefill 0  --decode 2").unwrap();
    assert_eq!(
        (name.as_str(), flags),
        (
            "agg",
            vec![
                "--prefill".to_string(),
                "0".into(),
                "--decode".into(),
                "2".into()
            ]
        )
    );
    assert!(parse_config("no equals sign")
        .unwrap_err()
        .to_string()
        .contains("NAME=FLAGS"));
    assert!(parse_config("x=--port 9")
        .unwrap_err()
        .to_string()
        .contains("--port"));
    assert_eq!(
        guess_quantization("SmolLM2-135M-Instruct.Q4_1.gguf"),
        "Q4_1"
    );
    assert_eq!(guess_quantization("llama-3-8b-instruct-q8_0"), "Q8_0");
    assert_eq!(guess_quantization("model-F16"), "F16");
    assert!(guess_quantization("SmolLM2-135M").contains("not stated"));
}
