//! What the TLS and per-key-limit tests share: a fake decode worker over real gRPC whose
//! streams can be held open by a gate, and a router started with `serve::run` on port 0 with
//! flags parsed like the binary's.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use clap::Parser;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use cleave_router::config::RouterConfig;
use cleave_router::serve::Running;
use tokio::sync::watch;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Longest wait for something a test waits on (a guard against hanging, not a timing check).
pub const PATIENCE: Duration = Duration::from_secs(60);

type Events = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;
type Updates = Pin<Box<dyn Stream<Item = Result<pb::WorkerUpdate, Status>> + Send>>;

/// A decode worker that answers every request with two tokens; the second (and the end of
/// the stream) waits until the gate is open. Its usage reports no cached tokens, or the whole
/// prompt when `all_cached`.
struct Fake {
    gate: watch::Receiver<bool>,
    all_cached: bool,
}

fn token(id: u32, text: &str) -> pb::GenerateEvent {
    pb::GenerateEvent {
        event: Some(pb::generate_event::Event::Token(pb::Token {
            id,
            text: text.into(),
            ..Default::default()
        })),
    }
}

#[tonic::async_trait]
impl DecodeWorker for Fake {
    type GenerateStream = Events;
    type WatchStream = Updates;

    async fn generate(
        &self,
        req: Request<pb::GenerateRequest>,
    ) -> Result<Response<Events>, Status> {
        let prompt_tokens = req.get_ref().prompt.len() as u32;
        let cached_tokens = if self.all_cached { prompt_tokens } else { 0 };
        let mut gate = self.gate.clone();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            let _ = tx.send(Ok(token(42, "ok"))).await;
            // An error means the test dropped the gate: open.
            let _ = gate.wait_for(|open| *open).await;
            let _ = tx.send(Ok(token(42, " ok"))).await;
            let finished = pb::GenerateEvent {
                event: Some(pb::generate_event::Event::Finished(pb::Finished {
                    reason: pb::FinishReason::Length.into(),
                    prompt_tokens,
                    completion_tokens: 2,
                    cached_tokens,
                    ..Default::default()
                })),
            };
            let _ = tx.send(Ok(finished)).await;
        });
        let events = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(Response::new(Box::pin(events)))
    }

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Updates>, Status> {
        let first = tokio_stream::iter(vec![Ok(pb::WorkerUpdate::default())]);
        Ok(Response::new(Box::pin(
            first.chain(tokio_stream::pending()),
        )))
    }
}

/// A fake decode worker's endpoint and the sender of its gate (`true`: streams finish).
pub async fn worker(open: bool) -> (String, watch::Sender<bool>) {
    fake(open, false).await
}

/// [`worker`] whose usage says it had every prompt token cached.
pub async fn worker_with_all_cached(open: bool) -> (String, watch::Sender<bool>) {
    fake(open, true).await
}

async fn fake(open: bool, all_cached: bool) -> (String, watch::Sender<bool>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, gate) = watch::channel(open);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DecodeWorkerServer::new(Fake { gate, all_cached }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), tx)
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    config: RouterConfig,
}

/// The model whose tokenizer the router reads; `None` (test skipped, said on stderr) when
/// it is not there.
pub fn model() -> Option<PathBuf> {
    let model = cleave_text::gguf::default_model_path();
    if model.exists() {
        Some(model)
    } else {
        eprintln!(
            "SKIPPED: model {} not present (run `cleave model fetch`)",
            model.display()
        );
        None
    }
}

/// A router over the worker at `decode` with these extra flags, ready to serve.
pub struct Router {
    pub running: Running,
    pub shutdown: CancellationToken,
}

/// The router's configuration over the worker at `decode` with these extra flags, parsed as the
/// binary parses them.
pub fn config(model: &Path, decode: &str, flags: &[&str]) -> RouterConfig {
    let model = model.display().to_string();
    let argv = [
        &[
            "cleave-router",
            "--model",
            &model,
            "--listen",
            "127.0.0.1:0",
            "--decode",
            decode,
            "--policy",
            "round-robin",
            "--served-model-name",
            "m",
        ][..],
        flags,
    ]
    .concat();
    Cli::try_parse_from(argv).expect("router flags").config
}

impl Router {
    pub async fn start(model: &Path, decode: &str, flags: &[&str]) -> Router {
        let config = config(model, decode, flags);
        let shutdown = CancellationToken::new();
        let running = cleave_router::serve::run(config, shutdown.clone())
            .await
            .expect("router starts");
        // Wait until the router has seen the worker (its Watch stream).
        tokio::time::timeout(PATIENCE, async {
            loop {
                let ready = running.cluster.placement().view().iter().any(|w| w.healthy);
                if ready {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the router sees its decode worker");
        Router { running, shutdown }
    }

    pub fn addr(&self) -> SocketAddr {
        self.running.addr
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Waits until `rx` moves past what it holds now (a reload took effect).
pub async fn next_generation(rx: &mut watch::Receiver<u64>) {
    let now = *rx.borrow_and_update();
    tokio::time::timeout(PATIENCE, rx.wait_for(|g| *g > now))
        .await
        .expect("the reload happens")
        .expect("the router is alive");
}

/// A fresh directory for one test's files.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cleave-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Replaces `path`'s contents atomically (write aside, rename), as Kubernetes and
/// cert-manager do.
pub fn replace(path: &Path, contents: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A chat body.
pub fn chat(stream: bool, max_tokens: usize) -> String {
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": "Hi!"}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}
