//! The crate's error type.

use crate::RegionId;
use std::time::Duration;

/// Which end of a copy an error is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The caller's region.
    Local,
    /// The peer's region.
    Remote,
}

impl std::fmt::Display for Side {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Errors moving KV blocks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The peer could not be reached (connection refused, endpoint creation failed).
    #[error("peer {peer} is unreachable")]
    PeerUnreachable {
        /// The peer, as its TCP address.
        peer: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The connection to the peer broke during a transfer (the peer went away or restarted).
    #[error("connection to peer {peer} broke")]
    Connection {
        /// The peer, as its TCP address.
        peer: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The peer does not know the region (it was freed, or the peer restarted).
    #[error("region {id} is unknown at peer {peer}")]
    UnknownRegion {
        /// The peer, as its TCP address.
        peer: String,
        /// The region.
        id: RegionId,
    },
    /// An op reaches outside a region.
    #[error("{side} range {offset}..{end} is outside the {side} region of {region_len} bytes", end = offset.saturating_add(*len))]
    OutOfBounds {
        /// Which region.
        side: Side,
        /// First byte of the op.
        offset: usize,
        /// Bytes in the op.
        len: usize,
        /// Bytes in the region.
        region_len: usize,
    },
    /// The caller cancelled the transfer; the target range holds undefined bytes.
    #[error("transfer cancelled")]
    Cancelled,
    /// The transfer did not complete in time; the target range holds undefined bytes.
    #[error("transfer timed out after {0:?}")]
    TimedOut(Duration),
    /// The peer answered something this version does not understand.
    #[error("protocol error from peer {peer}: {message}")]
    Protocol {
        /// The peer, as its TCP address.
        peer: String,
        /// What was wrong.
        message: String,
    },
    /// Allocating or registering region memory failed.
    #[error("cannot allocate a region of {bytes} bytes: {reason}")]
    Allocate {
        /// Bytes requested.
        bytes: usize,
        /// Why.
        reason: String,
    },
    /// Binding the transport's TCP listener failed.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A UCX call failed.
    #[error("{call} failed: {status}")]
    Ucx {
        /// The UCX function.
        call: &'static str,
        /// UCX's status string.
        status: String,
    },
    /// The UCX backend was requested but this build or machine has no UCX.
    #[error("UCX is not available in this build")]
    UcxUnavailable,
    /// The transport's background thread or task has stopped.
    #[error("the transport has shut down")]
    Shutdown,
}
