//! Starting a worker: model, transport-allocated KV memory, engine, gRPC and HTTP servers.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use cleave_engine::engine::{Engine, EngineConfig, GroupLink};
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvCache, KvLayout};
use cleave_engine::schedule::SchedulerConfig;
use cleave_kv_transfer::{default_transport, RegionHandle, Transport};
use cleave_types::collective::Collective;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::service::Routes;

use crate::config::{Role, WorkerConfig};
use crate::error::WorkerError;
use crate::metrics::WorkerMetrics;
use crate::rank_kv::RankRegion;
use crate::watch::WatchHub;

/// Everything a worker's request handlers share.
pub struct WorkerState {
    /// Settings.
    pub config: WorkerConfig,
    /// The engine.
    pub engine: Arc<Engine>,
    /// Moves KV between workers.
    pub transport: Arc<dyn Transport>,
    /// This worker's KV region (the engine's KV memory), for transfers.
    pub region: RegionHandle,
    /// The engine's KV layout.
    pub layout: KvLayout,
    /// Metrics.
    pub metrics: Arc<WorkerMetrics>,
    /// Ranks in this worker's group (1: a single process).
    pub group_size: usize,
    /// The KV regions of ranks 1..N-1 of this worker's group (empty for a single process).
    pub ranks: Vec<RankRegion>,
    /// KV events and load for routers.
    pub watch: Arc<WatchHub>,
    /// Mutual TLS of the gRPC server, the channels to other workers and the KV transport
    /// (`--internal-tls-*`); `None`: plain.
    pub internal_tls: Option<cleave_tls::Mutual>,
    /// Every task the worker spawns: its background tasks (the KV-event collector, the failure
    /// watch) and each request's (a `Generate` call's relay, its KV import, a `Watch` stream).
    /// The worker's task ends once they have (or [`TASKS_PATIENCE`] after its servers).
    pub tasks: TaskTracker,
    registry: Mutex<Registry>,
    ready: AtomicBool,
    /// The engine stopped because a rank of its group failed.
    failed: AtomicBool,
}

pub use cleave_telemetry::TASKS_PATIENCE;

/// A started worker.
pub struct Running {
    /// Where gRPC listens.
    pub grpc_addr: SocketAddr,
    /// Where /health, /ready and /metrics listen.
    pub http_addr: SocketAddr,
    /// Shared state (tests read the engine's stats through it).
    pub state: Arc<WorkerState>,
    /// Ends when the servers stop.
    pub task: tokio::task::JoinHandle<Result<(), WorkerError>>,
}

/// A worker role as the runtime serves it: which role it registers as, and its gRPC service
/// over the shared state. The roles live in their own crates (`cleave-decode-worker`,
/// `cleave-prefill-worker`), which meet only through `cleave-proto`.
#[derive(Clone, Copy)]
pub struct RoleService {
    /// Registration, logs and metrics say this.
    pub role: Role,
    /// The role's gRPC service on the worker's state.
    pub routes: fn(Arc<WorkerState>) -> Routes,
}

impl std::fmt::Debug for RoleService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoleService")
            .field("role", &self.role)
            .finish_non_exhaustive()
    }
}

/// This worker's KV memory: a region of the transport (so peers can write into it) holding
/// `blocks` blocks of `layout`, and the cache over it.
struct KvMemory {
    cache: KvCache,
    handle: RegionHandle,
    layout: KvLayout,
    blocks: usize,
}

impl KvMemory {
    /// Sizes the pool (`--kv-blocks` or `--kv-memory`) and allocates it from `transport`.
    fn allocate(
        config: &WorkerConfig,
        model: &cleave_engine::model::Model,
        transport: &dyn Transport,
    ) -> Result<KvMemory, WorkerError> {
        let layout = model.kv_layout(cleave_engine::kv::DEFAULT_BLOCK_SIZE, config.kv_dtype);
        let blocks = crate::config::kv_pool_blocks(config, model, &layout)?;
        let region = transport
            .allocate_region(blocks * layout.block_bytes())
            .map_err(WorkerError::Region)?;
        let handle = region.handle();
        let cache = KvCache::new(layout, blocks, Box::new(region))?;
        Ok(KvMemory {
            cache,
            handle,
            layout,
            blocks,
        })
    }
}

/// Every other rank's transport address and KV region, for rank-to-rank P/D
/// ([`crate::rank_kv`]).
async fn rank_regions(
    group: &Arc<cleave_collective::NetGroup>,
    transport: &dyn Transport,
    handle: &RegionHandle,
) -> Result<Vec<RankRegion>, WorkerError> {
    let mine = RankRegion {
        address: transport.local_address(),
        region: handle.descriptor(),
    };
    let g = group.clone();
    let mut all =
        tokio::task::spawn_blocking(move || crate::rank_kv::exchange(g.as_ref(), &mine)).await??;
    all.remove(0);
    Ok(all)
}

type ServerTask<E> = tokio::task::JoinHandle<Result<(), E>>;

/// Serves the role's gRPC `routes` on `listener` (over mutual TLS when configured) until
/// `stop`.
fn serve_grpc(
    listener: TcpListener,
    routes: Routes,
    state: &WorkerState,
    stop: CancellationToken,
) -> Result<ServerTask<tonic::transport::Error>, WorkerError> {
    // Nagle off: token events are small writes, and one held back until the router's delayed
    // ACK (40 ms on Linux) is a stall in the client's stream.
    let incoming = tonic::transport::server::TcpIncoming::from_listener(listener, true, None)
        .map_err(WorkerError::Grpc)?;
    let mut server = tonic::transport::Server::builder();
    if let Some(tls) = &state.internal_tls {
        server = server
            .tls_config(tls.grpc_server())
            .map_err(|e| WorkerError::Grpc(e.into()))?;
    }
    let server = server.add_routes(routes);
    Ok(tokio::spawn(async move {
        server
            .serve_with_incoming_shutdown(incoming, stop.cancelled_owned())
            .await
    }))
}

/// Serves `/health`, `/ready` and `/metrics` on `listener` until `stop`.
fn serve_http(
    listener: TcpListener,
    state: &Arc<WorkerState>,
    stop: CancellationToken,
) -> ServerTask<std::io::Error> {
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics_text))
        .with_state(state.clone());
    tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(stop.cancelled_owned())
            .await
    })
}

/// Loads the model, allocates the KV pool from the transport and starts serving `service`'s
/// role until `shutdown`. Returns once both listeners are bound.
pub async fn run(
    service: RoleService,
    config: WorkerConfig,
    shutdown: CancellationToken,
) -> Result<Running, WorkerError> {
    let role = service.role;
    // The effective configuration (flags, environment and defaults), once.
    tracing::info!(?role, config = ?config, "worker configuration");
    let threads = if config.threads <= 1 {
        Threads::single()
    } else {
        Threads::new(config.threads)
    };
    let membership = config.group.membership()?;
    if let Some(m) = membership.as_ref().filter(|m| m.rank > 0) {
        return Err(WorkerError::FollowerRank(m.rank));
    }
    let internal_tls = cleave_tls::Mutual::from_args(&config.internal_tls)?;
    let group_size = membership.as_ref().map_or(1, |m| m.size);
    let group = match membership {
        Some(m) => {
            let args = config.group.clone();
            Some(tokio::task::spawn_blocking(move || crate::group::connect(&args, &m)).await??)
        }
        None => None,
    };
    let path = config.model.clone();
    let collective = group.clone().map(|g| g as Arc<dyn Collective>);
    let args = config.group.clone();
    let (model, tokenizer) =
        tokio::task::spawn_blocking(move || crate::group::load(&path, threads, collective, &args))
            .await??;
    let transport_config = cleave_kv_transfer::TransportConfig {
        tls: internal_tls.clone(),
        ..crate::kv_addr::transport_config(&config)?
    };
    let transport = default_transport(&transport_config).map_err(WorkerError::Transport)?;
    let kv = KvMemory::allocate(&config, &model, transport.as_ref())?;
    let ranks = match &group {
        Some(g) => rank_regions(g, transport.as_ref(), &kv.handle).await?,
        None => Vec::new(),
    };
    let KvMemory {
        cache,
        handle,
        layout,
        blocks: kv_blocks,
    } = kv;
    let engine_config = EngineConfig {
        num_blocks: kv_blocks,
        kv_dtype: config.kv_dtype,
        max_model_len: None,
        scheduler: SchedulerConfig {
            step_tokens: config.step_tokens,
            prefill_tokens_while_decoding: config.prefill_tokens_while_decoding,
            ..Default::default()
        },
        tiers: crate::tiers::tier_config(&config, group_size)?,
    };
    let link = group.map(|g| GroupLink {
        collective: g,
        heartbeat: config.group.heartbeat,
    });
    let engine = Arc::new(Engine::start_leader(
        model,
        tokenizer,
        engine_config,
        cache,
        link,
    ));
    // Registration, the Watch streams and gRPC end when the group fails; HTTP (health,
    // readiness, metrics) stays until the process exits.
    let serving = shutdown.child_token();
    let mut registry = Registry::default();
    let metrics = Arc::new(WorkerMetrics::new(&mut registry));
    // Every task the worker spawns (WorkerState::tasks).
    let tasks = TaskTracker::new();
    let watch = WatchHub::start(engine.clone(), serving.clone(), &tasks);
    let state = Arc::new(WorkerState {
        config: config.clone(),
        engine,
        transport,
        region: handle,
        layout,
        metrics,
        group_size,
        ranks,
        watch,
        internal_tls,
        tasks: tasks.clone(),
        registry: Mutex::new(registry),
        ready: AtomicBool::new(false),
        failed: AtomicBool::new(false),
    });
    tracing::info!(?role, backend = ?state.transport.backend(), kv_blocks, "worker starting");

    let bind = |what, addr| move |source| WorkerError::Bind { what, addr, source };
    let grpc = TcpListener::bind(config.grpc_addr)
        .await
        .map_err(bind("gRPC", config.grpc_addr))?;
    let http = TcpListener::bind(config.http_addr)
        .await
        .map_err(bind("HTTP", config.http_addr))?;
    let grpc_addr = grpc.local_addr().map_err(|e| WorkerError::Grpc(e.into()))?;
    let http_addr = http.local_addr().map_err(WorkerError::Http)?;

    let grpc_task = serve_grpc(
        grpc,
        (service.routes)(state.clone()),
        &state,
        serving.clone(),
    )?;
    let http_task = serve_http(http, &state, shutdown.clone());
    state.ready.store(true, Ordering::SeqCst);
    tracing::info!(%grpc_addr, %http_addr, "worker ready");
    let registration = match crate::register::start(role, &config, grpc_addr, serving.clone())
        .await
        .map_err(WorkerError::from)
    {
        Ok(r) => r,
        Err(e) => {
            shutdown.cancel();
            return Err(e);
        }
    };
    tasks.spawn(watch_failure(
        state.clone(),
        serving,
        shutdown.clone(),
        config.group.failed_exit_after,
    ));
    let st = state.clone();
    let task = tokio::spawn(async move {
        if let Some(r) = registration {
            let _ = r.await;
        }
        let grpc = grpc_task.await;
        let http = http_task.await;
        // Both servers have stopped, so `serving` (a child of `shutdown`) is cancelled too.
        cleave_telemetry::finish_tasks(&tasks, TASKS_PATIENCE).await;
        grpc?.map_err(|e| WorkerError::Grpc(e.into()))?;
        http?.map_err(WorkerError::Http)?;
        if st.failed.load(Ordering::SeqCst) {
            return Err(WorkerError::GroupFailed);
        }
        Ok(())
    });
    Ok(Running {
        grpc_addr,
        http_addr,
        state,
        task,
    })
}

/// When the engine fails (a rank of the group died): not ready at once, deregistered, Watch
/// streams and gRPC closed (so routers drop this worker), then after `exit_after` everything
/// stops and the worker's task ends with an error (the process exits with status 1).
async fn watch_failure(
    state: Arc<WorkerState>,
    serving: CancellationToken,
    shutdown: CancellationToken,
    exit_after: std::time::Duration,
) {
    loop {
        tokio::select! {
            _ = serving.cancelled() => return,
            _ = tokio::time::sleep(std::time::Duration::from_millis(50)) => {}
        }
        if state.engine.stats().failed {
            break;
        }
    }
    tracing::error!("the worker group failed: not ready, deregistering");
    state.failed.store(true, Ordering::SeqCst);
    state.ready.store(false, Ordering::SeqCst);
    serving.cancel();
    tokio::time::sleep(exit_after).await;
    shutdown.cancel();
}

async fn ready(State(s): State<Arc<WorkerState>>) -> (StatusCode, &'static str) {
    if s.failed.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, "worker group failed")
    } else if s.ready.load(Ordering::SeqCst) {
        (StatusCode::OK, "ready")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "starting")
    }
}

async fn metrics_text(
    State(s): State<Arc<WorkerState>>,
) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    s.metrics.observe_engine(&s.engine.stats());
    s.metrics.observe_experts(&s.engine.expert_counts());
    let mut out = String::new();
    let registry = s.registry.lock().expect("registry lock");
    let status = match prometheus_client::encoding::text::encode(&mut out, &registry) {
        Ok(()) => StatusCode::OK,
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (
        status,
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        out,
    )
}
