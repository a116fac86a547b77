//! Starting the router: tokenizer and template from the GGUF, the cluster from discovery, the
//! dispatcher, admission, metrics, and the HTTP server (plain, or HTTPS with [`crate::tls`]).
//!
//! The TLS files and the API keys file are reread every `--reload-interval` and on `SIGHUP`
//! by one reload task; either takes effect only when a file's contents changed and load
//! (docs/security.md).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cleave_telemetry::error_chain;

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
use crate::drain::Drain;
use crate::keys::{KeyMetrics, Keys};
use crate::model::{default_model_name, open_model};
use crate::place::{BuildPolicy, PlaceConfig, Role};
use crate::tls::TlsReloader;
use crate::RouterError;

pub use cleave_telemetry::TASKS_PATIENCE;

/// A started router.
pub struct Running {
    /// Where the API listens.
    pub addr: SocketAddr,
    /// The placement state (tests inspect it).
    pub cluster: Arc<Cluster>,
    /// Ends when the server and the cluster's background tasks have stopped.
    pub task: tokio::task::JoinHandle<Result<(), RouterError>>,
    /// The TLS identity when serving HTTPS (tests watch its reloads).
    pub tls: Option<Arc<TlsReloader>>,
    /// The API keys when `--api-keys-file` is set (tests watch their reloads).
    pub keys: Option<Arc<Keys>>,
    /// Cancelled when the stop signal arrives and the drain period begins.
    pub draining: CancellationToken,
}

/// Starts the router until `shutdown` (and `--drain-period` after it); returns once it listens.
pub async fn run(
    config: RouterConfig,
    shutdown: CancellationToken,
) -> Result<Running, RouterError> {
    // The effective configuration (flags, environment and defaults), once.
    tracing::info!(config = ?config, "router configuration");
    // `shutdown` is the stop signal; the server and every task below end on `drain.stop`,
    // `--drain-period` later.
    let drain = Drain::after(shutdown, config.drain_period);
    let shutdown = drain.stop.clone();
    // A start that fails below stops what it started (and the drain's wait for the signal).
    let stop_on_error = drain.stop.clone().drop_guard();
    let text = open_model(&config)?;
    let (tokenizer, template, max_context) = (text.tokenizer, text.template, text.max_context);
    let model_name = config
        .served_model_name
        .clone()
        .unwrap_or_else(|| default_model_name(&config.model));
    let mut registry = Registry::default();
    let metrics = Arc::new(RouterMetrics::new(&mut registry));
    let api_keys = load_keys(&config, &mut registry)?;
    let tls = match config.tls_files()? {
        None => None,
        Some(files) => Some(Arc::new(TlsReloader::load(files)?)),
    };
    let internal_tls = cleave_tls::Mutual::from_args(&config.internal_tls)?;
    let cluster = Arc::new(Cluster::for_policy(config.policy).with_internal_tls(internal_tls));
    crate::config::validate(&config)?;
    start_discovery(&config, &cluster, &shutdown).await?;
    let backend = backend(&config, &cluster, model_name, &metrics, &shutdown)?;
    let admission = Admission::new(
        AdmitConfig {
            max_in_flight: config.max_in_flight,
            max_queue: config.max_queue,
            queue_timeout: config.queue_timeout,
            request_timeout: Some(config.request_timeout),
        },
        metrics.queue_depth.clone(),
    );
    let state = Arc::new(ApiState {
        backend,
        grammars: Arc::new(cleave_text::constrain::LazyGrammars::new(
            tokenizer.clone(),
            None,
        )),
        tokenizer,
        template,
        max_context,
        api_keys: api_keys.clone(),
        admission,
        metrics,
        registry: Arc::new(registry),
    });
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| RouterError::Bind {
            what: "API",
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr().map_err(RouterError::Serve)?;
    tracing::info!(%addr, policy = ?config.policy, https = tls.is_some(), "router listening");
    let app = crate::api::router(state).layer(axum::middleware::from_fn_with_state(
        drain.draining.clone(),
        crate::drain::layer,
    ));
    spawn_reloads(
        &cluster,
        tls.clone(),
        api_keys.clone(),
        config.reload_interval,
        shutdown.clone(),
    );
    let (owner, served_tls, stop) = (cluster.clone(), tls.clone(), drain.stop.clone());
    let task = tokio::spawn(async move {
        let served = match served_tls {
            Some(tls) => crate::tls::serve(listener, app, tls, shutdown).await,
            None => {
                // Nagle off: streamed tokens are small writes, and one held back until the
                // client's delayed ACK (40 ms on Linux) is a stall in its stream.
                let listener = axum::serve::ListenerExt::tap_io(listener, |t| {
                    let _ = t.set_nodelay(true);
                });
                axum::serve(listener, app)
                    .with_graceful_shutdown(shutdown.cancelled_owned())
                    .await
            }
        };
        // The server has stopped (on `stop`, or failing): the watches, discovery, feeds
        // and reloads end on the same token; the task ends once they have.
        stop.cancel();
        owner.finish_tasks(TASKS_PATIENCE).await;
        served.map_err(RouterError::Serve)
    });
    stop_on_error.disarm();
    Ok(Running {
        addr,
        cluster,
        task,
        tls,
        keys: api_keys,
        draining: drain.draining.clone(),
    })
}

/// The API keys of `--api-keys-file`, with their per-key metrics when `--key-metrics` is on.
fn load_keys(
    config: &RouterConfig,
    registry: &mut Registry,
) -> Result<Option<Arc<Keys>>, RouterError> {
    let Some(p) = &config.api_keys_file else {
        return Ok(None);
    };
    let key_metrics = config.key_metrics.then(|| KeyMetrics::new(registry));
    let keys = Keys::load(p, key_metrics)?;
    tracing::info!(keys = keys.len(), file = %p.display(), "API keys loaded");
    Ok(Some(Arc::new(keys)))
}

/// Starts every source of workers the flags name: the static `--prefill`/`--decode` lists,
/// etcd, Kubernetes; each runs until `shutdown`.
async fn start_discovery(
    config: &RouterConfig,
    cluster: &Arc<Cluster>,
    shutdown: &CancellationToken,
) -> Result<(), RouterError> {
    let mut workers: Vec<(Role, String)> = config
        .prefill
        .iter()
        .map(|e| (Role::Prefill, e.clone()))
        .collect();
    workers.extend(config.decode.iter().map(|e| (Role::Decode, e.clone())));
    Box::new(Static { workers }).start(cluster.clone(), shutdown.clone())?;
    let etcd = config.etcd_endpoints();
    if !etcd.is_empty() {
        let discovery = Etcd::connect(&etcd, &config.etcd_prefix)
            .await
            .map_err(|source| RouterError::Etcd {
                endpoints: etcd.join(","),
                source: Box::new(source),
            })?;
        Box::new(discovery).start(cluster.clone(), shutdown.clone())?;
        tracing::info!(endpoints = %etcd.join(","), prefix = %config.etcd_prefix, "etcd discovery started");
    }
    if config.kubernetes() {
        let selector = config.kube_selector.as_deref().unwrap_or_default();
        let mut discovery = Kube::connect(config.kube_namespace.as_deref(), selector)
            .await
            .map_err(|source| RouterError::Kube {
                selector: selector.to_string(),
                source: Box::new(source),
            })?;
        discovery.relist_every = config.kube_relist;
        let namespace = discovery.namespace().to_string();
        Box::new(discovery).start(cluster.clone(), shutdown.clone())?;
        tracing::info!(%namespace, %selector, "kubernetes discovery started");
    }
    Ok(())
}

/// What requests go to: the dispatcher over cleave workers, or (`--kv-events`) the pool of
/// vLLM/SGLang engine pods.
fn backend(
    config: &RouterConfig,
    cluster: &Arc<Cluster>,
    model_name: String,
    metrics: &Arc<RouterMetrics>,
    shutdown: &CancellationToken,
) -> Result<Arc<dyn crate::api::backend::Backend>, RouterError> {
    let place = PlaceConfig::from(&config.placement);
    Ok(match config.kv_events {
        Some(_) => Arc::new(crate::events::start_pool(
            config,
            cluster.clone(),
            &place,
            model_name,
            shutdown.clone(),
        )?),
        None => Arc::new(
            Dispatcher::new(cluster.clone(), config.policy.build(&place), model_name)
                .with_metrics(metrics.clone())
                .with_migration_limit(config.migration_limit),
        ),
    })
}

/// Rereads the TLS files and the API keys file every `every` and on `SIGHUP`, until
/// `shutdown`. A file that changed but does not load is logged; what was in force stays.
fn spawn_reloads(
    cluster: &Cluster,
    tls: Option<Arc<TlsReloader>>,
    keys: Option<Arc<Keys>>,
    every: Duration,
    shutdown: CancellationToken,
) {
    if tls.is_none() && keys.is_none() {
        return;
    }
    cluster.spawn(async move {
        #[cfg(unix)]
        let mut hangup =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tick.tick().await;
        loop {
            let signalled = async {
                #[cfg(unix)]
                if let Some(h) = hangup.as_mut() {
                    h.recv().await;
                    return;
                }
                std::future::pending::<()>().await
            };
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tick.tick() => {}
                _ = signalled => tracing::info!("SIGHUP: rereading the TLS and API key files"),
            }
            let (tls, keys) = (tls.clone(), keys.clone());
            // Small files, but file IO all the same: off the async threads.
            let done = tokio::task::spawn_blocking(move || {
                if let Some(t) = tls {
                    match t.reload() {
                        Ok(true) => tracing::info!(cert = %t.files().cert.display(), "TLS certificate reloaded"),
                        Ok(false) => {}
                        Err(e) => tracing::warn!(error = %error_chain(&e), "TLS files changed but do not load; the previous certificate stays in force"),
                    }
                }
                if let Some(k) = keys {
                    match k.reload() {
                        Ok(true) => tracing::info!(keys = k.len(), "API keys reloaded"),
                        Ok(false) => {}
                        Err(e) => tracing::warn!(error = %error_chain(&e), "API keys file changed but does not load; the previous keys stay in force"),
                    }
                }
            })
            .await;
            if let Err(e) = done {
                tracing::error!(error = %e, "reload task failed");
            }
        }
    });
}

/// Serves until Ctrl-C or SIGTERM, printing `{"http":"addr"}` on stdout once listening.
/// With `--mode endpoint-picker`, runs the endpoint picker instead ([`crate::epp`]).
pub fn serve_until_signal(config: RouterConfig) -> Result<(), RouterError> {
    if config.mode == crate::config::Mode::EndpointPicker {
        return crate::epp::serve_until_signal(config);
    }
    let rt = cleave_telemetry::runtime(config.runtime_threads).map_err(RouterError::Runtime)?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let running = run(config, shutdown.clone()).await?;
        if running.tls.is_some() {
            println!("{{\"http\":\"{}\",\"tls\":true}}", running.addr);
        } else {
            println!("{{\"http\":\"{}\"}}", running.addr);
        }
        cleave_telemetry::cancel_on_signal(shutdown);
        running.task.await?
    })
}
