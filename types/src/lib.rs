//! `cleave-types`: the few types every part of cleave speaks, in a crate that depends on nothing
//! heavy, so that a component can use them without linking the engine, UCX, etcd or tonic.
//! Everything here is vocabulary: the engine, the transports and the router implement or use it.
//!
//! - [`kv`]: [`BlockHash`], the chained hash of a KV block and how it is computed, the
//!   [`KvEvent`]s a worker's prefix cache publishes ([`KvEventRecord`]: an event with its
//!   sequence id), and the [`kv::KvRegion`] trait the KV transport implements;
//! - [`collective`]: the [`collective::Collective`] trait a tensor- or expert-parallel step
//!   combines ranks through, implemented by the collective transport;
//! - [`WorkerId`]: the id a router knows a worker by;
//! - [`FinishReason`]: why a generation ended, with its wire names;
//! - [`choices`]: the KV element type, KV transport and collective transport a flag picks;
//! - [`duration`]: the one grammar of every duration flag (`250ms`, `30s`, `2m`, `1h`, or
//!   plain seconds);
//! - [`trace`]: the Mooncake request-trace format that the routing simulator replays and the
//!   load generator sends.

#![forbid(unsafe_code)]

pub mod choices;
pub mod collective;
pub mod duration;
pub mod kv;
pub mod trace;

pub use kv::{BlockHash, KvEvent, KvEventRecord};

/// The id the router knows a worker by (assigned by discovery; stable for the worker's life).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct WorkerId(pub u64);

impl std::fmt::Display for WorkerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "w{}", self.0)
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context limit.
    Length,
    /// The caller cancelled it (or dropped its stream).
    Cancelled,
    /// The worker gave up on it (its KV did not arrive without local fallback, it is shutting
    /// down, or it is out of KV memory).
    Aborted,
}

impl FinishReason {
    /// Every reason.
    pub const ALL: [FinishReason; 4] = [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Cancelled,
        FinishReason::Aborted,
    ];

    /// The name on the wire and in OpenAI's `finish_reason` (`stop`, `length`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::Aborted => "aborted",
        }
    }
}

impl std::fmt::Display for FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_serialize_as_their_wire_names() {
        for r in FinishReason::ALL {
            let json = serde_json::to_string(&r).unwrap();
            assert_eq!(json, format!("\"{}\"", r.as_str()));
            assert_eq!(r.to_string(), r.as_str());
        }
    }
}
