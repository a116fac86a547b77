//! vLLM-format KV events over real ZeroMQ sockets on loopback: a PUB publisher and a ROUTER
//! replay endpoint in the test (the `zeromq` crate), emitting msgspec's bytes (the golden
//! payloads of tests/data/vllm-kv-events and batches built the same way), into the router's
//! prefix index; then placements on a pool of fake engine pods (HTTP servers that answer
//! `/health` and stream `/v1/completions`) by `prefix-load`.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::{get, post};
use bytes::Bytes;
use cleave_kv_index::WorkerId;
use cleave_router::api::backend::{Backend, BackendEvent, BackendRequest};
use cleave_router::dispatch::Cluster;
use cleave_router::events::{
    subscribe, ChainConfig, FeedStats, PodDefaults, PodSpec, Pool, Source,
};
use cleave_router::place::view::RECENT_HALF_LIFE_PER_WORKER;
use cleave_router::place::{BuildPolicy, PlaceConfig, PolicyKind, Role};
use cleave_types::kv::block_hashes;
use rmpv::Value;
use tokio::sync::watch;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const ARRAY_0: &[u8] = include_bytes!("data/vllm-kv-events/array-0.msgpack");
const MAP_0: &[u8] = include_bytes!("data/vllm-kv-events/map-0.msgpack");
const MAP_1: &[u8] = include_bytes!("data/vllm-kv-events/map-1.msgpack");
const WAIT: Duration = Duration::from_secs(20);

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

fn tokens(r: std::ops::Range<u32>) -> Vec<u32> {
    r.collect()
}

/// An array-like batch (vLLM ≤ 0.11 / SGLang) of one `BlockStored` with integer hashes.
fn stored_batch(hashes: &[u64], parent: Option<u64>, toks: &[u32]) -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Array(vec![
            "BlockStored".into(),
            Value::Array(hashes.iter().map(|&h| h.into()).collect()),
            parent.map_or(Value::Nil, Value::from),
            Value::Array(toks.iter().map(|&t| t.into()).collect()),
            16.into(),
            Value::Nil,
            "GPU".into(),
            Value::Nil,
            Value::Nil,
            Value::Nil,
        ])]),
        0.into(),
    ]))
}

/// A current-vLLM map batch removing integer hashes.
fn removed_batch(hashes: &[u64]) -> Vec<u8> {
    let ev = Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        (
            "block_hashes".into(),
            Value::Array(hashes.iter().map(|&h| h.into()).collect()),
        ),
        ("medium".into(), "GPU".into()),
    ]);
    encode(&Value::Map(vec![
        ("ts".into(), Value::F64(2.0)),
        ("events".into(), Value::Array(vec![ev])),
        ("data_parallel_rank".into(), 0.into()),
    ]))
}

fn empty_batch() -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::F64(0.5),
        Value::Array(vec![]),
        0.into(),
    ]))
}

/// Published batches kept for replay: `(seq, payload)`, oldest first.
type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Vec<u8>)>>>;

/// A vLLM-style publisher: PUB frames `[topic, seq, payload]` and a ROUTER replay endpoint
/// serving what `buffer` holds.
struct Publisher {
    socket: PubSocket,
    events: String,
    replay: String,
    buffer: ReplayBuffer,
}

impl Publisher {
    async fn start() -> Publisher {
        let mut socket = PubSocket::new();
        let events = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let mut router = RouterSocket::new();
        let replay = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        let buffer: ReplayBuffer = Arc::default();
        let buf = buffer.clone();
        tokio::spawn(async move {
            while let Ok(req) = router.recv().await {
                let frames = req.into_vec();
                // [identity, "", start seq]
                assert_eq!(frames.len(), 3, "replay request frames");
                assert!(frames[1].is_empty());
                let start = u64::from_be_bytes(frames[2].as_ref().try_into().unwrap());
                let batches: Vec<_> = buf
                    .lock()
                    .unwrap()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                let reply = |seq: Bytes, payload: Bytes| {
                    ZmqMessage::try_from(vec![frames[0].clone(), Bytes::new(), seq, payload])
                        .unwrap()
                };
                for (seq, payload) in batches {
                    let m = reply(
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        Bytes::from(payload),
                    );
                    router.send(m).await.unwrap();
                }
                let end = reply(Bytes::copy_from_slice(&[0xff; 8]), Bytes::new());
                router.send(end).await.unwrap();
            }
        });
        Publisher {
            socket,
            events,
            replay,
            buffer,
        }
    }

    /// Buffers batch `seq` for replay without publishing it (a message the subscriber misses).
    fn buffer_only(&self, seq: u64, payload: &[u8]) {
        self.buffer
            .lock()
            .unwrap()
            .push_back((seq, payload.to_vec()));
    }

    /// Buffers and publishes batch `seq`.
    async fn publish(&mut self, seq: u64, payload: &[u8]) {
        self.buffer_only(seq, payload);
        let m = ZmqMessage::try_from(vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ])
        .unwrap();
        self.socket.send(m).await.unwrap();
    }

    /// Publishes empty batches from `seq` on until the subscriber has applied one (a SUB
    /// socket only gets what is published after its subscription arrived); returns the next
    /// free sequence number.
    async fn sync(&mut self, mut seq: u64, rx: &mut watch::Receiver<FeedStats>) -> u64 {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            self.publish(seq, &empty_batch()).await;
            seq += 1;
            let seen = tokio::time::timeout(
                Duration::from_millis(50),
                rx.wait_for(|s| s.last_seq.is_some()),
            )
            .await;
            if matches!(seen, Ok(Ok(_))) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "subscriber never got a batch"
            );
        }
        // Whatever went out before is applied (live or replayed) once the last one is.
        let last = seq - 1;
        wait(rx, |s| s.last_seq == Some(last)).await;
        seq
    }
}

async fn wait(rx: &mut watch::Receiver<FeedStats>, f: impl FnMut(&FeedStats) -> bool) -> FeedStats {
    *tokio::time::timeout(WAIT, rx.wait_for(f))
        .await
        .expect("feed state in time")
        .expect("feed alive")
}

fn matched(cluster: &Cluster, w: WorkerId, prompt: &[u32]) -> usize {
    cluster
        .placement()
        .with_index(|i| i.find_matches(&block_hashes(prompt, 16, 0)))
        .matched(w)
}

#[tokio::test]
async fn events_gap_replay_and_restart_keep_the_index_right() {
    let mut publisher = Publisher::start().await;
    let cluster = Arc::new(Cluster::default());
    let w = WorkerId(0);
    cluster.add(w, Role::Both, "http://127.0.0.1:1").unwrap();
    let shutdown = CancellationToken::new();
    let mut source = Source::new(publisher.events.clone());
    source.replay = Some(publisher.replay.clone());
    let mut rx = subscribe::spawn(
        cluster.clone(),
        w,
        source,
        ChainConfig::default(),
        shutdown.clone(),
    );

    // Batch 0 (golden, array-like, integer hashes: 2 blocks of tokens 100..132) may go out
    // before the subscription lands; the first batch the router sees is then not 0 and it
    // replays from 0, so the blocks are there either way.
    publisher.publish(0, ARRAY_0).await;
    let mut seq = publisher.sync(1, &mut rx).await;
    let prompt = tokens(100..180);
    assert_eq!(matched(&cluster, w, &prompt), 2);
    assert_eq!(cluster.placement().with_index(|i| i.worker_blocks(w)), 2);

    // A gap: batch `seq` (a third block) is only in the replay buffer; the next one (a fourth
    // block, its child) is published. The router replays the missing batch first.
    let big = (1u64 << 63) + 12;
    publisher.buffer_only(seq, &stored_batch(&[21], Some(big), &tokens(132..148)));
    publisher
        .publish(seq + 1, &stored_batch(&[22], Some(21), &tokens(148..164)))
        .await;
    let s = wait(&mut rx, |s| s.last_seq == Some(seq + 1)).await;
    assert_eq!((s.gaps, s.lost), (1, 0));
    assert!(s.replayed >= 1, "{s:?}");
    assert_eq!(matched(&cluster, w, &prompt), 4);
    seq += 2;

    // A gap the replay buffer cannot close (the batch is gone from it): counted as lost; the
    // batch after it (removing the fourth block, map encoding) still applies.
    publisher.publish(seq + 1, &removed_batch(&[22])).await;
    let s = wait(&mut rx, |s| s.last_seq == Some(seq + 1)).await;
    assert_eq!((s.gaps, s.lost), (2, 1));
    assert_eq!(matched(&cluster, w, &prompt), 3);
    seq += 2;

    // Golden map payloads with byte-string hashes: the same tokens as batch 0 (held twice
    // now, so still 3 blocks), then a removal of one of them and AllBlocksCleared.
    publisher.publish(seq, MAP_0).await;
    wait(&mut rx, |s| s.last_seq == Some(seq)).await;
    assert_eq!(cluster.placement().with_index(|i| i.worker_blocks(w)), 3);
    publisher.publish(seq + 1, MAP_1).await;
    wait(&mut rx, |s| s.last_seq == Some(seq + 1)).await;
    assert_eq!(cluster.placement().with_index(|i| i.worker_blocks(w)), 0);

    // The engine restarts: its sequence starts at 0 again and its cache is empty.
    publisher
        .publish(seq + 2, &stored_batch(&[31], None, &tokens(0..16)))
        .await;
    wait(&mut rx, |s| s.last_seq == Some(seq + 2)).await;
    assert_eq!(cluster.placement().with_index(|i| i.worker_blocks(w)), 1);
    publisher.publish(0, ARRAY_0).await;
    let s = wait(&mut rx, |s| s.restarts == 1 && s.last_seq == Some(0)).await;
    assert_eq!(s.bad, 0);
    assert_eq!(
        matched(&cluster, w, &tokens(0..16)),
        0,
        "dropped on restart"
    );
    assert_eq!(matched(&cluster, w, &prompt), 2);
    shutdown.cancel();
}

/// A fake engine pod: `/health`, and `/v1/completions` streaming two chunks; it records the
/// request bodies it got.
async fn fake_pod() -> (String, Arc<Mutex<Vec<serde_json::Value>>>) {
    let seen: Arc<Mutex<Vec<serde_json::Value>>> = Arc::default();
    let log = seen.clone();
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/completions",
            post(move |axum::Json(body): axum::Json<serde_json::Value>| {
                let log = log.clone();
                async move {
                    log.lock().unwrap().push(body);
                    let sse = concat!(
                        "data: {\"choices\":[{\"index\":0,\"text\":\" Paris\",\"finish_reason\":null}]}\n\n",
                        "data: {\"choices\":[{\"index\":0,\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n",
                        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":70,\"completion_tokens\":1,",
                        "\"prompt_tokens_details\":{\"cached_tokens\":64}}}\n\n",
                        "data: [DONE]\n\n"
                    );
                    ([("content-type", "text/event-stream")], sse)
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, seen)
}

#[tokio::test]
async fn prefix_load_places_requests_on_the_pod_holding_the_prefix() {
    let shutdown = CancellationToken::new();
    let mut pubs = Vec::new();
    let mut pods = Vec::new();
    let mut logs = Vec::new();
    for _ in 0..2 {
        let p = Publisher::start().await;
        let (url, log) = fake_pod().await;
        let spec = format!("{url},events={},replay={}", p.events, p.replay);
        pods.push(PodSpec::parse(&spec, &PodDefaults::default()).unwrap());
        pubs.push(p);
        logs.push(log);
    }
    let cluster = Arc::new(Cluster::default());
    let place = PlaceConfig {
        disagg_min_uncached_blocks: usize::MAX,
        ..Default::default()
    };
    let pool = Pool::start(
        &pods,
        &ChainConfig::default(),
        cluster.clone(),
        PolicyKind::PrefixLoad.build(&place),
        "served".into(),
        shutdown.clone(),
    )
    .unwrap();
    let (w0, w1) = (WorkerId(0), WorkerId(1));
    let mut rx0 = pool.feed(w0).unwrap();
    let mut rx1 = pool.feed(w1).unwrap();
    let next0 = pubs[0].sync(0, &mut rx0).await;
    let next1 = pubs[1].sync(0, &mut rx1).await;

    // Pod 1 holds the 4 blocks of prefix A (current-vLLM map encoding), pod 0 the 4 blocks of
    // prefix B (array-like encoding, two events).
    let a = tokens(5000..5064);
    let b = tokens(9000..9064);
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array((0..4u8).map(|i| Value::Binary(vec![i; 32])).collect()),
        ),
        ("parent_block_hash".into(), Value::Nil),
        (
            "token_ids".into(),
            Value::Array(a.iter().map(|&t| t.into()).collect()),
        ),
        ("block_size".into(), 16.into()),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ]);
    let map_batch = encode(&Value::Map(vec![
        ("ts".into(), Value::F64(3.0)),
        ("events".into(), Value::Array(vec![ev])),
    ]));
    pubs[1].publish(next1, &map_batch).await;
    pubs[0]
        .publish(next0, &stored_batch(&[1, 2], None, &b[..32]))
        .await;
    pubs[0]
        .publish(next0 + 1, &stored_batch(&[3, 4], Some(2), &b[32..]))
        .await;
    wait(&mut rx1, |s| s.last_seq == Some(next1) && s.held == 4).await;
    wait(&mut rx0, |s| s.last_seq == Some(next0 + 1) && s.held == 4).await;
    assert_eq!(matched(&cluster, w1, &a), 4);
    assert_eq!(matched(&cluster, w0, &a), 0);
    assert_eq!(matched(&cluster, w0, &b), 4);

    // Both pods answer /health.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cluster.placement().view().iter().all(|w| w.healthy) {
        assert!(tokio::time::Instant::now() < deadline, "pods never healthy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    for (prompt, pod) in [(&a, 1), (&b, 0), (&a, 1)] {
        let mut p = prompt.clone();
        p.extend(1..7);
        let req = BackendRequest {
            request_id: "r".into(),
            prompt: p.clone(),
            params: cleave_text::sample::SamplingParams {
                max_tokens: 4,
                ..Default::default()
            },
            traceparent: None,
        };
        let events: Vec<BackendEvent> = pool.generate(req).await.unwrap().collect().await;
        assert!(
            matches!(&events[0], BackendEvent::Token { text, .. } if text == " Paris"),
            "{events:?}"
        );
        assert!(matches!(
            events.last(),
            Some(BackendEvent::Finished {
                completion_tokens: 1,
                cached_tokens: 64,
                ..
            })
        ));
        let got = logs[pod]
            .lock()
            .unwrap()
            .pop()
            .expect("the pod got the request");
        assert_eq!(got["prompt"], serde_json::json!(p), "token ids forwarded");
        assert_eq!(got["model"], "served");
        assert_eq!(got["stream"], true);
        assert!(
            logs[1 - pod].lock().unwrap().is_empty(),
            "the other pod got it"
        );
    }
    // A prompt neither pod holds is charged as 5 blocks to compute; the pod's usage says it had
    // 64 tokens cached, so its recent prefill work grows by the 1 block it computed.
    let recent = |w| {
        let view = cluster.placement().view();
        view.get(w).unwrap().recent_prefill_blocks
    };
    let before = [recent(w0), recent(w1)];
    let mut p = tokens(7000..7064);
    p.extend(1..7);
    let req = BackendRequest {
        request_id: "cold".into(),
        prompt: p,
        params: cleave_text::sample::SamplingParams {
            max_tokens: 4,
            ..Default::default()
        },
        traceparent: None,
    };
    let _: Vec<BackendEvent> = pool.generate(req).await.unwrap().collect().await;
    let pod = usize::from(logs[0].lock().unwrap().is_empty());
    assert_eq!(logs[pod].lock().unwrap().len(), 1, "one pod got it");
    let decay = 0.5f64.powf(1.0 / (RECENT_HALF_LIFE_PER_WORKER * 2.0));
    let got = recent(WorkerId(pod as u64));
    assert!(
        (got - (before[pod] * decay + 1.0)).abs() < 1e-9,
        "recent prefill work of pod {pod}: {got}, from {}",
        before[pod]
    );
    // The router's charges were all given back.
    assert!(cluster.placement().no_load_charged());
    shutdown.cancel();
}

#[derive(clap::Parser)]
struct Cli {
    #[command(flatten)]
    router: cleave_router::config::RouterConfig,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_in_kv_events_mode_serves_through_the_pod_holding_the_prefix() {
    use clap::Parser;
    let model = cleave_text::gguf::default_model_path();
    if !model.exists() {
        eprintln!("SKIPPED: model {} not present", model.display());
        return;
    }
    let mut pubs = Vec::new();
    let mut logs = Vec::new();
    let mut args: Vec<String> = [
        "router",
        "--listen",
        "127.0.0.1:0",
        "--model",
        model.to_str().unwrap(),
        "--kv-events",
        "vllm",
    ]
    .map(String::from)
    .to_vec();
    for _ in 0..2 {
        let p = Publisher::start().await;
        let (url, log) = fake_pod().await;
        args.push("--kv-events-pod".into());
        args.push(format!("{url},events={},replay={}", p.events, p.replay));
        pubs.push(p);
        logs.push(log);
    }
    let stop = CancellationToken::new();
    let router = cleave_router::serve::run(Cli::parse_from(&args).router, stop.clone())
        .await
        .expect("router starts in kv-events mode");
    let cluster = router.cluster.clone();

    // Pod 0 stores prefix A (golden array-like batch 0: tokens 100..132); it is published
    // once, and empty batches follow until the router has it (live, or replayed from 0 when
    // its subscription landed after batch 0).
    pubs[0].publish(0, ARRAY_0).await;
    let a = tokens(100..132);
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut seq = 1;
    while matched(&cluster, WorkerId(0), &a) < 2
        || !cluster.placement().view().iter().all(|w| w.healthy)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "router never indexed pod 0"
        );
        pubs[0].publish(seq, &empty_batch()).await;
        seq += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let mut prompt = a.clone();
    prompt.extend(1..7);
    let body = serde_json::json!({
        "model": model.file_stem().unwrap().to_string_lossy(),
        "prompt": prompt,
        "max_tokens": 4,
    });
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", router.addr))
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let v: serde_json::Value = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
    assert_eq!(v["choices"][0]["text"], " Paris", "{v}");
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"], 64,
        "{v}"
    );
    let got = logs[0]
        .lock()
        .unwrap()
        .pop()
        .expect("pod 0 got the request");
    assert_eq!(got["prompt"], serde_json::json!(prompt));
    assert!(logs[1].lock().unwrap().is_empty());
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(5), router.task).await;
}
