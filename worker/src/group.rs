//! Worker groups: one worker made of several processes (tensor-parallel ranks). Rank 0, the
//! leader, serves gRPC, registers and runs the scheduler; it broadcasts each step to the other
//! ranks, which only compute ([`cleave_engine::engine::run_follower`]). Membership comes from flags or the
//! environment LeaderWorkerSet provides. See docs/worker-groups.md.

use std::sync::Arc;

use cleave_collective::{GroupConfig, NetGroup};
use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;
use cleave_engine::model::Model;
use cleave_text::tokenizer::Tokenizer;
use cleave_types::collective::{Collective, SingleRank};

pub use cleave_config::group::{size_from_flags, GroupArgs, Membership};

use crate::WorkerError;

/// Joins the group (blocking until every rank is there).
pub fn connect(args: &GroupArgs, m: &Membership) -> Result<Arc<NetGroup>, WorkerError> {
    let mut cfg = GroupConfig::new(m.rank, m.size, m.leader.clone());
    cfg.bind_addr = args.bind;
    cfg.advertise_host = args.advertise.clone();
    cfg.transport = args.collective_transport;
    cfg.timeout = args.timeout;
    cfg.connect_timeout = args.connect_timeout;
    tracing::info!(rank = m.rank, size = m.size, leader = %m.leader, transport = ?args.collective_transport, "joining the worker group");
    let g = NetGroup::connect(cfg).map_err(|source| WorkerError::JoinGroup {
        leader: m.leader.clone(),
        rank: m.rank,
        source,
    })?;
    Ok(Arc::new(g))
}

/// This rank's model shard (GGUF file or Hugging Face directory) and the tokenizer,
/// computing with `collective`; `--ep` is refused for a dense model.
pub fn load(
    path: &std::path::Path,
    threads: Threads,
    collective: Option<Arc<dyn Collective>>,
    args: &GroupArgs,
) -> Result<(Arc<Model>, Arc<Tokenizer>), WorkerError> {
    let c = collective.unwrap_or_else(|| Arc::new(SingleRank));
    let (rank, world) = (c.rank(), c.world());
    let l = Loaded::open_rank(path, c, threads).map_err(|source| WorkerError::Load {
        rank,
        world,
        path: path.to_path_buf(),
        source,
    })?;
    if let Some(ep) = args.ep.filter(|&ep| ep > 1) {
        if l.model.config.moe.is_none() {
            return Err(WorkerError::DenseEp {
                ep,
                path: path.to_path_buf(),
            });
        }
    }
    Ok((l.model, l.tokenizer))
}
