//! A request whose decode worker fails before streaming anything is placed again: gRPC decode
//! workers that answer `UNAVAILABLE` (a worker whose group just failed), fail the stream
//! before its first event, or abort the request before its first token sit next to a healthy
//! one; every request still gets the healthy worker's tokens. A worker's `INVALID_ARGUMENT`
//! stays the client's error (not retried elsewhere).

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use cleave_kv_index::WorkerId;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use cleave_router::api::backend::{Backend, BackendError, BackendEvent, BackendRequest};
use cleave_router::dispatch::{Cluster, Dispatcher};
use cleave_router::place::{BuildPolicy, PlaceConfig, PolicyKind, Role};
use cleave_text::sample::SamplingParams;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

#[derive(Clone, Copy)]
enum Behaviour {
    Serve,
    RefuseCall,
    FailFirstEvent,
    AbortBeforeFirstToken,
    BadRequest,
}

struct Fake {
    behaviour: Behaviour,
    calls: Arc<AtomicUsize>,
}

type Events = Pin<Box<dyn Stream<Item = Result<pb::GenerateEvent, Status>> + Send>>;

fn finished(reason: pb::FinishReason, completion_tokens: u32) -> pb::GenerateEvent {
    pb::GenerateEvent {
        event: Some(pb::generate_event::Event::Finished(pb::Finished {
            reason: reason.into(),
            prompt_tokens: 3,
            completion_tokens,
            ..Default::default()
        })),
    }
}

#[tonic::async_trait]
impl DecodeWorker for Fake {
    type GenerateStream = Events;
    type WatchStream = Events2;

    async fn generate(&self, _: Request<pb::GenerateRequest>) -> Result<Response<Events>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let events: Vec<Result<pb::GenerateEvent, Status>> = match self.behaviour {
            Behaviour::Serve => vec![
                Ok(pb::GenerateEvent {
                    event: Some(pb::generate_event::Event::Token(pb::Token {
                        id: 42,
                        text: "ok".into(),
                        ..Default::default()
                    })),
                }),
                Ok(finished(pb::FinishReason::Length, 1)),
            ],
            Behaviour::RefuseCall => {
                return Err(Status::unavailable(
                    "the engine stopped: a rank of its worker group failed",
                ))
            }
            Behaviour::FailFirstEvent => vec![Err(Status::internal("collective failed"))],
            Behaviour::AbortBeforeFirstToken => vec![Ok(finished(pb::FinishReason::Aborted, 0))],
            Behaviour::BadRequest => {
                return Err(Status::invalid_argument("token id 99999 is outside"))
            }
        };
        Ok(Response::new(Box::pin(tokio_stream::iter(events))))
    }

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Events2>, Status> {
        Err(Status::unimplemented("not used"))
    }
}

type Events2 = Pin<Box<dyn Stream<Item = Result<pb::WorkerUpdate, Status>> + Send>>;

/// Serves a fake decode worker; returns its endpoint and call counter.
async fn start(behaviour: Behaviour) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = DecodeWorkerServer::new(Fake {
        behaviour,
        calls: calls.clone(),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (format!("http://{addr}"), calls)
}

fn request(i: usize) -> BackendRequest {
    BackendRequest {
        request_id: format!("r{i}"),
        prompt: vec![1, 2, 3],
        params: SamplingParams {
            max_tokens: 1,
            ..Default::default()
        },
        traceparent: None,
    }
}

/// A dispatcher (round-robin) over healthy decode workers with these behaviours.
async fn dispatcher(behaviours: &[Behaviour]) -> (Dispatcher, Vec<Arc<AtomicUsize>>) {
    let cluster = Arc::new(Cluster::default());
    let mut counters = Vec::new();
    for (i, b) in behaviours.iter().enumerate() {
        let (endpoint, calls) = start(*b).await;
        let id = WorkerId(i as u64 + 1);
        cluster.add(id, Role::Decode, &endpoint).unwrap();
        cluster.placement().set_healthy(id, true);
        counters.push(calls);
    }
    let policy = PolicyKind::RoundRobin.build(&PlaceConfig::default());
    (Dispatcher::new(cluster, policy, "m".into()), counters)
}

async fn tokens(d: &Dispatcher, i: usize) -> Vec<u32> {
    let mut s = d.generate(request(i)).await.expect("placed");
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        match ev {
            BackendEvent::Token { id, .. } => out.push(id),
            BackendEvent::Finished { .. } => break,
            BackendEvent::Error(e) | BackendEvent::Lost(e) => panic!("request {i} failed: {e}"),
        }
    }
    out
}

#[tokio::test]
async fn requests_failing_before_their_first_token_are_placed_again() {
    for bad in [
        Behaviour::RefuseCall,
        Behaviour::FailFirstEvent,
        Behaviour::AbortBeforeFirstToken,
    ] {
        let (d, calls) = dispatcher(&[bad, Behaviour::Serve]).await;
        for i in 0..4 {
            assert_eq!(tokens(&d, i).await, vec![42]);
        }
        assert!(
            calls[0].load(Ordering::SeqCst) >= 1,
            "the bad worker was tried"
        );
        assert_eq!(calls[1].load(Ordering::SeqCst), 4);
    }
}

#[tokio::test]
async fn a_workers_invalid_argument_is_the_clients_error() {
    let (d, calls) = dispatcher(&[Behaviour::BadRequest, Behaviour::Serve]).await;
    // Round-robin starts at the first worker.
    match d.generate(request(0)).await {
        Err(BackendError::BadRequest(m)) => assert!(m.contains("outside"), "{m}"),
        other => panic!("expected BadRequest, got {:?}", other.map(|_| "a stream")),
    }
    assert_eq!(calls[1].load(Ordering::SeqCst), 0);
}
