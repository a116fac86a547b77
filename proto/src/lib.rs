//! cleave's control-plane API, generated from `proto/cleave/v1/worker.proto` (the documented
//! contract): the decode worker's `Generate`/`Watch`, the prefill worker's `Prefill`/`Watch`.

#![allow(missing_docs, clippy::all)]

/// Package `cleave.v1`.
pub mod v1 {
    tonic::include_proto!("cleave.v1");
}
