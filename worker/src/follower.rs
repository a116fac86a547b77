//! A follower rank's process: join the group, load this rank's shard, and run the leader's
//! steps until the leader stops the group (exit 0) or the group fails (an error: exit 1).

use axum::routing::get;
use cleave_engine::engine::run_follower_with;
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::KvCache;
use cleave_kv_transfer::default_transport;
use tokio_util::sync::CancellationToken;

use crate::group::Membership;
use crate::rank_kv::{FollowerRelay, RankRegion};
use crate::{WorkerConfig, WorkerError};

/// Runs rank `m.rank` (> 0) of the group until the leader stops it or the group fails;
/// `shutdown` (a signal) aborts the group, which stops every rank.
pub async fn run(
    config: WorkerConfig,
    m: Membership,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    let threads = if config.threads <= 1 {
        Threads::single()
    } else {
        Threads::new(config.threads)
    };
    let args = config.group.clone();
    let mm = m.clone();
    let group = tokio::task::spawn_blocking(move || crate::group::connect(&args, &mm)).await??;
    let path = config.model.clone();
    let g = group.clone();
    let args = config.group.clone();
    let (model, _) = tokio::task::spawn_blocking(move || {
        crate::group::load(
            &path,
            threads,
            Some(crate::fault::compute_collective(g)),
            &args,
        )
    })
    .await??;
    let layout = model.kv_layout(cleave_engine::kv::DEFAULT_BLOCK_SIZE, config.kv_dtype);
    let kv_blocks = crate::config::kv_pool_blocks(&config, &model, &layout)?;
    // The KV pool comes from the transport, so a prefill peer can write this rank's heads
    // straight into it (and a prefill follower can write from it).
    let transport = default_transport(&crate::kv_addr::transport_config(&config)?)
        .map_err(WorkerError::Transport)?;
    let region = transport
        .allocate_region(kv_blocks * layout.block_bytes())
        .map_err(WorkerError::Region)?;
    let local = region.handle();
    let mut cache = KvCache::new(layout, kv_blocks, Box::new(region))?;
    let mine = RankRegion {
        address: transport.local_address(),
        region: local.descriptor(),
    };
    let g = group.clone();
    tokio::task::spawn_blocking(move || crate::rank_kv::exchange(g.as_ref(), &mine)).await??;
    let mut relay = FollowerRelay::new(
        m.rank,
        transport,
        local,
        layout.block_bytes(),
        tokio::runtime::Handle::current(),
    );
    // /health and /ready for the pod's probes (a follower serves no requests: the router's
    // Kubernetes discovery skips follower pods by their group-index label).
    let http = tokio::net::TcpListener::bind(config.http_addr)
        .await
        .map_err(|source| WorkerError::Bind {
            what: "HTTP",
            addr: config.http_addr,
            source,
        })?;
    let http_addr = http.local_addr().map_err(WorkerError::Http)?;
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/ready",
            get(|| async { "ok: a follower rank (its leader serves requests)" }),
        );
    let http_stop = CancellationToken::new();
    let _http_stop = http_stop.clone().drop_guard();
    tokio::spawn(async move {
        axum::serve(http, app)
            .with_graceful_shutdown(http_stop.cancelled_owned())
            .await
    });
    println!(
        "{{\"group_rank\":{},\"group_size\":{},\"http\":\"{http_addr}\"}}",
        m.rank, m.size
    );
    tracing::info!(rank = m.rank, size = m.size, %http_addr, "follower ready");
    let g = group.clone();
    let mut work = tokio::task::spawn_blocking(move || {
        run_follower_with(&model, &mut cache, g.as_ref(), &mut |p: &[u8]| {
            relay.handle(p)
        })
    });
    let res = tokio::select! {
        r = &mut work => r,
        _ = shutdown.cancelled() => {
            group.abort("follower stopped by a signal");
            let _ = work.await;
            tracing::info!(rank = m.rank, "follower stopped by a signal");
            return Ok(());
        }
    };
    match res? {
        Ok(steps) => {
            tracing::info!(rank = m.rank, steps, "the leader stopped the group");
            Ok(())
        }
        Err(source) => Err(WorkerError::FollowerFailed {
            rank: m.rank,
            source,
        }),
    }
}
