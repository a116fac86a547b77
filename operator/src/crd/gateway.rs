//! `spec.gateway`: plugging an InferenceService into an Envoy-based Gateway through the Gateway
//! API Inference Extension (an `InferencePool` and cleave's endpoint picker).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Gateway API Inference Extension integration (off by default).
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GatewaySpec {
    /// Render an `InferencePool` (inference.networking.k8s.io/v1) selecting the decode pods,
    /// and an endpoint picker (`cleave-router --mode endpoint-picker`, Deployment + Service)
    /// that it names. Needs the InferencePool CRD installed (crds/upstream/).
    #[serde(default)]
    pub inference_pool: bool,
    /// What the Gateway does when the endpoint picker does not answer.
    #[serde(default)]
    pub failure_mode: FailureMode,
}

/// The InferencePool's `endpointPickerRef.failureMode`.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq, Eq)]
pub enum FailureMode {
    /// Requests fail while the picker is down.
    #[default]
    FailClose,
    /// Requests go to any pool endpoint while the picker is down.
    FailOpen,
}
