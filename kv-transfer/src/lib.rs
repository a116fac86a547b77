//! Moves KV-cache blocks from a prefill worker straight into a decode worker's KV memory.
//!
//! Sits between the engines of disaggregated workers: the decode worker allocates its KV pool
//! from a [`Transport`] ([`Transport::allocate_region`]), hands the [`Region`] to its engine's KV
//! cache (it implements [`cleave_types::kv::KvRegion`]) and publishes the region's
//! [`RegionDescriptor`] plus its [`WorkerAddress`]. A prefill worker then calls
//! [`Transport::write`] with a list of [`WriteOp`]s (block runs) to copy its finished blocks into
//! that region; the call returns once the bytes are visible at the remote.
//!
//! Data path: [`plan`](mod@plan) (validate and coalesce ops) → `send` (the backend moves bytes) → `recv`
//! (the owner's side, only active for TCP: UCX writes land one-sided with the owner asleep).
//!
//! Backends, one file each under `transport/`: UCX one-sided RMA (`ucx`, compiled when the build
//! finds UCX with pkg-config; see `cleave-ucx-sys`) and plain TCP (`tcp`, always available).
//! [`default_transport`] picks UCX when it is available and falls back to TCP, logging once.

pub mod bench;
mod error;
pub mod plan;
mod region;
mod transport;

pub use error::{Error, Side};
pub use plan::{plan, Run};
pub use region::{Region, RegionHandle, RegionId};
pub use transport::tcp::TcpTransport;
#[cfg(have_ucx)]
pub use transport::ucx::UcxTransport;
pub use transport::{
    default_transport, ucx_available, ucx_or_skip, Backend, BackendChoice, Direction, Transport,
    TransportConfig,
};

use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::time::Duration;

/// Where to reach a worker's transport. Serializable so discovery can publish it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WorkerAddress {
    /// The TCP listener every transport runs: the TCP backend's data path, and the UCX
    /// backend's control path (write confirmation, liveness) and fallback.
    pub tcp: SocketAddr,
    /// The packed UCX worker address, when the worker runs the UCX backend.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "hex_bytes::opt"
    )]
    pub ucx: Option<Vec<u8>>,
}

/// How a peer reaches a region remotely. Serializable (hex strings for the byte parts).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// The owner's TCP listener.
    pub owner: SocketAddr,
    /// The region's id at the owner; unique across owner restarts (random base).
    pub id: RegionId,
    /// Bytes in the region.
    pub len: u64,
    /// The UCX view of the region, when it was allocated by the UCX backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ucx: Option<UcxRegionDescriptor>,
}

/// The UCX part of a [`RegionDescriptor`]: what `ucp_put` needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UcxRegionDescriptor {
    /// The region's base address in the owner's address space.
    pub base: u64,
    /// The packed remote key (`ucp_rkey_pack`).
    #[serde(with = "hex_bytes")]
    pub rkey: Vec<u8>,
}

/// One copy between the local region and a remote one (used by both `write` and `read`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteOp {
    /// Byte offset in the local region.
    pub local_offset: usize,
    /// Byte offset in the remote region.
    pub remote_offset: usize,
    /// Bytes to copy.
    pub len: usize,
}

/// What one transfer did.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferStats {
    /// The backend that moved the bytes.
    pub backend: Backend,
    /// Bytes moved.
    pub bytes: u64,
    /// Ops requested by the caller.
    pub requested_ops: usize,
    /// Operations issued after coalescing contiguous ops.
    pub issued_ops: usize,
    /// Time from the call until the bytes were visible at the remote.
    pub elapsed: Duration,
}

impl TransferStats {
    /// The stats of moving `runs` (the coalesced `requested_ops`) with `backend`; `elapsed` is
    /// filled in when the transfer ends.
    pub(crate) fn planned(backend: Backend, requested_ops: usize, runs: &[Run]) -> Self {
        TransferStats {
            backend,
            bytes: runs.iter().map(|r| r.len as u64).sum(),
            requested_ops,
            issued_ops: runs.len(),
            elapsed: Duration::ZERO,
        }
    }
}

/// Hex (de)serialization of byte strings, so descriptors stay readable in JSON.
mod hex_bytes {
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        let text: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        s.serialize_str(&text)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        decode(&text).ok_or_else(|| D::Error::custom("invalid hex string"))
    }

    fn decode(text: &str) -> Option<Vec<u8>> {
        if !text.len().is_multiple_of(2) {
            return None;
        }
        (0..text.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
            .collect()
    }

    pub mod opt {
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(bytes: &Option<Vec<u8>>, s: S) -> Result<S::Ok, S::Error> {
            match bytes {
                Some(b) => super::serialize(b, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
            match Option::<String>::deserialize(d)? {
                Some(text) => super::decode(&text)
                    .map(Some)
                    .ok_or_else(|| serde::de::Error::custom("invalid hex string")),
                None => Ok(None),
            }
        }
    }
}
