//! The prefill role: `Prefill` computes a prompt here and writes its KV into the caller's
//! blocks as each block fills (`export_kv`), then answers with the first token.

#![forbid(unsafe_code)]

mod export_kv;

use std::sync::Arc;

use cleave_proto::v1 as pb;
use cleave_proto::v1::prefill_worker_server::{PrefillWorker, PrefillWorkerServer};
use tonic::{Request, Response, Status};

use cleave_worker::{Role, RoleService, WorkerState};

/// The gRPC service.
pub fn service(state: Arc<WorkerState>) -> PrefillWorkerServer<Prefill> {
    PrefillWorkerServer::new(Prefill { state })
}

/// The prefill role for the worker runtime ([`cleave_worker::run`], [`cleave_worker::main_for`]).
pub const SERVICE: RoleService = RoleService {
    role: Role::Prefill,
    routes: |state| tonic::service::Routes::new(service(state)),
};

/// The prefill worker's gRPC handler.
pub struct Prefill {
    state: Arc<WorkerState>,
}

#[tonic::async_trait]
impl PrefillWorker for Prefill {
    type WatchStream = cleave_worker::watch::Stream;

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let traceparent = cleave_worker::convert::traceparent(request.metadata());
        let req = request.into_inner();
        let span = tracing::info_span!(
            "prefill",
            request_id = ?req.request_id,
            trace_id = %cleave_worker::convert::trace_id(traceparent.as_deref())
        );
        cleave_telemetry::set_parent(&span, traceparent.as_deref());
        // If the caller goes away tonic drops this future: the export's guard then cancels the
        // engine sequence and the transfers in flight.
        let resp =
            tracing::Instrument::instrument(export_kv::run(self.state.clone(), req), span).await?;
        Ok(Response::new(resp))
    }

    async fn watch(
        &self,
        _: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Ok(cleave_worker::watch::response(&self.state))
    }
}
