//! The operator's own Prometheus metrics and its health/metrics HTTP endpoint.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Counters of the reconciler and the leader gauge.
#[derive(Clone, Debug, Default)]
pub struct OperatorMetrics {
    /// Reconciles started.
    pub reconciles: Counter,
    /// Reconciles that failed.
    pub failures: Counter,
    /// Autoscaler decisions that changed a group count.
    pub scale_decisions: Counter,
    /// 1 while this replica holds the lease.
    pub leader: Gauge,
}

impl OperatorMetrics {
    /// Registers the metrics.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "cleave_operator_reconciles",
            "reconciles started",
            self.reconciles.clone(),
        );
        registry.register(
            "cleave_operator_reconcile_failures",
            "reconciles that failed",
            self.failures.clone(),
        );
        registry.register(
            "cleave_operator_scale_decisions",
            "autoscaler decisions that changed a pool's group count",
            self.scale_decisions.clone(),
        );
        registry.register(
            "cleave_operator_leader",
            "1 while this replica holds the leader lease",
            self.leader.clone(),
        );
    }
}

async fn metrics_text(State(registry): State<Arc<Registry>>) -> (StatusCode, String) {
    let mut out = String::new();
    match encode(&mut out, &registry) {
        Ok(()) => (StatusCode::OK, out),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` until the process ends. A standby replica (not
/// leader) is healthy and ready: it is waiting for the lease.
///
/// # Errors
/// The address cannot be bound, or the server fails.
pub async fn serve(addr: SocketAddr, registry: Registry) -> std::io::Result<()> {
    let app = Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .route("/metrics", get(metrics_text))
        .with_state(Arc::new(registry));
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "health and metrics endpoint");
    axum::serve(listener, app).await
}
