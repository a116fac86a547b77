//! A worker owns the tasks it spawns for each request: a `Generate` call's relay task is in
//! the worker's tracker while its stream runs and leaves it when the client goes away, and a
//! stopping worker's task ends only once every tracked task has.

use crate::common;

use std::time::Duration;

use cleave_decode_worker::SERVICE as DECODE;
use cleave_kv_transfer::BackendChoice;
use cleave_proto::v1 as pb;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use cleave_worker::{run, Running};
use common::{config, greedy, prompts, settle};
use tokio_util::sync::CancellationToken;

/// Longest wait for something the test waits on (a guard against hanging, not a timing check).
const PATIENCE: Duration = Duration::from_secs(60);

async fn tasks_back_to(w: &Running, n: usize) {
    tokio::time::timeout(PATIENCE, async {
        while w.state.tasks.len() != n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{} tasks left, not {n}", w.state.tasks.len()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_task_is_tracked_and_ends_with_its_stream() {
    let stop = CancellationToken::new();
    let mut decode = run(DECODE, config(BackendChoice::Tcp), stop.clone())
        .await
        .unwrap();
    // The worker's own background tasks (the KV-event collector, the failure watch).
    let background = decode.state.tasks.len();
    assert!(background >= 1, "the background tasks are tracked too");

    let mut client = DecodeWorkerClient::connect(format!("http://{}", decode.grpc_addr))
        .await
        .unwrap();
    let req = pb::GenerateRequest {
        request_id: "tracked".into(),
        prompt: prompts().remove(0),
        params: Some(greedy(2_000)),
        prefill_endpoint: None,
        resume: Vec::new(),
    };
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let first = stream.message().await.unwrap().expect("a first token");
    assert!(matches!(
        first.event,
        Some(pb::generate_event::Event::Token(_))
    ));
    assert_eq!(
        decode.state.tasks.len(),
        background + 1,
        "the request's relay task is the worker's"
    );

    // The client goes away: the relay task notices, cancels the sequence and ends.
    drop(stream);
    drop(client);
    tasks_back_to(&decode, background).await;
    assert_eq!(settle(&decode).await.pool.used, 0);

    stop.cancel();
    tokio::time::timeout(PATIENCE, &mut decode.task)
        .await
        .expect("the worker stops")
        .expect("its task does not panic")
        .expect("it stops cleanly");
    assert!(decode.state.tasks.is_closed() && decode.state.tasks.is_empty());
}
