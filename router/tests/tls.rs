//! HTTPS on the OpenAI endpoint through the whole router (`serve::run` with `--tls-cert`,
//! `--tls-key`, `--tls-client-ca`; a fake gRPC decode worker): certificates from a CA made at
//! test time with rcgen, a rustls client that checks them, HTTP/1.1 and HTTP/2 by ALPN,
//! plain HTTP refused, mutual TLS, and a renewed certificate reaching new connections while a
//! stream on an old connection finishes.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use cleave_tls::testing::{ExtendedKeyUsagePurpose, Issued, TestCa as Ca};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use support::{chat, next_generation, replace, scratch, worker, Router};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// The test's certificates: a server one for `localhost` and 127.0.0.1, and client ones.
trait Issue {
    fn server(&self) -> Issued;
    fn client(&self) -> Issued;
}

impl Issue for Ca {
    fn server(&self) -> Issued {
        self.issue(
            &["localhost", "127.0.0.1"],
            &[ExtendedKeyUsagePurpose::ServerAuth],
        )
    }

    fn client(&self) -> Issued {
        self.issue(&["client.test"], &[ExtendedKeyUsagePurpose::ClientAuth])
    }
}

/// Writes `server`'s certificate and key into `dir`; returns the flags serving them.
fn write_identity(dir: &Path, server: &Issued) -> (String, String) {
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    replace(&key, &server.key_pem);
    replace(&cert, &server.cert_pem);
    (cert.display().to_string(), key.display().to_string())
}

/// The router over `decode`, serving HTTPS as `server` (written into `dir`), with `extra` flags.
async fn https_router(
    model: &Path,
    decode: &str,
    dir: &Path,
    server: &Issued,
    extra: &[&str],
) -> Router {
    let (cert, key) = write_identity(dir, server);
    let mut flags = vec!["--tls-cert", &cert, "--tls-key", &key];
    flags.extend_from_slice(extra);
    Router::start(model, decode, &flags).await
}

fn client_config(
    trusted: &CertificateDer<'static>,
    identity: Option<&Issued>,
    alpn: &[&[u8]],
) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
    let mut config = match identity {
        Some(id) => builder
            .with_client_auth_cert(
                vec![id.der.clone()],
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(id.key_der.clone())),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config
}

async fn connect(
    addr: SocketAddr,
    config: ClientConfig,
    name: &str,
) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from(name.to_string()).unwrap(), tcp)
        .await
}

/// The certificate the server presented on `stream`.
fn peer_cert(stream: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    stream
        .get_ref()
        .1
        .peer_certificates()
        .expect("a server certificate")[0]
        .clone()
}

fn alpn(stream: &TlsStream<TcpStream>) -> Option<Vec<u8>> {
    stream.get_ref().1.alpn_protocol().map(|p| p.to_vec())
}

/// An HTTP client over one TLS connection, HTTP/2 when ALPN chose it, else HTTP/1.1.
enum Conn {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl Conn {
    async fn open(stream: TlsStream<TcpStream>) -> Result<Conn, hyper::Error> {
        let h2 = alpn(&stream).as_deref() == Some(b"h2");
        let io = TokioIo::new(stream);
        if h2 {
            let (send, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io).await?;
            tokio::spawn(conn);
            Ok(Conn::H2(send))
        } else {
            let (send, conn) = hyper::client::conn::http1::handshake(io).await?;
            tokio::spawn(conn);
            Ok(Conn::H1(send))
        }
    }

    async fn send(
        &mut self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Result<Response<Incoming>, hyper::Error> {
        let req = Request::builder()
            .method(method)
            .uri(format!("https://localhost{path}"))
            .header("content-type", "application/json");
        let req = match self {
            Conn::H1(_) => req.header("host", "localhost"),
            Conn::H2(_) => req,
        };
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .unwrap();
        match self {
            Conn::H1(s) => s.send_request(req).await,
            Conn::H2(s) => s.send_request(req).await,
        }
    }

    /// Sends and reads the whole body.
    async fn call(
        &mut self,
        method: &str,
        path: &str,
        body: Option<String>,
    ) -> Result<(StatusCode, String), hyper::Error> {
        let resp = self.send(method, path, body).await?;
        let status = resp.status();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    }
}

/// Connects with `config` and GETs `/health`; any failure (handshake, or the server
/// closing the connection after it) is an error.
async fn health(addr: SocketAddr, config: ClientConfig) -> Result<String, String> {
    let stream = connect(addr, config, "localhost")
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let mut conn = Conn::open(stream).await.map_err(|e| format!("http: {e}"))?;
    match conn.call("GET", "/health", None).await {
        Ok((StatusCode::OK, body)) => Ok(body),
        Ok((status, body)) => Err(format!("{status}: {body}")),
        Err(e) => Err(format!("request: {e}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_speaks_http1_and_h2_by_alpn_and_refuses_plain_http() {
    let Some(model) = support::model() else {
        return;
    };
    let dir = scratch("tls-alpn");
    let ca = Ca::new("cleave test CA");
    let (decode, _gate) = worker(true).await;
    let router = https_router(&model, &decode, &dir, &ca.server(), &[]).await;
    let addr = router.addr();

    // HTTP/2 when the client offers it.
    let stream = connect(
        addr,
        client_config(&ca.der(), None, &[b"h2", b"http/1.1"]),
        "localhost",
    )
    .await
    .expect("handshake with the test CA");
    assert_eq!(alpn(&stream).as_deref(), Some(&b"h2"[..]));
    let mut h2 = Conn::open(stream).await.unwrap();
    assert!(matches!(h2, Conn::H2(_)));
    let (status, body) = h2
        .call("POST", "/v1/chat/completions", Some(chat(false, 4)))
        .await
        .unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "ok ok");

    // HTTP/1.1 when that is all it offers, by IP address too.
    let stream = connect(
        addr,
        client_config(&ca.der(), None, &[b"http/1.1"]),
        "127.0.0.1",
    )
    .await
    .expect("the certificate names 127.0.0.1");
    assert_eq!(alpn(&stream).as_deref(), Some(&b"http/1.1"[..]));
    let mut h1 = Conn::open(stream).await.unwrap();
    assert_eq!(
        h1.call("GET", "/health", None).await.unwrap(),
        (StatusCode::OK, "ok".into())
    );

    // Plain HTTP to the TLS port gets no HTTP answer.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(support::PATIENCE, tcp.read_to_end(&mut answer))
        .await
        .expect("the server closes the connection");
    assert!(
        !answer.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&answer)
    );

    // The client refuses a certificate for another name, or from a CA it does not trust.
    let wrong_host = connect(addr, client_config(&ca.der(), None, &[]), "example.com").await;
    assert!(wrong_host.is_err(), "a certificate for another host name");
    let other = Ca::new("another CA");
    let untrusted = connect(addr, client_config(&other.der(), None, &[]), "localhost").await;
    assert!(untrusted.is_err(), "a certificate from an untrusted CA");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_only_clients_with_a_certificate_from_the_client_ca() {
    let Some(model) = support::model() else {
        return;
    };
    let dir = scratch("tls-mtls");
    let ca = Ca::new("server CA");
    let clients = Ca::new("client CA");
    let client_ca = dir.join("ca.crt");
    std::fs::write(&client_ca, clients.pem()).unwrap();
    let client_ca = client_ca.display().to_string();
    let (decode, _gate) = worker(true).await;
    let flags = ["--tls-client-ca", &client_ca];
    let router = https_router(&model, &decode, &dir, &ca.server(), &flags).await;
    let addr = router.addr();
    let alpn: &[&[u8]] = &[b"h2", b"http/1.1"];

    let anonymous = health(addr, client_config(&ca.der(), None, alpn)).await;
    assert!(anonymous.is_err(), "no client certificate: {anonymous:?}");
    let stranger = Ca::new("not the client CA").client();
    let foreign = health(addr, client_config(&ca.der(), Some(&stranger), alpn)).await;
    assert!(
        foreign.is_err(),
        "a certificate from another CA: {foreign:?}"
    );
    let member = clients.client();
    assert_eq!(
        health(addr, client_config(&ca.der(), Some(&member), alpn)).await,
        Ok("ok".into())
    );
    assert_eq!(
        health(
            addr,
            client_config(&ca.der(), Some(&member), &[b"http/1.1"])
        )
        .await,
        Ok("ok".into())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewed_certificate_reaches_new_connections_while_an_open_stream_finishes() {
    let Some(model) = support::model() else {
        return;
    };
    let dir = scratch("tls-reload");
    let ca = Ca::new("cleave test CA");
    let old = ca.server();
    // Streams stop after their first token until the gate opens.
    let (decode, gate) = worker(false).await;
    let flags = ["--reload-interval", "0.05"];
    let router = https_router(&model, &decode, &dir, &old, &flags).await;
    let addr = router.addr();
    let mut reloads = router.running.tls.as_ref().unwrap().generation();
    let alpn: &[&[u8]] = &[b"h2", b"http/1.1"];

    let stream = connect(addr, client_config(&ca.der(), None, alpn), "localhost")
        .await
        .unwrap();
    assert_eq!(peer_cert(&stream), old.der);
    let mut conn = Conn::open(stream).await.unwrap();
    let resp = conn
        .send("POST", "/v1/chat/completions", Some(chat(true, 4)))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    // The first token's chunk: the stream is in flight.
    while !String::from_utf8_lossy(&seen).contains("\"ok\"") {
        let frame = body.frame().await.expect("more of the stream").unwrap();
        if let Ok(data) = frame.into_data() {
            seen.extend_from_slice(&data);
        }
    }

    let new = ca.server();
    assert_ne!(new.der, old.der);
    write_identity(&dir, &new);
    next_generation(&mut reloads).await;

    let fresh = connect(addr, client_config(&ca.der(), None, alpn), "localhost")
        .await
        .unwrap();
    assert_eq!(
        peer_cert(&fresh),
        new.der,
        "a new connection gets the new certificate"
    );
    let mut fresh = Conn::open(fresh).await.unwrap();
    assert_eq!(
        fresh.call("GET", "/health", None).await.unwrap().0,
        StatusCode::OK
    );

    // The stream on the old connection continues to its end.
    gate.send(true).unwrap();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.expect("the stream is not cut").into_data() {
            seen.extend_from_slice(&data);
        }
    }
    let text = String::from_utf8_lossy(&seen);
    assert!(
        text.contains("\" ok\"") && text.ends_with("data: [DONE]\n\n"),
        "{text}"
    );
    // And the old connection still takes requests.
    assert_eq!(
        conn.call("GET", "/health", None).await.unwrap().0,
        StatusCode::OK
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_tls_files_stop_the_start_with_the_file_named() {
    let Some(model) = support::model() else {
        return;
    };
    let dir = scratch("tls-bad");
    let ca = Ca::new("cleave test CA");
    let a = ca.server();
    let b = ca.server();
    let (decode, _gate) = worker(true).await;
    let start = |cert: String, key: String| {
        let model = model.clone();
        let decode = decode.clone();
        async move {
            let argv = [
                "cleave-router",
                "--model",
                &model.display().to_string(),
                "--listen",
                "127.0.0.1:0",
                "--decode",
                &decode,
                "--tls-cert",
                &cert,
                "--tls-key",
                &key,
            ]
            .map(String::from);
            #[derive(clap::Parser)]
            struct Cli {
                #[command(flatten)]
                config: cleave_router::config::RouterConfig,
            }
            let config = <Cli as clap::Parser>::try_parse_from(argv).unwrap().config;
            let shutdown = tokio_util::sync::CancellationToken::new();
            let r = cleave_router::serve::run(config, shutdown.clone()).await;
            shutdown.cancel();
            match r {
                Ok(_) => panic!("the router started with unusable TLS files"),
                Err(e) => cleave_telemetry::error_chain(&e),
            }
        }
    };
    let (cert, key) = (dir.join("c.pem"), dir.join("k.pem"));
    std::fs::write(&cert, &a.cert_pem).unwrap();
    std::fs::write(&key, &b.key_pem).unwrap();
    let (c, k) = (cert.display().to_string(), key.display().to_string());
    let mismatch = start(c.clone(), k.clone()).await;
    assert!(
        mismatch.contains("do not form a usable TLS identity"),
        "{mismatch}"
    );
    std::fs::write(&key, "not a key").unwrap();
    let garbage = start(c.clone(), k.clone()).await;
    assert!(
        garbage.contains("k.pem") && garbage.contains("private key"),
        "{garbage}"
    );
    let missing = start(dir.join("none.pem").display().to_string(), k).await;
    assert!(missing.contains("none.pem"), "{missing}");
}
