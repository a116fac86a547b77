//! `grpc.health.v1.Health` as the endpoint picker protocol names it: `liveness` (the process
//! answers), `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor` (the pool has been
//! read and listed, so picks are meaningful), and the overall status `""`.
//!
//! The picker starts serving only after its initial pool listing, so all of them are
//! `SERVING` from the first answer; [`set_ready`] flips the two readiness services.

use tonic_health::server::{health_reporter, HealthReporter};
use tonic_health::ServingStatus;

/// The liveness service name.
pub const LIVENESS: &str = "liveness";
/// The readiness service name.
pub const READINESS: &str = "readiness";
/// The ext_proc service name (also its gRPC service name).
pub const EXT_PROC: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The health service and its reporter, every service `SERVING` (readiness per `ready`).
pub async fn service(
    ready: bool,
) -> (
    HealthReporter,
    tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
) {
    let (mut reporter, server) = health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    reporter
        .set_service_status(LIVENESS, ServingStatus::Serving)
        .await;
    set_ready(&mut reporter, ready).await;
    (reporter, server)
}

/// Sets the readiness services.
pub async fn set_ready(reporter: &mut HealthReporter, ready: bool) {
    let status = if ready {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    };
    for name in [READINESS, EXT_PROC] {
        reporter.set_service_status(name, status).await;
    }
}
