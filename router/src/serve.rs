//! Starting the router: tokenizer and template from the GGUF, the cluster from discovery, the
//! dispatcher, admission, metrics, and the HTTP server.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use cleave_engine::load::ModelText;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::admit::{Admission, AdmitConfig};
use crate::api::metrics::RouterMetrics;
use crate::api::ApiState;
use crate::config::RouterConfig;
use crate::discovery::etcd::Etcd;
use crate::discovery::kube::Kube;
use crate::discovery::{Discovery, Static};
use crate::dispatch::{Cluster, Dispatcher};
use crate::place::{PlaceConfig, Role};

/// A started router.
pub struct Running {
    /// Where the API listens.
    pub addr: SocketAddr,
    /// The placement state (tests inspect it).
    pub cluster: Arc<Cluster>,
    /// Ends when the server stops.
    pub task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

/// Starts the router until `shutdown`; returns once it listens.
pub async fn run(config: RouterConfig, shutdown: CancellationToken) -> anyhow::Result<Running> {
    let text = ModelText::open(&config.model)
        .with_context(|| format!("reading {}", config.model.display()))?;
    let (tokenizer, template, max_context) = (text.tokenizer, text.template, text.max_context);
    let model_name = config
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_model_name(&config.model));
    let api_keys = match &config.api_keys_file {
        None => None,
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let keys: HashSet<String> = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from)
                .collect();
            anyhow::ensure!(!keys.is_empty(), "{} holds no API keys", p.display());
            Some(keys)
        }
    };

    let mut registry = Registry::default();
    let metrics = Arc::new(RouterMetrics::new(&mut registry));
    let cluster = Arc::new(Cluster::default());
    let mut workers: Vec<(Role, String)> = config
        .prefill
        .iter()
        .map(|e| (Role::Prefill, e.clone()))
        .collect();
    workers.extend(config.decode.iter().map(|e| (Role::Decode, e.clone())));
    config.validate().map_err(anyhow::Error::msg)?;
    Box::new(Static { workers })
        .start(cluster.clone(), shutdown.clone())
        .map_err(anyhow::Error::msg)?;
    let etcd = config.etcd_endpoints();
    if !etcd.is_empty() {
        let discovery = Etcd::connect(&etcd, &config.etcd_prefix)
            .await
            .with_context(|| format!("etcd discovery at {}", etcd.join(",")))?;
        Box::new(discovery)
            .start(cluster.clone(), shutdown.clone())
            .map_err(anyhow::Error::msg)?;
        tracing::info!(endpoints = %etcd.join(","), prefix = %config.etcd_prefix, "etcd discovery started");
    }
    if config.kubernetes() {
        let selector = config.kube_selector.as_deref().unwrap_or_default();
        let mut discovery = Kube::connect(config.kube_namespace.as_deref(), selector)
            .await
            .with_context(|| format!("kubernetes discovery of pods {selector:?}"))?;
        discovery.relist_every = config.kube_relist;
        let namespace = discovery.namespace().to_string();
        Box::new(discovery)
            .start(cluster.clone(), shutdown.clone())
            .map_err(anyhow::Error::msg)?;
        tracing::info!(%namespace, %selector, "kubernetes discovery started");
    }
    let place = PlaceConfig {
        disagg_min_uncached_blocks: config.disagg_min_uncached_blocks,
        ..Default::default()
    };
    let backend: Arc<dyn crate::api::backend::Backend> = match config.kv_events {
        Some(_) => Arc::new(crate::events::start_pool(
            &config,
            cluster.clone(),
            &place,
            model_name,
            shutdown.clone(),
        )?),
        None => Arc::new(
            Dispatcher::new(cluster.clone(), config.policy.build(&place), model_name)
                .with_metrics(metrics.clone()),
        ),
    };
    let admission = Admission::new(
        AdmitConfig {
            max_in_flight: config.max_in_flight,
            max_queue: config.max_queue,
            request_timeout: Some(config.request_timeout),
            ..Default::default()
        },
        metrics.queue_depth.clone(),
    );
    let state = Arc::new(ApiState {
        backend,
        grammars: Arc::new(cleave_engine::constrain::LazyGrammars::new(
            tokenizer.clone(),
            None,
        )),
        tokenizer,
        template,
        max_context,
        api_keys,
        admission,
        metrics,
        registry: Arc::new(registry),
    });
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .context("binding the API address")?;
    let addr = listener.local_addr()?;
    tracing::info!(%addr, policy = ?config.policy, "router listening");
    let app = crate::api::router(state);
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown.cancelled_owned())
            .await?;
        Ok(())
    });
    Ok(Running {
        addr,
        cluster,
        task,
    })
}

/// Serves until Ctrl-C or SIGTERM, printing `{"http":"addr"}` on stdout once listening.
/// With `--mode endpoint-picker`, runs the endpoint picker instead ([`crate::epp`]).
pub fn serve_until_signal(config: RouterConfig) -> anyhow::Result<()> {
    if config.mode == crate::config::Mode::EndpointPicker {
        return crate::epp::serve_until_signal(config);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let running = run(config, shutdown.clone()).await?;
        println!("{{\"http\":\"{}\"}}", running.addr);
        cleave_telemetry::cancel_on_signal(shutdown);
        running.task.await?
    })
}

/// The name clients send by default: a GGUF file's name without `.gguf`, a Hugging Face
/// directory's name.
pub(crate) fn default_model_name(model: &std::path::Path) -> String {
    let name = if model.is_dir() {
        model.file_name()
    } else {
        model.file_stem()
    };
    name.map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into())
}
