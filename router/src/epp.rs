//! The endpoint picker (`cleave-router --mode endpoint-picker`): cleave's placement behind an
//! Envoy-based Gateway, as the Gateway API Inference Extension's "EPP" for one `InferencePool`.
//!
//! Envoy's ext_proc filter streams each HTTP request to [`process::EndpointPicker`]; the
//! request body is buffered to its end, parsed and tokenized by the router's API layer, and
//! [`pick::Picker`] scores the pool's members with the router's placement policy (prefix index
//! and load, [`crate::place`]); the answer names the chosen `ip:port` in the
//! `x-gateway-destination-endpoint` header and the `envoy.lb` dynamic metadata
//! ([`protocol`]), before the body is streamed back. The pool ([`pool::Pool`]) comes from the
//! InferencePool's selector ([`inference_pool`]) and/or static `--pool-endpoint`s; cleave decode
//! workers report load and KV events on their `Watch`, vLLM/SGLang servers are scraped
//! ([`scrape`]). `grpc.health.v1` is served beside ([`health`]). See docs/endpoint-picker.md.

pub mod config;
pub mod health;
pub mod inference_pool;
pub mod pick;
pub mod pool;
pub mod process;
pub mod protocol;
pub mod scrape;

use std::net::SocketAddr;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessorServer;
use tokio_util::sync::CancellationToken;

use crate::config::RouterConfig;
use crate::dispatch::Cluster;
use crate::place::{BuildPolicy, PlaceConfig};
use crate::RouterError;
use pick::{PickConfig, Picker, Text};
use pool::{Backend, Member, Pool};
use scrape::{PromptBlocks, ScrapeConfig};

/// A started endpoint picker.
pub struct Running {
    /// Where the gRPC server listens.
    pub addr: SocketAddr,
    /// The pool picked from (tests inspect it).
    pub pool: Arc<Pool>,
    /// Ends when the server and the pool's background tasks have stopped.
    pub task: tokio::task::JoinHandle<Result<(), RouterError>>,
}

/// Starts the endpoint picker until `shutdown`; returns once the pool is listed and the gRPC
/// server listens.
pub async fn run(
    config: RouterConfig,
    shutdown: CancellationToken,
) -> Result<Running, RouterError> {
    config.validate()?;
    let epp = &config.epp;
    let model = crate::model::open_model(&config)?;
    let text = Text {
        tokenizer: model.tokenizer,
        template: model.template,
        max_context: model.max_context,
    };
    let model_name = config
        .served_model_name
        .clone()
        .unwrap_or_else(|| crate::model::default_model_name(&config.model));
    let cluster = Arc::new(Cluster::for_policy(config.policy));
    let prompts = Arc::new(PromptBlocks::default());
    let pool = Arc::new(Pool::new(
        cluster,
        ScrapeConfig {
            interval: epp.scrape_interval,
            kv_capacity_blocks: epp.kv_capacity_blocks,
        },
        prompts.clone(),
        shutdown.clone(),
    ));
    for addr in &epp.pool_endpoints {
        let destination = addr.to_string();
        let url = format!("http://{destination}{}", epp.metrics_path);
        pool.set(
            &destination,
            vec![Member {
                destination: destination.clone(),
                backend: Backend::Metrics { url },
            }],
        );
    }
    if let Some(name) = epp.pool.as_deref().filter(|p| !p.trim().is_empty()) {
        let client = kube::Client::try_default()
            .await
            .map_err(RouterError::KubeClient)?;
        let mut source =
            inference_pool::KubePool::new(client, config.kube_namespace.as_deref(), name);
        source.relist_every = config.kube_relist;
        source.metrics_path = epp.metrics_path.clone();
        let namespace = source.namespace().to_string();
        source
            .start(pool.clone(), shutdown.clone())
            .await
            .map_err(|source| RouterError::InferencePool {
                name: name.to_string(),
                namespace,
                source,
            })?;
    }
    let place = PlaceConfig {
        disagg_min_uncached_blocks: usize::MAX,
        ..PlaceConfig::from(&config.placement)
    };
    let picker = Arc::new(Picker::new(
        pool.clone(),
        config.policy.build(&place),
        text,
        model_name,
        PickConfig {
            shed_queue_depth: epp.shed_queue_depth,
            fallbacks: epp.fallbacks,
        },
        prompts,
    ));
    let (_reporter, health) = health::service(true).await;
    let listener = tokio::net::TcpListener::bind(epp.epp_listen)
        .await
        .map_err(|source| RouterError::Bind {
            what: "endpoint picker",
            addr: epp.epp_listen,
            source,
        })?;
    let addr = listener
        .local_addr()
        .map_err(|e| RouterError::Grpc(e.into()))?;
    tracing::info!(%addr, policy = ?config.policy, members = pool.destinations().len(), "endpoint picker listening");
    let service =
        ExternalProcessorServer::new(process::EndpointPicker::new(picker, epp.max_body_bytes));
    // Nagle off: picks are small messages Envoy waits for.
    let incoming = tonic::transport::server::TcpIncoming::from_listener(listener, true, None)
        .map_err(RouterError::Grpc)?;
    let owner = pool.cluster().clone();
    let task = tokio::spawn(async move {
        let served = tonic::transport::Server::builder()
            .add_service(health)
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
            .await;
        // The pool's member watches and scrapes and the InferencePool follower end on the same
        // token; the task ends once they have.
        owner.finish_tasks(cleave_telemetry::TASKS_PATIENCE).await;
        served.map_err(|e| RouterError::Grpc(e.into()))
    });
    Ok(Running { addr, pool, task })
}

/// Serves until Ctrl-C or SIGTERM, printing `{"grpc":"addr"}` on stdout once listening.
pub fn serve_until_signal(config: RouterConfig) -> Result<(), RouterError> {
    let rt = cleave_telemetry::runtime(config.runtime_threads).map_err(RouterError::Runtime)?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let running = run(config, shutdown.clone()).await?;
        println!("{{\"grpc\":\"{}\"}}", running.addr);
        cleave_telemetry::cancel_on_signal(shutdown);
        running.task.await?
    })
}
