//! `InferenceService` status: what the operator observed and decided.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Observed state, written by the operator only.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct InferenceServiceStatus {
    /// The spec generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`, `Progressing` and `Degraded`.
    #[serde(default)]
    pub conditions: Vec<Condition>,
    /// Prefill pool counts (in worker groups).
    #[serde(default)]
    pub prefill: PoolStatus,
    /// Decode pool counts (in worker groups).
    #[serde(default)]
    pub decode: PoolStatus,
    /// Router pod counts.
    #[serde(default)]
    pub router: PoolStatus,
    /// The OpenAI API base URL inside the cluster.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router_endpoint: Option<String>,
    /// The autoscaler's most recent decision.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scale: Option<ScaleDecisionStatus>,
}

/// A standard condition.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// `Ready`, `Progressing` or `Degraded`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// One CamelCase word.
    pub reason: String,
    /// Human-readable detail (omitted when empty: the 1.20 API server reads "" as null).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    /// When `status` last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
    /// The generation this condition was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// Ready and desired counts of one pool.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct PoolStatus {
    /// Groups (or router pods) wanted.
    pub desired: i32,
    /// Groups (or router pods) whose pods are all ready.
    pub ready: i32,
    /// `ready/desired`, for printer columns.
    #[serde(default)]
    pub summary: String,
}

impl PoolStatus {
    /// Counts with their summary.
    pub fn new(ready: i32, desired: i32) -> Self {
        Self {
            desired,
            ready,
            summary: format!("{ready}/{desired}"),
        }
    }
}

/// One autoscaler decision.
#[derive(Clone, Debug, Default, Serialize, Deserialize, JsonSchema, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ScaleDecisionStatus {
    /// `prefill` or `decode`.
    pub pool: String,
    /// Groups before.
    pub from: i32,
    /// Groups after.
    pub to: i32,
    /// Queue depth summed over the pool's workers.
    pub queue_depth: f64,
    /// Why (bounds, stabilisation, step limit).
    pub reason: String,
    /// When (RFC 3339).
    pub time: String,
}
