//! llama.cpp's OpenAI-compatible server (`llama-server`) as one configuration of
//! `cleave bench compare` (`--llama-server PATH`): the same model file, the same workload, the
//! same client, and the compute of the first cleave configuration (its compute threads), so
//! the ratios against it are fair. Its KV cache is llama.cpp's default (f16) and its prompt
//! cache reuses shared prefixes token by token; the header says so.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use cleave_loadgen::resources::Resources;

use super::Up;

/// The configuration's name in reports.
pub const NAME: &str = "llama.cpp";
/// Marks a configuration's flags as llama-server's (not `cleave up`'s).
pub const MARK: &str = "--llama-server";

/// The flags that stand for llama-server at `path` with `threads` compute threads and
/// `parallel` slots of `ctx` tokens each.
pub fn flags(path: &Path, threads: usize, parallel: usize, ctx: usize) -> Vec<String> {
    vec![
        MARK.into(),
        path.display().to_string(),
        threads.to_string(),
        parallel.to_string(),
        ctx.to_string(),
    ]
}

/// Whether `flags` stand for llama-server.
pub fn is_llama(flags: &[String]) -> bool {
    flags.first().map(String::as_str) == Some(MARK)
}

struct Parsed<'a> {
    path: &'a str,
    threads: usize,
    parallel: usize,
    ctx: usize,
}

fn parse(flags: &[String]) -> anyhow::Result<Parsed<'_>> {
    let [_, path, threads, parallel, ctx] = flags else {
        bail!("llama-server configuration {flags:?}");
    };
    Ok(Parsed {
        path,
        threads: threads.parse()?,
        parallel: parallel.parse()?,
        ctx: ctx.parse()?,
    })
}

/// What the configuration runs on (one process; its KV is counted in tokens, not blocks).
pub fn declared(flags: &[String], cores: (String, bool)) -> anyhow::Result<Resources> {
    let p = parse(flags)?;
    Ok(Resources {
        processes: 1,
        compute_threads: p.threads,
        kv_blocks: 0,
        decode_kv_blocks: 0,
        cores: cores.0,
        pinned: cores.1,
        layout: format!(
            "llama-server, {} slot{} × {} tokens of context, f16 KV, prompt cache on",
            p.parallel,
            if p.parallel == 1 { "" } else { "s" },
            p.ctx / p.parallel.max(1)
        ),
        source: "from the flags (llama-server)".into(),
    })
}

/// Starts llama-server on `model` at a free loopback port and waits for its `/health`.
pub fn start(model: &str, flags: &[String]) -> anyhow::Result<Up> {
    let p = parse(flags)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let (threads, parallel, ctx) = (p.threads.to_string(), p.parallel.to_string(), p.ctx);
    let child = Command::new(p.path)
        .args([
            "-m",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args(["-t", &threads, "-tb", &threads, "-np", &parallel])
        .args(["-c", &ctx.to_string(), "--no-webui"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", p.path))?;
    let up = Up {
        child,
        base: format!("http://127.0.0.1:{port}/v1"),
        workers: Vec::new(),
        log: None,
    };
    let health = format!("http://127.0.0.1:{port}/health");
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        if matches!(crate::http::get(&health), Ok((200, _))) {
            return Ok(up);
        }
        // Polling a child's readiness with a deadline.
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(Duration::from_millis(200));
    }
    bail!("{} did not answer {health} within 120 s", p.path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_stand_for_the_server_and_declare_its_threads() {
        let f = flags(Path::new("/opt/llama-server"), 2, 4, 8192);
        assert!(is_llama(&f));
        assert!(!is_llama(&["--prefill".to_string(), "0".into()]));
        let r = declared(&f, ("0-1".into(), false)).unwrap();
        assert_eq!((r.processes, r.compute_threads), (1, 2));
        assert!(r.layout.contains("4 slots × 2048 tokens"), "{}", r.layout);
        assert!(declared(&f[..3], ("0".into(), false)).is_err());
    }
}
