//! cleave's Kubernetes operator: the `InferenceService` CRD, a reconciler that renders it into
//! ConfigMaps, Services, Deployments/StatefulSets/LeaderWorkerSets, and a queue-depth autoscaler.

#![forbid(unsafe_code)]

pub mod controller;
pub mod crd;
pub mod leader;
pub mod metrics;
pub mod problems;
pub mod render;
pub mod scale;
pub mod status;
pub mod validate;
