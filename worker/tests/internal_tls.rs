//! The workers' internal traffic over mutual TLS (`--internal-tls-*`): a disaggregated request
//! whose gRPC (client → decode → prefill) and KV transfer all run over TLS gives the
//! single-process tokens; a client without a certificate, or with one from another CA, is
//! refused; a decode worker never falls back to plain gRPC towards a prefill worker that does
//! not speak TLS (it prefills locally and counts the fallback).

use crate::common;

use std::path::PathBuf;

use cleave_config::internal_tls::InternalTls;
use cleave_decode_worker::SERVICE as DECODE;
use cleave_kv_transfer::BackendChoice;
use cleave_prefill_worker::SERVICE as PREFILL;
use cleave_proto::v1::decode_worker_client::DecodeWorkerClient;
use cleave_tls::testing::TestCa;
use cleave_tls::Mutual;
use cleave_worker::{run, Running, WorkerConfig};
use common::{config, generate_on, http_get, prompts, reference, settle};
use tokio_util::sync::CancellationToken;

fn secret(ca: &TestCa, name: &str) -> InternalTls {
    let dir =
        std::env::temp_dir().join(format!("cleave-internal-tls-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    ca.write_secret(&dir)
}

fn with_tls(transport: BackendChoice, files: &InternalTls) -> WorkerConfig {
    let dir: PathBuf = files.cert.parent().expect("secret directory").into();
    WorkerConfig {
        internal_tls: cleave_config::internal_tls::InternalTlsArgs::in_dir(&dir, None),
        ..config(transport)
    }
}

/// A client of `decode` over mutual TLS with `identity` (or plain without).
async fn client(
    decode: &Running,
    identity: Option<&Mutual>,
) -> Result<DecodeWorkerClient<tonic::transport::Channel>, tonic::transport::Error> {
    let url = format!("http://{}", decode.grpc_addr);
    let channel = cleave_tls::grpc_endpoint(&url, identity)?.connect().await?;
    Ok(DecodeWorkerClient::new(channel))
}

async fn disaggregated_over_mutual_tls(transport: BackendChoice) {
    let ca = TestCa::new("cleave internal CA");
    let stop = CancellationToken::new();
    let name = |role: &str| format!("{transport:?}-{role}");
    let prefill = run(
        PREFILL,
        with_tls(transport, &secret(&ca, &name("prefill"))),
        stop.clone(),
    )
    .await
    .unwrap();
    let decode = run(
        DECODE,
        with_tls(transport, &secret(&ca, &name("decode"))),
        stop.clone(),
    )
    .await
    .unwrap();
    let router = Mutual::load(&secret(&ca, &name("router"))).unwrap();
    let prompt = prompts().remove(1);
    let c = client(&decode, Some(&router)).await.unwrap();
    let (got, fin) = generate_on(c, &prompt, Some(&prefill), 16).await.unwrap();
    assert_eq!(got, reference(&prompt, 16).await, "{transport:?}");
    assert!(fin.disaggregated);
    for w in [&prefill, &decode] {
        assert_eq!(settle(w).await.pool.used, 0);
    }
    let metrics = http_get(decode.http_addr, "/metrics").await;
    // The prefill worker served the prompt: imported, not fallen back.
    for line in [
        "cleave_worker_disaggregated_requests_total 1",
        "cleave_worker_prefill_fallbacks_total 0",
    ] {
        assert!(metrics.contains(line), "{line}:\n{metrics}");
    }
    stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_over_mutual_tls_and_tcp() {
    disaggregated_over_mutual_tls(BackendChoice::Tcp).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_over_mutual_tls_and_ucx() {
    if !cleave_kv_transfer::ucx_or_skip("internal_tls::disaggregated_over_mutual_tls_and_ucx") {
        return;
    }
    disaggregated_over_mutual_tls(BackendChoice::Ucx).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_the_cas_certificate_are_refused() {
    let ca = TestCa::new("cleave internal CA");
    let stop = CancellationToken::new();
    let decode = run(
        DECODE,
        with_tls(BackendChoice::Tcp, &secret(&ca, "decode-r")),
        stop.clone(),
    )
    .await
    .unwrap();
    let prompt = prompts().remove(0);
    // Plain gRPC to the TLS port: the call fails (the server wants a handshake).
    let plain = client(&decode, None).await;
    let refused = match plain {
        Err(_) => true,
        Ok(c) => generate_on(c, &prompt, None, 4).await.is_err(),
    };
    assert!(refused, "plain gRPC was served");
    // A certificate from another CA: the handshake fails.
    let stranger = Mutual::load(&secret(&TestCa::new("another CA"), "stranger")).unwrap();
    let refused = match client(&decode, Some(&stranger)).await {
        Err(_) => true,
        Ok(c) => generate_on(c, &prompt, None, 4).await.is_err(),
    };
    assert!(refused, "a stranger's certificate was accepted");

    // A prefill worker without TLS: the decode worker's TLS channel cannot reach it, so it
    // prefills locally (same tokens) and counts the fallback, never speaking plain gRPC.
    let plain_prefill = run(PREFILL, config(BackendChoice::Tcp), stop.clone())
        .await
        .unwrap();
    let member = Mutual::load(&secret(&ca, "member")).unwrap();
    let c = client(&decode, Some(&member)).await.unwrap();
    let (got, fin) = generate_on(c, &prompt, Some(&plain_prefill), 8)
        .await
        .unwrap();
    assert_eq!(got, reference(&prompt, 8).await);
    assert_eq!(fin.reason(), cleave_proto::v1::FinishReason::Length);
    let metrics = http_get(decode.http_addr, "/metrics").await;
    assert!(
        metrics.contains("cleave_worker_prefill_fallbacks_total 1"),
        "{metrics}"
    );
    stop.cancel();
}
