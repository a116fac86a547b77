//! A request whose decode worker fails before streaming anything is placed again: gRPC decode
//! workers that answer `UNAVAILABLE` (a worker whose group just failed), fail the stream
//! before its first event, or abort the request before its first token sit next to a healthy
//! one; every request still gets the healthy worker's tokens. A worker's `INVALID_ARGUMENT`
//! stays the client's error (not retried elsewhere). A worker that fails mid-stream has its
//! request migrated: the next worker gets the tokens streamed so far as `resume` and the client's
//! stream goes on without a gap or a repeat.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

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
    /// Streams tokens 10 and 11, then the stream breaks (the worker died mid-stream).
    BreakAfterTwoTokens,
}

struct Fake {
    behaviour: Behaviour,
    calls: Arc<AtomicUsize>,
    /// The `resume` tokens of every call.
    resumes: Arc<Mutex<Vec<Vec<u32>>>>,
}

fn token(id: u32) -> pb::GenerateEvent {
    pb::GenerateEvent {
        event: Some(pb::generate_event::Event::Token(pb::Token {
            id,
            text: format!("t{id}"),
            ..Default::default()
        })),
    }
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

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Events>, Status> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let resume = request.into_inner().resume;
        self.resumes.lock().unwrap().push(resume);
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
            Behaviour::BreakAfterTwoTokens => vec![
                Ok(token(10)),
                Ok(token(11)),
                Err(Status::unavailable("the worker died")),
            ],
        };
        Ok(Response::new(Box::pin(tokio_stream::iter(events))))
    }

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Events2>, Status> {
        Err(Status::unimplemented("not used"))
    }
}

type Events2 = Pin<Box<dyn Stream<Item = Result<pb::WorkerUpdate, Status>> + Send>>;

/// A started fake decode worker.
struct Started {
    endpoint: String,
    calls: Arc<AtomicUsize>,
    resumes: Arc<Mutex<Vec<Vec<u32>>>>,
}

/// Serves a fake decode worker.
async fn start(behaviour: Behaviour) -> Started {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let resumes = Arc::new(Mutex::new(Vec::new()));
    let svc = DecodeWorkerServer::new(Fake {
        behaviour,
        calls: calls.clone(),
        resumes: resumes.clone(),
    });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    Started {
        endpoint: format!("http://{addr}"),
        calls,
        resumes,
    }
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

/// A dispatcher (round-robin, starting at the first) over healthy decode workers with these
/// behaviours, its cluster, and the workers.
async fn started(behaviours: &[Behaviour]) -> (Dispatcher, Arc<Cluster>, Vec<Started>) {
    let cluster = Arc::new(Cluster::default());
    let mut workers = Vec::new();
    for (i, b) in behaviours.iter().enumerate() {
        let w = start(*b).await;
        let id = WorkerId(i as u64 + 1);
        cluster.add(id, Role::Decode, &w.endpoint).unwrap();
        cluster.placement().set_healthy(id, true);
        workers.push(w);
    }
    let policy = PolicyKind::RoundRobin.build(&PlaceConfig::default());
    let d = Dispatcher::new(cluster.clone(), policy, "m".into());
    (d, cluster, workers)
}

/// [`started`], with the workers' call counters.
async fn dispatcher(behaviours: &[Behaviour]) -> (Dispatcher, Vec<Arc<AtomicUsize>>) {
    let (d, _, workers) = started(behaviours).await;
    (d, workers.into_iter().map(|w| w.calls).collect())
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

/// Every event of request `i`, in order.
async fn events(d: &Dispatcher, i: usize) -> Vec<BackendEvent> {
    let mut s = d.generate(request(i)).await.expect("placed");
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        out.push(ev);
    }
    out
}

fn token_ids(events: &[BackendEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            BackendEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_stream_whose_worker_dies_mid_stream_goes_on_from_another_worker() {
    let (d, cluster, workers) = started(&[Behaviour::BreakAfterTwoTokens, Behaviour::Serve]).await;
    let evs = events(&d, 0).await;
    // The client sees the first worker's two tokens, then the second worker's, once each, and
    // the request finishes normally.
    assert_eq!(token_ids(&evs), vec![10, 11, 42]);
    assert!(
        matches!(evs.last(), Some(BackendEvent::Finished { .. })),
        "{evs:?}"
    );
    // The second worker was asked to go on from what the client already has.
    assert_eq!(*workers[0].resumes.lock().unwrap(), vec![Vec::<u32>::new()]);
    assert_eq!(*workers[1].resumes.lock().unwrap(), vec![vec![10, 11]]);
    // The failed worker is out of placement, and every load charge was given back.
    assert_eq!(cluster.placement().healthy_decode_workers(), 1);
    assert!(cluster.placement().no_load_charged());
}

#[tokio::test]
async fn without_migration_a_mid_stream_failure_ends_the_stream_in_an_error() {
    let (d, cluster, workers) = started(&[Behaviour::BreakAfterTwoTokens, Behaviour::Serve]).await;
    let d = d.with_migration_limit(0);
    let evs = events(&d, 0).await;
    assert_eq!(token_ids(&evs), vec![10, 11]);
    match evs.last() {
        Some(BackendEvent::Lost(why)) => assert!(why.contains("--migration-limit 0"), "{why}"),
        other => panic!("expected the stream to be lost, got {other:?}"),
    }
    assert_eq!(workers[1].calls.load(Ordering::SeqCst), 0);
    assert!(cluster.placement().no_load_charged());
}
