//! The integration tests of this crate, compiled as one binary (`cargo test --test
//! integration`, a module path filters: `-- chat_template::`): one link, and the
//! shared helpers and the dependencies' generic code compiled once instead of once per file.
//! `cleave/tests/layout.rs` checks that every file under tests/ is declared here.

mod chat_template;
mod drain;
mod epp;
mod etcd_discovery;
mod kube_discovery;
mod kv_events;
mod limits;
mod measured;
mod replace;
mod shutdown;
mod support;
mod tls;
