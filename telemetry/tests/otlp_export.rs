//! Span export end to end: a tiny OTLP/HTTP receiver on 127.0.0.1:0, `init` pointed at it,
//! a request span continuing a client `traceparent`, and a next-hop span continuing the
//! first one's. One test per file: `init` installs the process's global subscriber.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::HeaderMap;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use prost::Message;

type Received = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Starts the receiver on its own runtime thread; returns its port.
fn receiver(received: Received) -> u16 {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let app = axum::Router::new().route(
                "/v1/traces",
                axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                    let received = received.clone();
                    async move {
                        assert_eq!(
                            headers.get("content-type").unwrap(),
                            "application/x-protobuf"
                        );
                        let req = ExportTraceServiceRequest::decode(body).expect("protobuf body");
                        received.lock().unwrap().push(req);
                        // An empty ExportTraceServiceResponse.
                        (
                            [("content-type", "application/x-protobuf")],
                            Vec::<u8>::new(),
                        )
                    }
                }),
            );
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap().port()).unwrap();
            axum::serve(listener, app).await.unwrap();
        });
    });
    rx.recv_timeout(Duration::from_secs(10)).unwrap()
}

#[test]
fn spans_reach_the_otlp_http_receiver_in_the_clients_trace() {
    let received = Received::default();
    let port = receiver(received.clone());
    std::env::set_var(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        format!("http://127.0.0.1:{port}"),
    );
    let guard = cleave_telemetry::init("cleave-telemetry-test");
    assert!(cleave_telemetry::exporting());

    let client = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let api = tracing::info_span!("api");
    cleave_telemetry::set_parent(&api, Some(&client));
    let onward = api.in_scope(|| {
        tracing::info!("inside the request span");
        cleave_telemetry::traceparent_of(&api).expect("exporting, so the span has a context")
    });
    assert!(
        onward.starts_with(&format!("00-{CLIENT_TRACE}-")),
        "{onward}"
    );
    // The next hop (another process in production) continues the forwarded traceparent.
    let decode = tracing::info_span!("decode");
    cleave_telemetry::set_parent(&decode, Some(&onward));
    decode.in_scope(|| tracing::info!("inside the hop span"));
    drop(decode);
    drop(api);
    drop(guard); // flushes

    // The flush above is synchronous, but allow for a slow receiver thread.
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans: Vec<_> = received
            .lock()
            .unwrap()
            .iter()
            .flat_map(|r| &r.resource_spans)
            .flat_map(|rs| &rs.scope_spans)
            .flat_map(|ss| ss.spans.clone())
            .collect();
        if spans.len() >= 2 || Instant::now() > deadline {
            break spans;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let by_name = |n: &str| {
        spans
            .iter()
            .find(|s| s.name == n)
            .unwrap_or_else(|| panic!("no span {n} among {spans:?}"))
    };
    let (api, decode) = (by_name("api"), by_name("decode"));
    assert_eq!(hex(&api.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&decode.trace_id), CLIENT_TRACE);
    assert_eq!(hex(&api.parent_span_id), CLIENT_SPAN);
    assert_eq!(decode.parent_span_id, api.span_id);
    assert_eq!(
        onward,
        format!("00-{CLIENT_TRACE}-{}-01", hex(&api.span_id))
    );

    let service = received.lock().unwrap()[0].resource_spans[0]
        .resource
        .as_ref()
        .unwrap()
        .attributes
        .iter()
        .find(|kv| kv.key == "service.name")
        .and_then(|kv| kv.value.clone())
        .map(|v| format!("{v:?}"))
        .unwrap();
    assert!(service.contains("cleave-telemetry-test"), "{service}");
}
