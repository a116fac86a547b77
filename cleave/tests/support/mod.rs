//! Helpers of the `cleave` binary's tests: running it, worker processes (each rank its own
//! `cleave worker --role decode`), and network namespaces joined by veth pairs to a bridge
//! (separate "hosts" on one machine).

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::load::Loaded;
use cleave_engine::model::reference::greedy_split;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use cleave_text::gguf::{default_model_path, GgufFile};

/// Taken by the tests that start several model processes (the worker groups of `group` and
/// `group_pd`): one such test at a time on small machines, across the files of this binary.
pub static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A process killed (SIGKILL) when dropped.
pub struct Proc {
    pub child: Child,
    /// The JSON line it printed when ready.
    pub line: serde_json::Value,
}

impl Proc {
    /// Starts `argv` and waits (up to `timeout`) for its first stdout line, a JSON object.
    pub fn start(argv: &[String], timeout: Duration) -> Proc {
        let mut child = Command::new(&argv[0])
            .args(&argv[1..])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {argv:?}: {e}"));
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            let first = lines.next().and_then(|l| l.ok());
            let _ = tx.send(first);
            // Keep draining so the process never blocks on a full pipe.
            for _ in lines {}
        });
        let line = match rx.recv_timeout(timeout) {
            Ok(Some(l)) => l,
            other => {
                let _ = child.kill();
                panic!("{argv:?} printed no ready line ({other:?})");
            }
        };
        let line = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        Proc { child, line }
    }

    /// The address under `key` of the ready line.
    pub fn addr(&self, key: &str) -> String {
        self.line[key].as_str().unwrap().to_string()
    }

    /// Waits up to `timeout` for the process to exit.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(s) = self.child.try_wait().unwrap() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill {sig}");
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `cleave` binary of this build.
pub fn cleave() -> Command {
    Command::new(env!("CARGO_BIN_EXE_cleave"))
}

/// The default model, which must have been fetched.
pub fn model_path() -> PathBuf {
    let p = default_model_path();
    assert!(
        p.exists(),
        "run `cleave model fetch` first (scripts/test does)"
    );
    p
}

/// Runs `cmd`, asserts that it succeeded (its stderr the message) and returns its stdout.
pub fn stdout_of(cmd: &mut Command) -> Vec<u8> {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Runs `cmd`, asserts that it failed and returns its stderr.
pub fn stderr_of_failure(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "{cmd:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The argv of rank `rank` of a `role` (`decode` or `prefill`) group of `size`, run under
/// `wrap` (e.g. `ip netns exec NS`), its gRPC/HTTP listening on `host`, the leader's group
/// listener at `leader`: `cleave worker --role ROLE`, the command `cleave up` runs (the same
/// runtime as the `cleave-decode`/`cleave-prefill` binaries, which are one-line mains over it).
pub fn role_rank_argv(
    role: &str,
    wrap: &[String],
    host: &str,
    size: usize,
    rank: usize,
    leader: &str,
    extra: &[&str],
) -> Vec<String> {
    let mut v: Vec<String> = wrap.to_vec();
    v.extend([env!("CARGO_BIN_EXE_cleave"), "worker", "--role", role].map(String::from));
    for a in [
        "--model",
        default_model_path().to_str().unwrap(),
        "--grpc-addr",
        &format!("{host}:0"),
        "--http-addr",
        &format!("{host}:0"),
        "--kv-blocks",
        "128",
        "--transport",
        "tcp",
        "--tp",
        &size.to_string(),
        "--group-rank",
        &rank.to_string(),
        "--group-leader",
        leader,
        "--group-timeout",
        "20s",
        "--group-connect-timeout",
        "60s",
    ] {
        v.push(a.to_string());
    }
    if rank == 0 {
        v.push("--group-bind".into());
        v.push(leader.to_string());
    }
    // A `--transport` in `extra` replaces the default `tcp`.
    if let Some(i) = extra.iter().position(|a| *a == "--transport") {
        let at = v.iter().position(|a| a == "--transport").unwrap();
        v.drain(at..at + 2);
        v.extend(extra[i..].iter().take(2).map(|s| s.to_string()));
        v.extend(
            extra[..i]
                .iter()
                .chain(extra.iter().skip(i + 2))
                .map(|s| s.to_string()),
        );
        return v;
    }
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// A group of processes: `ranks[0]` is the leader.
pub struct Group {
    pub ranks: Vec<Proc>,
}

impl Group {
    /// Starts the followers, then the leader, and waits for all of them.
    pub fn start(wraps: &[Vec<String>], hosts: &[String], extra: &[&str]) -> Group {
        Group::start_role("decode", wraps, hosts, extra)
    }

    /// [`Group::start`] of `role` (`decode` or `prefill`).
    pub fn start_role(
        role: &str,
        wraps: &[Vec<String>],
        hosts: &[String],
        extra: &[&str],
    ) -> Group {
        let size = wraps.len();
        let leader = format!("{}:{}", hosts[0], free_port());
        // Followers first: they wait for the leader's listener (their ready line comes after
        // the group formed, so start all and then read the lines).
        let argvs: Vec<Vec<String>> = (0..size)
            .map(|r| role_rank_argv(role, &wraps[r], &hosts[r], size, r, &leader, extra))
            .collect();
        let handles: Vec<_> = argvs
            .into_iter()
            .map(|a| std::thread::spawn(move || Proc::start(&a, Duration::from_secs(240))))
            .collect();
        let ranks = handles.into_iter().map(|h| h.join().unwrap()).collect();
        Group { ranks }
    }

    pub fn grpc(&self) -> String {
        format!("http://{}", self.ranks[0].addr("grpc"))
    }

    pub fn http(&self) -> String {
        self.ranks[0].addr("http")
    }
}

fn greedy(n: u32) -> pb::SamplingParams {
    pb::SamplingParams {
        max_tokens: n,
        ignore_eos: true,
        top_p: 1.0,
        ..Default::default()
    }
}

/// Greedy tokens from a decode worker, or the gRPC error that ended the stream.
pub async fn generate(endpoint: &str, prompt: &[u32], n: u32) -> Result<Vec<u32>, String> {
    generate_via(endpoint, "", prompt, n).await
}

/// [`generate`] with the prompt's KV from the prefill worker at `prefill` (empty: none).
pub async fn generate_via(
    endpoint: &str,
    prefill: &str,
    prompt: &[u32],
    n: u32,
) -> Result<Vec<u32>, String> {
    let mut client = DecodeWorkerClient::connect(endpoint.to_string())
        .await
        .map_err(|e| e.to_string())?;
    let req = pb::GenerateRequest {
        request_id: "group-test".into(),
        prompt: prompt.to_vec(),
        params: Some(greedy(n)),
        prefill_endpoint: (!prefill.is_empty()).then(|| prefill.to_string()),
        resume: Vec::new(),
    };
    let mut stream = client
        .generate(req)
        .await
        .map_err(|e| e.to_string())?
        .into_inner();
    let mut ids = Vec::new();
    while let Some(ev) = stream.message().await.map_err(|e| e.to_string())? {
        match ev.event.unwrap() {
            pb::generate_event::Event::Token(t) => ids.push(t.id),
            pb::generate_event::Event::Finished(f) => {
                if f.reason() == pb::FinishReason::Aborted {
                    return Err(format!("aborted after {} tokens", ids.len()));
                }
                return Ok(ids);
            }
        }
    }
    Err("stream ended without Finished".into())
}

/// Plain HTTP GET: (status, body), or None when nothing answers.
pub fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split("\r\n\r\n").nth(1).unwrap_or("").to_string();
    Some((status, body))
}

/// The value of a metric line `name value`.
pub fn metric(addr: &str, name: &str) -> Option<f64> {
    let (_, body) = http_get(addr, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Network namespaces `ns[i]` (address `10.<a>.<b>.<i+1>/24`) joined by veth pairs to a bridge
/// in this namespace (address `.254`). Everything is deleted on drop, even after a failure.
pub struct Netns {
    pub names: Vec<String>,
    pub hosts: Vec<String>,
    bridge: String,
    veths: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running `ip` (iproute2 is needed): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// Creates `n` namespaces; panics with the reason when the environment cannot (no root,
    /// no CAP_NET_ADMIN, no iproute2): these tests must not silently pass without them.
    pub fn create(n: usize) -> Netns {
        let id = std::process::id() % 100_000;
        let (a, b) = (200 + (id / 250) % 50, id % 250);
        let mut me = Netns {
            names: Vec::new(),
            hosts: Vec::new(),
            bridge: format!("cvb{id}"),
            veths: Vec::new(),
        };
        if let Err(e) = me.setup(n, a as u8, b as u8, id) {
            panic!(
                "cannot create network namespaces for the worker-group test ({e}); it needs \
                 root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2, which scripts/test installs"
            );
        }
        me
    }

    fn setup(&mut self, n: usize, a: u8, b: u8, id: u32) -> Result<(), String> {
        let net = format!("10.{a}.{b}");
        ip(&["link", "add", &self.bridge, "type", "bridge"])?;
        ip(&["addr", "add", &format!("{net}.254/24"), "dev", &self.bridge])?;
        ip(&["link", "set", &self.bridge, "up"])?;
        for i in 0..n {
            let ns = format!("cvn{id}r{i}");
            ip(&["netns", "add", &ns])?;
            self.names.push(ns.clone());
            let (outer, inner) = (format!("cv{id}r{i}a"), format!("cv{id}r{i}b"));
            ip(&[
                "link", "add", &outer, "type", "veth", "peer", "name", &inner,
            ])?;
            self.veths.push(outer.clone());
            ip(&["link", "set", &inner, "netns", &ns])?;
            ip(&["link", "set", &outer, "master", &self.bridge])?;
            ip(&["link", "set", &outer, "up"])?;
            let host = format!("{net}.{}", i + 1);
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{host}/24"),
                "dev",
                &inner,
            ])?;
            ip(&["-n", &ns, "link", "set", &inner, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            self.hosts.push(host);
        }
        Ok(())
    }

    /// The `ip netns exec NS` prefix of namespace `i`.
    pub fn wrap(&self, i: usize) -> Vec<String> {
        vec![
            "ip".into(),
            "netns".into(),
            "exec".into(),
            self.names[i].clone(),
        ]
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        for v in &self.veths {
            let _ = ip(&["link", "del", v]);
        }
        for ns in &self.names {
            let _ = ip(&["netns", "del", ns]);
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

/// Greedy tokens (`n` per prompt) of the default model split over `world` ranks in one
/// process (`greedy_split`, with the workers' default KV dtype), with the prompts `prompts` makes
/// from its tokenizer: what every group test of that size compares against. All collectives add in rank order, so a group of
/// processes computes exactly this; one unsplit process is not an exact reference (row-parallel
/// sums in another order differ in the last bits, which flips greedy near-ties).
pub fn split_tokens(
    prompts: fn(&Loaded) -> Vec<Vec<u32>>,
    n: usize,
    world: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let l = Loaded::open(&default_model_path(), Threads::single()).unwrap();
    let g = GgufFile::open(&default_model_path()).unwrap();
    let prompts = prompts(&l);
    let want = prompts
        .iter()
        .map(|p| greedy_split(&g, world, p, n, KvDtype::default()))
        .collect();
    (prompts, want)
}
