//! Collectives for a group of processes: the multi-rank implementation of the
//! [`Collective`](cleave_types::collective::Collective) trait that the engine's
//! tensor- and expert-parallel forward pass combines ranks through.
//!
//! [`NetGroup::connect`] forms the group (rank 0 listens at the leader address; the others
//! rendezvous there and then connect to each other, one TCP connection per pair of ranks). Every
//! collective is a blocking call with a deadline; any failure (a peer's connection closing, a
//! timeout, mismatched calls) aborts the group on this rank, which closes its connections, so
//! the failure reaches every other rank promptly instead of leaving it waiting.
//!
//! Algorithms: all-reduce that adds every element in rank order whatever the message size
//! (direct exchange when small; reduce-scatter of segments then all-gather when large), so a
//! token's sum never depends on the batch it travels in and every rank ends bit-identical;
//! ring all-gather for large all-gathers, direct exchange for small ones, all-pairs all-to-all(v),
//! binomial-tree broadcast, and a one-round barrier. See docs/collectives.md.

mod connect;
mod group;
mod ops;
#[cfg(have_ucx)]
mod ucx;
mod wire;

/// The unit tests run under the integration tests' allocator that catches writes into freed
/// buffers.
#[cfg(test)]
#[path = "../tests/common/quarantine.rs"]
mod quarantine;
#[cfg(test)]
#[global_allocator]
static ALLOC: quarantine::Quarantine = quarantine::Quarantine;

use std::net::SocketAddr;
use std::time::Duration;

pub use connect::Pending;
pub use group::NetGroup;

/// How ranks talk to each other (defined with the other flag choices in `cleave-types`; UCX is
/// refused by [`NetGroup::connect`] in builds without it).
pub use cleave_types::choices::CollectiveTransport as Transport;

/// Who this rank is and how to reach the group.
#[derive(Clone, Debug)]
pub struct GroupConfig {
    /// This rank, `0..world`.
    pub rank: usize,
    /// Ranks in the group.
    pub world: usize,
    /// `host:port` of rank 0's rendezvous listener.
    pub leader_addr: String,
    /// Where this rank listens. Default: rank 0 every interface at the leader address's port,
    /// others every interface at an ephemeral port.
    pub bind_addr: Option<SocketAddr>,
    /// Host name or IP the other ranks use to reach this one. Default: the bind IP when it is a
    /// specific one, else the local IP of the connection to the leader.
    pub advertise_host: Option<String>,
    /// Transport between ranks.
    pub transport: Transport,
    /// Deadline of each collective call.
    pub timeout: Duration,
    /// How long forming the group may take (waiting for the leader and the other ranks).
    pub connect_timeout: Duration,
    /// All-reduce and all-gather of at most this many bytes per rank use one direct exchange
    /// (latency) instead of the segmented algorithms (bandwidth). With
    /// [`AllReduceOrder::RankOrder`] this changes the traffic, never the result.
    pub small_bytes: usize,
    /// How a large all-reduce orders its additions.
    pub all_reduce: AllReduceOrder,
}

/// How an all-reduce larger than [`GroupConfig::small_bytes`] adds the ranks' buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AllReduceOrder {
    /// Every element is summed as `((x0 + x1) + x2) + ...` in rank order, whatever the
    /// message size, exactly like the small-message path: each rank receives every other
    /// rank's piece of its own segment, adds the pieces in rank order, and the finished
    /// segments are exchanged (the ring's bytes per rank, two rounds). A token's result then
    /// does not depend on how many other tokens share the message (batch invariance of
    /// tensor-parallel groups; docs/collectives.md).
    #[default]
    RankOrder,
    /// Ring reduce-scatter: partial sums travel around the ring and each rank adds its own
    /// values to what arrives, so an element's order of additions depends on the segment it
    /// falls in, i.e. on the message size and the element's offset. Results are still
    /// identical on every rank, but a token's values change with the batch it is in. Kept only
    /// to measure what the rank order costs.
    Ring,
}

impl GroupConfig {
    /// Rank `rank` of `world`, rendezvous at `leader_addr`, defaults for the rest.
    pub fn new(rank: usize, world: usize, leader_addr: impl Into<String>) -> Self {
        GroupConfig {
            rank,
            world,
            leader_addr: leader_addr.into(),
            bind_addr: None,
            advertise_host: None,
            transport: Transport::Tcp,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(60),
            small_bytes: 64 * 1024,
            all_reduce: AllReduceOrder::RankOrder,
        }
    }
}

/// Why the group could not be formed.
#[derive(Debug, thiserror::Error)]
pub enum GroupError {
    /// A socket operation failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A peer said something unexpected during the handshake.
    #[error("group handshake: {0}")]
    Protocol(String),
    /// The configuration cannot work.
    #[error("group config: {0}")]
    Config(String),
    /// The group was not complete in time.
    #[error("group not formed within {0:?}: {1}")]
    Timeout(Duration, String),
    /// The transport is not available.
    #[error("{0}")]
    Unsupported(String),
}

/// Whether this build can use the transport.
pub fn transport_available(t: Transport) -> bool {
    match t {
        Transport::Tcp => true,
        Transport::Ucx => cfg!(have_ucx),
    }
}
