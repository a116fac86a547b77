//! The worker runtime shared by cleave's two worker roles: the engine on memory allocated by
//! the KV transport, served over gRPC.
//!
//! The roles are their own crates, each owning its gRPC service, its half of the KV move and
//! its binary, and they meet only through `cleave-proto`:
//! - **decode** (`decode-worker/`, `cleave-decode`): owns the KV memory of running sequences.
//!   It admits a request, allocates its blocks (reusing its own cached prefix), asks the chosen
//!   prefill worker to fill them (`import_kv`), then decodes in its continuous batch and streams
//!   tokens.
//! - **prefill** (`prefill-worker/`, `cleave-prefill`): computes prompts (chunked, batched, with
//!   its own prefix cache) and writes each block's KV into the decode worker's memory as soon as
//!   it is full (`export_kv`), then answers with the first token.
//!
//! This crate is what they share, taking the role's service as a parameter ([`RoleService`]):
//! start-up and state ([`serve`]), the `Watch` stream of KV events and load for the router
//! ([`watch`]), Prometheus metrics ([`metrics`]), the health endpoints, etcd registration
//! ([`register`]), multi-process groups ([`group`], [`follower`], [`rank_kv`]) and the proto
//! conversions ([`convert`]). [`main_for`] is the whole `main` of either binary.

#![forbid(unsafe_code)]

pub mod config;
pub mod convert;
mod error;
pub mod fault;
pub mod follower;
pub mod group;
pub mod kv_addr;
pub mod metrics;
pub mod rank_kv;
pub mod register;
pub mod serve;
pub mod tiers;
pub mod watch;

pub use config::{Role, WorkerConfig};
pub use error::WorkerError;
pub use serve::{run, RoleService, Running, WorkerState};

/// Command line of both worker binaries.
#[derive(Debug, clap::Parser)]
#[command(version, about = "cleave worker")]
struct Cli {
    #[command(flatten)]
    config: WorkerConfig,
}

/// The whole `main` of a worker binary: parse flags, init logging, serve until Ctrl-C/SIGTERM.
pub fn main_for(service: RoleService) -> std::process::ExitCode {
    use clap::Parser;
    let cli = Cli::parse();
    let _telemetry = cleave_telemetry::init(match service.role {
        Role::Decode => "cleave-decode",
        Role::Prefill => "cleave-prefill",
    });
    match serve_until_signal(service, cli.config) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", cleave_telemetry::error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Serves `service`'s role until Ctrl-C or SIGTERM, printing one JSON line with the bound
/// addresses on stdout (`{"grpc":"…","http":"…"}`) once ready — what `cleave up` reads.
pub fn serve_until_signal(service: RoleService, config: WorkerConfig) -> Result<(), WorkerError> {
    let rt = cleave_telemetry::runtime(config.runtime_threads).map_err(WorkerError::Runtime)?;
    rt.block_on(async move {
        let shutdown = tokio_util::sync::CancellationToken::new();
        if let Some(m) = config.group.membership()?.filter(|m| m.rank > 0) {
            // A follower rank: no servers, no registration; it computes the leader's steps.
            cancel_on_signal(shutdown.clone());
            return follower::run(config, m, shutdown).await;
        }
        let running = run(service, config, shutdown.clone()).await?;
        println!(
            "{{\"grpc\":\"{}\",\"http\":\"{}\"}}",
            running.grpc_addr, running.http_addr
        );
        cancel_on_signal(shutdown);
        running.task.await??;
        Ok(())
    })
}

pub use cleave_telemetry::cancel_on_signal;
