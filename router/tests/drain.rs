//! A stopping router drains for `--drain-period` (what the operator sets for pods behind a
//! Service): it keeps serving, also on new connections, tells each client `Connection: close`
//! so that kept-alive connections move to another router, answers `/ready` with 503, and
//! stops once the period is over.

use crate::support;

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use support::{chat, worker, Router, PATIENCE};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// One kept-alive HTTP/1.1 connection; the handle ends when the connection closes.
async fn connect(addr: SocketAddr) -> (SendRequest<Full<Bytes>>, JoinHandle<()>) {
    let tcp = TcpStream::connect(addr).await.expect("the router accepts");
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .expect("HTTP/1.1 handshake");
    (send, tokio::spawn(async move { conn.await.unwrap_or(()) }))
}

async fn send(
    send: &mut SendRequest<Full<Bytes>>,
    method: &str,
    path: &str,
    body: Option<String>,
) -> Response<Incoming> {
    send.ready().await.expect("the connection is usable");
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .unwrap();
    send.send_request(req).await.expect("an answer")
}

fn closes(r: &Response<Incoming>) -> bool {
    r.headers()
        .get("connection")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_router_serves_and_moves_clients_off_kept_alive_connections() {
    let Some(model) = support::model() else {
        return;
    };
    let (decode, _gate) = worker(true).await;
    // Far longer than the test: everything below happens inside the drain.
    let router = Router::start(&model, &decode, &["--drain-period", "10m"]).await;
    let (mut kept, kept_conn) = connect(router.addr()).await;
    let r = send(&mut kept, "GET", "/ready", None).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(!closes(&r), "before the signal, connections are kept alive");

    router.shutdown.cancel();
    tokio::time::timeout(PATIENCE, router.running.draining.cancelled())
        .await
        .expect("the drain begins");

    // A request on the connection kept alive from before the signal is served, and told to
    // close; the connection then ends.
    let r = send(
        &mut kept,
        "POST",
        "/v1/chat/completions",
        Some(chat(false, 2)),
    )
    .await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(closes(&r), "a draining router says Connection: close");
    let body = r.into_body().collect().await.expect("the body").to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("chat.completion"),
        "{body:?}"
    );
    tokio::time::timeout(PATIENCE, kept_conn)
        .await
        .expect("the kept-alive connection closes after that answer")
        .expect("the connection task does not panic");

    // New connections are still accepted (kube-proxy may still send them here); `/ready` says
    // the router is going.
    let (mut fresh, _conn) = connect(router.addr()).await;
    let r = send(&mut fresh, "GET", "/ready", None).await;
    assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(closes(&r));
    assert!(!router.running.task.is_finished(), "the router still runs");
    router.running.task.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_period_ends_in_a_stop() {
    let Some(model) = support::model() else {
        return;
    };
    let (decode, _gate) = worker(true).await;
    let mut router = Router::start(&model, &decode, &["--drain-period", "300ms"]).await;
    let addr = router.addr();
    router.shutdown.cancel();
    tokio::time::timeout(PATIENCE, &mut router.running.task)
        .await
        .expect("the router stops after its drain period")
        .expect("its task does not panic")
        .expect("it stops cleanly");
    assert!(router.running.draining.is_cancelled());
    assert_eq!(router.running.cluster.background_tasks(), 0);
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "a stopped router accepts no connection"
    );
}
