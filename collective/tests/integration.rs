//! The integration tests of this crate, compiled as one binary (`cargo test --test
//! integration`, a module path filters: `-- deterministic::`): one link, and the
//! shared helpers and the dependencies' generic code compiled once instead of once per file.
//! `cleave/tests/layout.rs` checks that every file under tests/ is declared here.

mod common;

/// Catches a transport writing into a buffer after it was freed (see `common::quarantine`); the
/// multi-rank runs of `failure` and `process` check it.
#[global_allocator]
static ALLOC: common::quarantine::Quarantine = common::quarantine::Quarantine;

mod deterministic;
mod failure;
mod ops;
mod process;
