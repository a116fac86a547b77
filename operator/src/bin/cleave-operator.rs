//! `cleave-operator`: reconciles InferenceServices (leader-elected), or prints the CRD.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand};
use cleave_operator::controller::{self, Ctx, Settings};
use cleave_operator::leader::LeaseLock;
use cleave_operator::metrics::{self, OperatorMetrics};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "cleave operator: InferenceService controller",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Print the InferenceService CRD (YAML).
    Crd,
    /// Run the controller (the default; the flags may also come without `run`).
    Run(RunArgs),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Image with the cleave binaries for specs that name none.
    #[arg(
        long,
        env = "CLEAVE_DEFAULT_IMAGE",
        default_value = "ghcr.io/cleave-project/cleave:0.1.0"
    )]
    default_image: String,
    /// Image of the model download init container (sh, curl, sha256sum).
    #[arg(
        long,
        env = "CLEAVE_FETCH_IMAGE",
        default_value = "curlimages/curl:8.11.1"
    )]
    fetch_image: String,
    /// Health and metrics listen address.
    #[arg(
        long,
        env = "CLEAVE_OPERATOR_HTTP_ADDR",
        default_value = "0.0.0.0:8081"
    )]
    http_addr: SocketAddr,
    /// Namespace of the leader Lease (default: the pod's namespace, else `default`).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// Name of the leader Lease.
    #[arg(long, env = "CLEAVE_LEASE_NAME", default_value = "cleave-operator")]
    lease_name: String,
    /// This replica's identity in the Lease (default: the pod name, else hostname-pid).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// Lease duration in seconds.
    #[arg(long, env = "CLEAVE_LEASE_SECONDS", default_value_t = 15)]
    lease_seconds: u64,
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let client = kube::Client::try_default().await?;
    let metrics = OperatorMetrics::default();
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let http = tokio::spawn(metrics::serve(args.http_addr, registry));

    let identity = args.identity.unwrap_or_else(|| {
        // The pod's hostname (its name) as the default leader-election identity.
        #[allow(clippy::disallowed_methods)]
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "operator".into());
        format!("{host}-{}", std::process::id())
    });
    let lock = LeaseLock::new(
        client.clone(),
        &args.lease_namespace,
        &args.lease_name,
        &identity,
        Duration::from_secs(args.lease_seconds.max(3)),
    );
    let stop = CancellationToken::new();
    cleave_telemetry::cancel_on_signal(stop.clone());
    tracing::info!(%identity, "waiting for the leader lease");
    tokio::select! {
        _ = lock.acquire() => {}
        _ = stop.cancelled() => return Ok(()),
    }
    tracing::info!(%identity, "leading");
    metrics.leader.set(1);
    let lost = CancellationToken::new();
    let holder = {
        let (lock, lost) = (lock.clone(), lost.clone());
        tokio::spawn(async move {
            lock.hold().await;
            lost.cancel();
        })
    };
    let ctx = Arc::new(Ctx::new(
        client,
        Settings {
            default_image: args.default_image,
            fetch_image: args.fetch_image,
        },
        metrics.clone(),
    ));
    let (s, l) = (stop.clone(), lost.clone());
    controller::run(ctx, async move {
        tokio::select! { _ = s.cancelled() => {}, _ = l.cancelled() => {} }
    })
    .await;
    holder.abort();
    http.abort();
    metrics.leader.set(0);
    if lost.is_cancelled() && !stop.is_cancelled() {
        anyhow::bail!("lost the leader lease; exiting so a fresh replica can stand by");
    }
    lock.release().await?;
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    if let Some(Cmd::Crd) = cli.command {
        print!("{}", cleave_operator::crd::crd_yaml());
        return std::process::ExitCode::SUCCESS;
    }
    let _telemetry = cleave_telemetry::init("cleave-operator");
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let args = match cli.command {
        Some(Cmd::Run(args)) => args,
        _ => cli.run,
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
