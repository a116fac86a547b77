//! etcd discovery end to end: a private etcd-server, a real decode worker registering in it and
//! a router with no static workers that finds it, serves a completion through it, and drops it
//! once the worker stops (its lease revoked).

use std::net::TcpListener as StdListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;
use cleave_router::config::RouterConfig;
use cleave_text::gguf::default_model_path;
use cleave_worker::WorkerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const ETCD: &str = "/usr/bin/etcd";

/// A private etcd, killed on drop.
struct EtcdServer {
    child: Child,
    endpoint: String,
    _dir: TempDir,
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A directory removed on drop.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn start_etcd() -> EtcdServer {
    let dir = std::env::temp_dir().join(format!(
        "cleave-etcd-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (client, peer) = (free_port(), free_port());
    let endpoint = format!("http://127.0.0.1:{client}");
    let child = Command::new(ETCD)
        .arg("--data-dir")
        .arg(&dir)
        .args(["--listen-client-urls", &endpoint])
        .args(["--advertise-client-urls", &endpoint])
        .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
        .args([
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer}"),
        ])
        .args([
            "--initial-cluster",
            &format!("default=http://127.0.0.1:{peer}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting etcd");
    let server = EtcdServer {
        child,
        endpoint,
        _dir: TempDir(dir),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(mut c) = etcd_client::Client::connect([server.endpoint.as_str()], None).await {
            if c.get("probe", None).await.is_ok() {
                return server;
            }
        }
        assert!(Instant::now() < deadline, "etcd did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    router: RouterConfig,
}

/// POSTs `body` to `path` over a raw HTTP/1.1 connection; returns (status, body).
async fn post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1)
        .unwrap_or("")
        .to_string();
    (status, body)
}

async fn wait_for(what: &str, secs: u64, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_discovers_and_drops_an_etcd_registered_worker() {
    if !Path::new(ETCD).exists() {
        eprintln!("SKIPPED: etcd not installed ({ETCD} missing; apt-get install etcd-server)");
        return;
    }
    let model = default_model_path();
    if !model.exists() {
        eprintln!("SKIPPED: model {} not present", model.display());
        return;
    }
    let etcd = start_etcd().await;
    let prefix = "/test/workers/";

    let router_stop = CancellationToken::new();
    let cli = Cli::parse_from([
        "router",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model.to_str().unwrap(),
        "--etcd",
        &etcd.endpoint,
        "--etcd-prefix",
        prefix,
    ]);
    let router = cleave_router::serve::run(cli.router, router_stop.clone())
        .await
        .expect("router starts with etcd and no static workers");
    assert!(router.cluster.all().is_empty());

    let worker_stop = CancellationToken::new();
    let worker = cleave_worker::run(
        cleave_decode_worker::SERVICE,
        WorkerConfig {
            kv_blocks: Some(64),
            step_tokens: 32,
            prefill_tokens_while_decoding: 0,
            prefill_timeout: Duration::from_secs(20),
            etcd: Some(etcd.endpoint.clone()),
            etcd_prefix: prefix.into(),
            // Longer than the wait below: the worker must go because its lease is revoked, not expired.
            etcd_lease_ttl: Duration::from_secs(30),
            ..WorkerConfig::defaults(model.clone())
        },
        worker_stop.clone(),
    )
    .await
    .expect("worker starts and registers");

    let cluster = router.cluster.clone();
    wait_for("the router to find the worker", 20, || {
        cluster.placement().healthy_decode_workers() > 0
    })
    .await;
    let all = cluster.all();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].endpoint, format!("http://{}", worker.grpc_addr));

    let (status, body) = post(
        router.addr,
        "/v1/completions",
        &format!(
            r#"{{"model":"{}","prompt":"The capital of France is","max_tokens":4}}"#,
            model.file_stem().unwrap().to_string_lossy()
        ),
    )
    .await;
    assert_eq!(status, 200, "completion failed: {body}");
    assert!(body.contains("\"choices\""), "{body}");

    worker_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), worker.task).await;
    wait_for("the router to drop the worker", 5, || {
        cluster.all().is_empty()
    })
    .await;

    router_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), router.task).await;
}
