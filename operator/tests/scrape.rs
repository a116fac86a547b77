//! The autoscaler reads the queue depth a real worker exports: the worker's own metrics type
//! served over HTTP, scraped by the operator's scraper, fed to the scaler.

use cleave_engine::engine::EngineStats;
use cleave_operator::controller::observe::scrape;
use cleave_operator::crd::AutoscalingSpec;
use cleave_operator::scale::{decide, ScaleInput};
use cleave_worker::metrics::WorkerMetrics;
use prometheus_client::registry::Registry;

async fn serve_worker_metrics(waiting: usize) -> String {
    let mut registry = Registry::default();
    let metrics = WorkerMetrics::new(&mut registry);
    metrics.observe_engine(&EngineStats {
        waiting,
        ..Default::default()
    });
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let app =
        axum::Router::new().route("/metrics", axum::routing::get(move || async move { text }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/metrics")
}

#[tokio::test]
async fn queue_depth_of_real_worker_metrics_drives_the_scaler() {
    let http = reqwest::Client::new();
    let a = scrape(&http, &serve_worker_metrics(9).await).await;
    let b = scrape(&http, &serve_worker_metrics(3).await).await;
    assert_eq!((a, b), (Some(9.0), Some(3.0)));
    let policy = AutoscalingSpec::default(); // target 4 per group
    let d = decide(&ScaleInput {
        current: 1,
        min: 1,
        max: 8,
        queue_depth: a.unwrap() + b.unwrap(),
        policy: &policy,
        history: &[],
        now: 0,
    });
    assert_eq!(d.to, 3, "{d:?}");
    // A dead endpoint yields no reading rather than zero.
    assert_eq!(scrape(&http, "http://127.0.0.1:9/metrics").await, None);
}
