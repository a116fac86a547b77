//! The integration tests of this crate, compiled as one binary (`cargo test --test
//! integration`, a module path filters: `-- cluster::`): one link, and the
//! shared helpers and the dependencies' generic code compiled once instead of once per file.
//! `cleave/tests/layout.rs` checks that every file under tests/ is declared here.

mod cluster;
mod common;
mod crd_drift;
mod gateway;
mod mock;
mod offline;
mod scrape;
