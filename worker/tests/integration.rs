//! The integration tests of this crate, compiled as one binary (`cargo test --test
//! integration`, a module path filters: `-- internal_tls::`): one link, and the
//! shared helpers and the dependencies' generic code compiled once instead of once per file.
//! `cleave/tests/layout.rs` checks that every file under tests/ is declared here.

mod common;
mod internal_tls;
mod pd;
mod tasks;
