//! Why flags do not make a configuration. Every variant names the flag at fault.

use std::borrow::Cow;

/// A configuration the binaries refuse to start with.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `flag` was given without what it needs.
    #[error("{flag} needs {needs}")]
    Needs {
        /// The flag given.
        flag: &'static str,
        /// What must come with it.
        needs: &'static str,
    },
    /// `flag` cannot be combined with other flags given.
    #[error("{flag} {why}")]
    Conflict {
        /// The flag given.
        flag: &'static str,
        /// Why, and what to drop.
        why: &'static str,
    },
    /// `flag`'s value is out of range or malformed.
    #[error("{flag} {problem}")]
    BadValue {
        /// The flag.
        flag: &'static str,
        /// What is wrong with the value.
        problem: Cow<'static, str>,
    },
    /// No source of decode workers was given.
    #[error(
        "at least one decode worker source is required: --decode, --etcd or --discovery kubernetes"
    )]
    NoDecodeWorkers,
    /// `--tp` and `--ep` name different group sizes.
    #[error(
        "--tp {tp} and --ep {ep} differ: attention runs tensor-parallel over the expert-parallel \
         ranks, so a group has one size (give one of them)"
    )]
    GroupSizes {
        /// `--tp`.
        tp: usize,
        /// `--ep`.
        ep: usize,
    },
    /// The rank is not below the group size.
    #[error("group rank {rank} is not a rank of a group of {size} (--group-rank, --tp)")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The group size.
        size: usize,
    },
    /// An environment variable the membership is read from is not a number.
    #[error("{name}={value:?} is not a non-negative integer")]
    BadEnv {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },
    /// Only part of the internal mutual-TLS files were given.
    #[error(transparent)]
    InternalTls(#[from] crate::internal_tls::PartialInternalTls),
}
