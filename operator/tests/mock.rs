//! The reconciler's error paths against a mocked API server (tower-test): a 409 conflict, a
//! 422 and a 500 while applying fail the reconcile with that code, report it in status
//! (Degraded/ReconcileError), publish a Warning event, and back off exponentially.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cleave_operator::controller::{error_policy, reconcile, Ctx, Settings};
use cleave_operator::crd::{InferenceService, InferenceServiceSpec, PathSource};
use cleave_operator::metrics::OperatorMetrics;
use http::{Request, Response, StatusCode};
use kube::client::Body;
use kube::runtime::controller::Action;
use kube::Client;
use serde_json::{json, Value};

#[derive(Default)]
struct Seen {
    status_patches: Vec<Value>,
    event_reasons: Vec<String>,
    applies: Vec<String>,
}

fn status_body(code: u16, reason: &str) -> Vec<u8> {
    serde_json::to_vec(
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
        "message": format!("mocked {code}"), "reason": reason, "code": code}),
    )
    .unwrap()
}

fn isvc() -> InferenceService {
    let mut spec = InferenceServiceSpec::default();
    spec.model.source.path = Some(PathSource {
        claim_name: Some("w".into()),
        path: "m.gguf".into(),
    });
    let mut i = InferenceService::new("chat", spec);
    i.metadata.namespace = Some("ml".into());
    i.metadata.uid = Some("u1".into());
    i.metadata.generation = Some(1);
    i
}

/// A client whose API server answers ConfigMap applies with `code`.
fn mock(code: u16) -> (Client, Arc<Mutex<Seen>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = seen.clone();
    tokio::spawn(async move {
        while let Some((req, send)) = handle.next_request().await {
            let (parts, body) = req.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let path = parts.uri.path().to_string();
            let (status, out) = if path.starts_with("/apis/leaderworkerset.x-k8s.io") {
                (404, status_body(404, "NotFound"))
            } else if path.ends_with("/status") {
                s.lock().unwrap().status_patches.push(body.clone());
                let mut obj = serde_json::to_value(isvc()).unwrap();
                obj["status"] = body["status"].clone();
                (200, serde_json::to_vec(&obj).unwrap())
            } else if path.contains("/events") {
                s.lock()
                    .unwrap()
                    .event_reasons
                    .push(body["reason"].as_str().unwrap_or("").into());
                (201, serde_json::to_vec(&body).unwrap())
            } else if parts.method == http::Method::PATCH {
                s.lock().unwrap().applies.push(path.clone());
                let reason = match code {
                    409 => "Conflict",
                    422 => "Invalid",
                    _ => "InternalError",
                };
                (code, status_body(code, reason))
            } else {
                (404, status_body(404, "NotFound"))
            };
            let resp = Response::builder()
                .status(StatusCode::from_u16(status).unwrap())
                .header("content-type", "application/json")
                .body(Body::from(out))
                .unwrap();
            send.send_response(resp);
        }
    });
    (Client::new(service, "ml"), seen)
}

async fn fails_with(code: u16) {
    let (client, seen) = mock(code);
    let ctx = Arc::new(Ctx::new(
        client,
        Settings {
            default_image: "cleave:t".into(),
            fetch_image: "curl:t".into(),
        },
        OperatorMetrics::default(),
    ));
    let obj = Arc::new(isvc());
    let err = reconcile(obj.clone(), ctx.clone()).await.unwrap_err();
    assert_eq!(err.code(), Some(code), "{err}");
    assert!(err.to_string().contains("applying owned objects"), "{err}");
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.applies.len(),
        1,
        "stops at the first failed apply: {:?}",
        seen.applies
    );
    assert!(
        seen.applies[0].contains("/configmaps/"),
        "{:?}",
        seen.applies
    );
    let status = &seen.status_patches.last().expect("status written")["status"];
    let degraded = status["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Degraded")
        .unwrap();
    assert_eq!(degraded["status"], "True");
    assert_eq!(degraded["reason"], "ReconcileError");
    assert!(degraded["message"]
        .as_str()
        .unwrap()
        .contains(&format!("mocked {code}")));
    assert!(
        seen.event_reasons.iter().any(|r| r == "ReconcileError"),
        "{:?}",
        seen.event_reasons
    );
    drop(seen);
    // Exponential back-off per object.
    let delays: Vec<Action> = (0..3)
        .map(|_| error_policy(obj.clone(), &err, ctx.clone()))
        .collect();
    assert_eq!(
        delays,
        [1, 2, 4]
            .map(|s| Action::requeue(Duration::from_secs(s)))
            .to_vec()
    );
}

#[tokio::test]
async fn conflict_fails_the_reconcile_and_backs_off() {
    fails_with(409).await;
}

#[tokio::test]
async fn invalid_object_fails_the_reconcile_and_backs_off() {
    fails_with(422).await;
}

#[tokio::test]
async fn server_error_fails_the_reconcile_and_backs_off() {
    fails_with(500).await;
}
