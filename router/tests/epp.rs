//! The endpoint picker over real sockets, driven by a tonic ext_proc client that follows
//! Envoy's message order (request headers, request body chunks ending with `end_of_stream`,
//! then the response phase): the picker starts through its real start path (`epp::run` with a
//! tiny Hugging Face model directory for the tokenizer and chat template) and picks among model
//! servers whose vLLM-format `/metrics` are served by axum on loopback.
//!
//! Checked: the request-headers response comes before any body response and names the picked
//! endpoint in the header and the `envoy.lb` metadata (the same value); the body chunks come back
//! unchanged and in order; load decides the pick; the subset hint restricts it; 503 (no ready
//! endpoint, empty or foreign subset) and 429 (every endpoint saturated, counting the picker's
//! own in-flight charges) are immediate responses; bad requests get the router's 4xx; BUFFERED
//! mode routes on the body's answer; grpc.health.v1 answers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use clap::Parser;
use cleave_router::config::RouterConfig;
use cleave_router::epp::{self, protocol};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, CommonResponse, HttpBody, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::Streaming;

/// A tiny HF model directory (byte-level tokenizer, plain chat template), written once.
fn model_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("epp-tiny-llama");
        cleave_text::tiny::write_model(
            &dir,
            cleave_text::tiny::Kind::Llama,
            cleave_text::safetensors::Dtype::F32,
            7,
        )
        .expect("writing the tiny model");
        dir
    })
    .clone()
}

/// A model server's `/metrics` on loopback, its text settable.
struct Metrics {
    addr: SocketAddr,
    text: Arc<Mutex<String>>,
}

fn vllm_text(waiting: u32, running: u32, kv: f64) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}\n\
         vllm:num_requests_running{{model_name=\"m\"}} {running}\n\
         vllm:kv_cache_usage_perc{{model_name=\"m\"}} {kv}\n"
    )
}

async fn metrics_server(text: String) -> Metrics {
    metrics_server_at("127.0.0.1", 0, text)
        .await
        .expect("binding loopback")
}

/// An address nothing listens on.
async fn dead_addr() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    config: RouterConfig,
}

/// Starts the picker over `endpoints` and waits until `healthy` of them are healthy.
async fn start(endpoints: &[SocketAddr], extra: &[&str], healthy: usize) -> epp::Running {
    let dir = model_dir();
    let mut args: Vec<String> = [
        "cleave-router",
        "--mode",
        "endpoint-picker",
        "--model",
        dir.to_str().unwrap(),
        "--served-model-name",
        "tiny",
        "--epp-listen",
        "127.0.0.1:0",
        "--scrape-interval",
        "0.05",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for e in endpoints {
        args.push("--pool-endpoint".into());
        args.push(e.to_string());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let config = Cli::try_parse_from(args).expect("flags").config;
    let running = epp::run(config, CancellationToken::new())
        .await
        .expect("the endpoint picker starts");
    wait_healthy(&running, healthy).await;
    running
}

async fn wait_healthy(running: &epp::Running, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let healthy = {
            let view = running.pool.cluster().placement().view();
            view.iter().filter(|w| w.healthy).count()
        };
        if healthy == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{healthy} healthy pool members, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until member `dest` reports `queue_depth`.
async fn wait_queue(running: &epp::Running, dest: SocketAddr, queue_depth: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let id = running
        .pool
        .destinations()
        .into_iter()
        .find(|(_, d)| *d == dest.to_string())
        .expect("a member")
        .0;
    loop {
        let q = running
            .pool
            .cluster()
            .placement()
            .view()
            .get(id)
            .map(|w| w.reported.queue_depth);
        if q == Some(queue_depth) {
            return;
        }
        assert!(Instant::now() < deadline, "{dest} reports {q:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn channel(addr: SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("an endpoint")
        .connect()
        .await
        .expect("connects")
}

/// One ext_proc stream, as Envoy drives it.
struct Envoy {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

impl Envoy {
    async fn open(addr: SocketAddr) -> Envoy {
        let mut client = ExternalProcessorClient::new(channel(addr).await);
        let (tx, out) = mpsc::channel(16);
        let rx = client
            .process(ReceiverStream::new(out))
            .await
            .expect("process stream")
            .into_inner();
        Envoy { tx, rx }
    }

    async fn send(&self, m: ProcessingRequest) {
        self.tx.send(m).await.expect("stream open");
    }

    async fn recv(&mut self) -> Option<ProcessingResponse> {
        tokio::time::timeout(Duration::from_secs(20), self.rx.message())
            .await
            .expect("an answer in time")
            .expect("a good stream")
    }
}

fn headers(path: &str, end_of_stream: bool) -> HttpHeaders {
    let h = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                h(":method", "POST"),
                h(":path", path),
                h(":authority", "gateway"),
                h("content-type", "application/json"),
            ],
        }),
        end_of_stream,
        ..Default::default()
    }
}

fn request_headers(
    path: &str,
    end_of_stream: bool,
    mode: BodySendMode,
    subset: Option<&[&str]>,
) -> ProcessingRequest {
    let metadata_context = subset.map(|s| Metadata {
        filter_metadata: [(
            protocol::SUBSET_NAMESPACE.to_string(),
            Struct {
                fields: [(
                    protocol::SUBSET_KEY.to_string(),
                    Value {
                        kind: Some(Kind::ListValue(ListValue {
                            values: s
                                .iter()
                                .map(|e| Value {
                                    kind: Some(Kind::StringValue(e.to_string())),
                                })
                                .collect(),
                        })),
                    },
                )]
                .into(),
            },
        )]
        .into(),
        ..Default::default()
    });
    ProcessingRequest {
        metadata_context,
        protocol_config: Some(ProtocolConfiguration {
            request_body_mode: mode as i32,
            response_body_mode: BodySendMode::FullDuplexStreamed as i32,
            send_body_without_waiting_for_header_response: false,
        }),
        request: Some(processing_request::Request::RequestHeaders(headers(
            path,
            end_of_stream,
        ))),
        ..Default::default()
    }
}

/// The headers of a chat completion whose body follows, streamed in full-duplex mode.
fn chat_headers(subset: Option<&[&str]>) -> ProcessingRequest {
    request_headers(
        "/v1/chat/completions",
        false,
        BodySendMode::FullDuplexStreamed,
        subset,
    )
}

fn body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
        })),
        ..Default::default()
    }
}

const CHAT: &str = r#"{"model":"tiny","messages":[{"role":"user","content":"The quick brown fox jumps over the lazy dog, again and again and again."}],"max_tokens":8}"#;

/// `CHAT` in three chunks.
fn chunks() -> Vec<&'static [u8]> {
    let b = CHAT.as_bytes();
    vec![&b[..10], &b[10..50], &b[50..]]
}

/// The destination a request-headers response names, checking header and metadata agree.
fn routed_headers(r: &ProcessingResponse) -> String {
    let Some(processing_response::Response::RequestHeaders(h)) = &r.response else {
        panic!("expected the request-headers response first, got {r:?}");
    };
    destination(h.response.as_ref(), r)
}

fn destination(common: Option<&CommonResponse>, r: &ProcessingResponse) -> String {
    let common = common.expect("a common response");
    assert!(common.clear_route_cache, "the route cache must be cleared");
    let set = &common
        .header_mutation
        .as_ref()
        .expect("header mutation")
        .set_headers;
    let header = set
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == protocol::DESTINATION_HEADER)
        .expect("the destination header");
    let value = String::from_utf8(header.raw_value.clone()).unwrap();
    let md = r.dynamic_metadata.as_ref().expect("dynamic metadata");
    let Some(Kind::StructValue(lb)) = &md.fields[protocol::LB_NAMESPACE].kind else {
        panic!("no envoy.lb metadata: {md:?}");
    };
    assert_eq!(
        lb.fields[protocol::DESTINATION_HEADER].kind,
        Some(Kind::StringValue(value.clone())),
        "header and metadata must name the same endpoints"
    );
    value
}

fn streamed_request_chunk(r: &ProcessingResponse) -> (Vec<u8>, bool) {
    let Some(processing_response::Response::RequestBody(b)) = &r.response else {
        panic!("expected a request body response, got {r:?}");
    };
    match b.response.as_ref().and_then(|c| c.body_mutation.as_ref()) {
        Some(m) => match &m.mutation {
            Some(body_mutation::Mutation::StreamedResponse(s)) => (s.body.clone(), s.end_of_stream),
            other => panic!("not a streamed body: {other:?}"),
        },
        None => panic!("no body mutation: {b:?}"),
    }
}

fn immediate(r: &ProcessingResponse) -> &ImmediateResponse {
    match &r.response {
        Some(processing_response::Response::ImmediateResponse(i)) => i,
        other => panic!("expected an immediate response, got {other:?}"),
    }
}

/// Sends a whole duplex request; returns the picked destination after checking the body
/// comes back in order.
async fn duplex_request(envoy: &mut Envoy, subset: Option<&[&str]>) -> Result<String, u16> {
    envoy.send(chat_headers(subset)).await;
    let parts = chunks();
    for (i, c) in parts.iter().enumerate() {
        envoy.send(body(c, i + 1 == parts.len())).await;
    }
    let first = envoy.recv().await.expect("an answer");
    if let Some(processing_response::Response::ImmediateResponse(i)) = &first.response {
        return Err(i.status.as_ref().map_or(0, |s| s.code as u16));
    }
    let dest = routed_headers(&first);
    for (i, c) in parts.iter().enumerate() {
        let (got, eos) = streamed_request_chunk(&envoy.recv().await.expect("a body chunk"));
        assert_eq!(got, *c, "chunk {i} must come back unchanged and in order");
        assert_eq!(
            eos,
            i + 1 == parts.len(),
            "end_of_stream only on the last chunk"
        );
    }
    Ok(dest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_answer_first_then_the_body_in_order_and_load_decides() {
    let busy = metrics_server(vllm_text(20, 4, 0.9)).await;
    let idle = metrics_server(vllm_text(0, 0, 0.0)).await;
    let running = start(&[busy.addr, idle.addr], &[], 2).await;
    wait_queue(&running, busy.addr, 24).await;
    let mut envoy = Envoy::open(running.addr).await;
    envoy.send(chat_headers(None)).await;
    let parts = chunks();
    envoy.send(body(parts[0], false)).await;
    // Nothing may be answered before the body has ended: the pick needs it.
    assert!(
        tokio::time::timeout(Duration::from_millis(200), envoy.rx.message())
            .await
            .is_err(),
        "the picker answered before the request body ended"
    );
    envoy.send(body(parts[1], false)).await;
    envoy.send(body(parts[2], true)).await;
    let first = envoy.recv().await.expect("headers response");
    let dest = routed_headers(&first);
    assert_eq!(
        dest,
        format!("{},{}", idle.addr, busy.addr),
        "the idle server first, the busy one as fallback"
    );
    for (i, c) in parts.iter().enumerate() {
        let (got, eos) = streamed_request_chunk(&envoy.recv().await.expect("chunk"));
        assert_eq!(got, *c, "chunk {i}");
        assert_eq!(eos, i == 2);
    }
    // The response phase passes through: headers continue, body chunks echoed in order.
    envoy
        .send(ProcessingRequest {
            request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
                end_of_stream: false,
                ..Default::default()
            })),
            ..Default::default()
        })
        .await;
    let r = envoy.recv().await.expect("response headers answer");
    assert!(matches!(
        r.response,
        Some(processing_response::Response::ResponseHeaders(_))
    ));
    // The server's usage says it had the whole prompt cached: the idle server's recent prefill
    // work, charged with the prompt's blocks at the pick, is corrected to none once the response
    // ends.
    let idle_id = running
        .pool
        .destinations()
        .into_iter()
        .find(|(_, d)| *d == idle.addr.to_string())
        .expect("a member")
        .0;
    let recent = || {
        let view = running.pool.cluster().placement().view();
        view.get(idle_id).unwrap().recent_prefill_blocks
    };
    assert!(recent() > 0.0, "the pick charged the prompt's blocks");
    let usage = concat!(
        "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":1,",
        "\"prompt_tokens_details\":{\"cached_tokens\":100000}}}\n\n"
    );
    for (i, chunk) in [&b"data: 1\n\n"[..], usage.as_bytes(), b"data: [DONE]\n\n"]
        .iter()
        .enumerate()
    {
        envoy
            .send(ProcessingRequest {
                request: Some(processing_request::Request::ResponseBody(HttpBody {
                    body: chunk.to_vec(),
                    end_of_stream: i == 2,
                })),
                ..Default::default()
            })
            .await;
        let r = envoy.recv().await.expect("response body answer");
        let Some(processing_response::Response::ResponseBody(b)) = &r.response else {
            panic!("expected a response body answer, got {r:?}");
        };
        match b
            .response
            .as_ref()
            .and_then(|c| c.body_mutation.as_ref())
            .and_then(|m| m.mutation.as_ref())
        {
            Some(body_mutation::Mutation::StreamedResponse(s)) => {
                assert_eq!(&s.body[..], *chunk);
                assert_eq!(s.end_of_stream, i == 2);
            }
            other => panic!("not a streamed response body: {other:?}"),
        }
    }
    assert_eq!(recent(), 0.0, "corrected by the server's cached_tokens");
    // The busy server's load drops: now it is picked.
    *busy.text.lock().unwrap() = vllm_text(0, 0, 0.0);
    *idle.text.lock().unwrap() = vllm_text(30, 2, 0.5);
    wait_queue(&running, idle.addr, 32).await;
    wait_queue(&running, busy.addr, 0).await;
    let mut envoy = Envoy::open(running.addr).await;
    let dest = duplex_request(&mut envoy, None).await.expect("picked");
    assert!(dest.starts_with(&busy.addr.to_string()), "{dest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subset_hint_restricts_the_pick() {
    let busy = metrics_server(vllm_text(20, 4, 0.9)).await;
    let idle = metrics_server(vllm_text(0, 0, 0.0)).await;
    let running = start(&[busy.addr, idle.addr], &[], 2).await;
    wait_queue(&running, busy.addr, 24).await;
    let only_busy = busy.addr.to_string();
    let mut envoy = Envoy::open(running.addr).await;
    let dest = duplex_request(&mut envoy, Some(&[&only_busy])).await;
    assert_eq!(
        dest,
        Ok(only_busy.clone()),
        "only the hinted endpoint, no fallback outside it"
    );
    for subset in [&["10.9.9.9:8000"][..], &[][..]] {
        let mut envoy = Envoy::open(running.addr).await;
        assert_eq!(
            duplex_request(&mut envoy, Some(subset)).await,
            Err(503),
            "{subset:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ready_endpoint_is_an_immediate_503() {
    let dead = dead_addr().await;
    let running = start(&[dead], &[], 0).await;
    let mut envoy = Envoy::open(running.addr).await;
    envoy.send(chat_headers(None)).await;
    envoy.send(body(CHAT.as_bytes(), true)).await;
    let r = envoy.recv().await.expect("an answer");
    let i = immediate(&r);
    assert_eq!(i.status.as_ref().unwrap().code, 503);
    let json: serde_json::Value = serde_json::from_slice(&i.body).expect("JSON body");
    assert!(json["error"]["message"].is_string(), "{json}");
    assert!(envoy.recv().await.is_none(), "the stream ends after it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturated_pool_sheds_with_429_counting_in_flight_picks() {
    let a = metrics_server(vllm_text(0, 0, 0.0)).await;
    let b = metrics_server(vllm_text(0, 0, 0.0)).await;
    let running = start(&[a.addr, b.addr], &["--shed-queue-depth", "1"], 2).await;
    // Two requests held open (their responses not finished): one on each server.
    let mut first = Envoy::open(running.addr).await;
    let d1 = duplex_request(&mut first, None)
        .await
        .expect("first picked");
    let mut second = Envoy::open(running.addr).await;
    let d2 = duplex_request(&mut second, None)
        .await
        .expect("second picked");
    let primary = |d: &str| d.split(',').next().unwrap().to_string();
    assert_ne!(
        primary(&d1),
        primary(&d2),
        "the second goes to the other server"
    );
    let mut third = Envoy::open(running.addr).await;
    assert_eq!(duplex_request(&mut third, None).await, Err(429));
    // The first request finishing frees its server.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let mut envoy = Envoy::open(running.addr).await;
        match duplex_request(&mut envoy, None).await {
            Ok(d) => {
                assert_eq!(primary(&d), primary(&d1));
                break;
            }
            Err(429) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(s) => panic!("status {s} after the first request ended"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_routers_4xx() {
    let s = metrics_server(vllm_text(0, 0, 0.0)).await;
    let running = start(&[s.addr], &[], 1).await;
    for (payload, status) in [
        (&b"{not json"[..], 400),
        (
            br#"{"model":"other","messages":[{"role":"user","content":"hi"}]}"#,
            404,
        ),
        (br#"{"model":"tiny","messages":[]}"#, 400),
    ] {
        let mut envoy = Envoy::open(running.addr).await;
        envoy.send(chat_headers(None)).await;
        envoy.send(body(payload, true)).await;
        let r = envoy.recv().await.expect("an answer");
        assert_eq!(immediate(&r).status.as_ref().unwrap().code, status);
    }
    // A request without a body (e.g. GET /v1/models) is picked at its headers, by load.
    let mut envoy = Envoy::open(running.addr).await;
    envoy
        .send(request_headers(
            "/v1/models",
            true,
            BodySendMode::FullDuplexStreamed,
            None,
        ))
        .await;
    let r = envoy.recv().await.expect("an answer");
    assert_eq!(routed_headers(&r), s.addr.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_mode_routes_on_the_body_answer() {
    let s = metrics_server(vllm_text(0, 0, 0.0)).await;
    let running = start(&[s.addr], &[], 1).await;
    let mut envoy = Envoy::open(running.addr).await;
    envoy
        .send(request_headers(
            "/v1/chat/completions",
            false,
            BodySendMode::Buffered,
            None,
        ))
        .await;
    // In BUFFERED mode Envoy waits for the headers answer before sending the body.
    let r = envoy.recv().await.expect("headers answer");
    let Some(processing_response::Response::RequestHeaders(h)) = &r.response else {
        panic!("expected a headers answer, got {r:?}");
    };
    assert!(h.response.as_ref().unwrap().header_mutation.is_none());
    envoy.send(body(CHAT.as_bytes(), true)).await;
    let r = envoy.recv().await.expect("body answer");
    let Some(processing_response::Response::RequestBody(b)) = &r.response else {
        panic!("expected a body answer, got {r:?}");
    };
    assert_eq!(destination(b.response.as_ref(), &r), s.addr.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_answers() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let s = metrics_server(vllm_text(0, 0, 0.0)).await;
    let running = start(&[s.addr], &[], 1).await;
    let mut client = HealthClient::new(channel(running.addr).await);
    for service in ["", "liveness", "readiness", epp::health::EXT_PROC] {
        let r = client
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("{service:?}: {e}"))
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    let unknown = client
        .check(HealthCheckRequest {
            service: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
}

/// Binds `ip:port` (port 0: any); returns the bound address.
async fn metrics_server_at(ip: &str, port: u16, text: String) -> Option<Metrics> {
    let listener = tokio::net::TcpListener::bind((ip, port)).await.ok()?;
    let addr = listener.local_addr().unwrap();
    let text = Arc::new(Mutex::new(text));
    let shared = text.clone();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let t = shared.lock().unwrap().clone();
            async move { t }
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    Some(Metrics { addr, text })
}

/// The upstream InferencePool CRD applied to a real API server, an InferencePool and its pods
/// (status set by the test: no kubelet runs), and the picker following them: it picks the
/// less loaded pod, drops an unready one, and answers 503 once none is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picks_from_an_inference_pool_in_kubernetes() {
    use k8s_openapi::api::core::v1::Pod;
    use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
    use serde_json::json;

    let Some(client) = cleave_testkube::client("picks_from_an_inference_pool_in_kubernetes").await
    else {
        return;
    };
    cleave_testkube::upstream::install_crd(&client, cleave_testkube::upstream::INFERENCE_POOL_CRD)
        .await;

    // Two model servers on distinct loopback IPs, one port (an InferencePool has one port list).
    let busy = metrics_server_at("127.0.0.2", 0, vllm_text(12, 4, 0.8))
        .await
        .expect("binding 127.0.0.2");
    let port = busy.addr.port();
    let Some(idle) = metrics_server_at("127.0.0.3", port, vllm_text(0, 0, 0.0)).await else {
        panic!("127.0.0.3:{port} is taken; rerun");
    };

    let ns = cleave_testkube::TestNamespace::create(&client, "epp").await;
    let pools: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns.name, &epp::inference_pool::resource());
    let mut pool = DynamicObject::new("models", &epp::inference_pool::resource());
    pool.data = json!({"spec": {
        "selector": {"matchLabels": {"app": "vllm-test"}},
        "targetPorts": [{"number": port}],
        "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}
    }});
    pools
        .create(&PostParams::default(), &pool)
        .await
        .expect("creating the InferencePool");
    let pods = Api::<Pod>::namespaced(client.clone(), &ns.name);
    for (name, app) in [
        ("busy", "vllm-test"),
        ("idle", "vllm-test"),
        ("other", "elsewhere"),
    ] {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": app}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm:test"}]}
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("creating pod {name}: {e}"));
    }
    let set_status = |name: &'static str, ready: bool, ip: &'static str| {
        let pods = pods.clone();
        async move {
            let status = json!({"status": {
                "phase": "Running",
                "podIP": ip,
                "podIPs": [{"ip": ip}],
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
            }});
            pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
                .await
                .unwrap_or_else(|e| panic!("status of {name}: {e}"));
        }
    };
    set_status("busy", true, "127.0.0.2").await;
    set_status("idle", true, "127.0.0.3").await;
    set_status("other", true, "127.0.0.4").await;

    let running = start(
        &[],
        &[
            "--pool",
            "models",
            "--kube-namespace",
            &ns.name,
            "--kube-relist",
            "3600",
        ],
        2,
    )
    .await;
    let mut dests: Vec<String> = running
        .pool
        .destinations()
        .into_iter()
        .map(|(_, d)| d)
        .collect();
    dests.sort();
    assert_eq!(dests, [busy.addr.to_string(), idle.addr.to_string()]);
    wait_queue(&running, busy.addr, 16).await;
    let mut envoy = Envoy::open(running.addr).await;
    let dest = duplex_request(&mut envoy, None).await.expect("picked");
    assert_eq!(dest, format!("{},{}", idle.addr, busy.addr));
    drop(envoy);

    // The idle pod turns unready: the watch takes it out.
    set_status("idle", false, "127.0.0.3").await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while running.pool.destinations().len() != 1 {
        assert!(Instant::now() < deadline, "the unready pod stayed a member");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut envoy = Envoy::open(running.addr).await;
    assert_eq!(
        duplex_request(&mut envoy, None).await,
        Ok(busy.addr.to_string())
    );

    // The last pod is deleted: nothing is left to pick.
    pods.delete("busy", &DeleteParams::default().grace_period(0))
        .await
        .expect("deleting busy");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !running.pool.destinations().is_empty() {
        assert!(Instant::now() < deadline, "the deleted pod stayed a member");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut envoy = Envoy::open(running.addr).await;
    assert_eq!(duplex_request(&mut envoy, None).await, Err(503));
    ns.delete().await;
}
