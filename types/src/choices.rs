//! Closed sets a flag picks from whose meaning lives in a heavy crate (the engine's KV memory, the
//! KV transport, the collectives): defined here so that the binaries' configuration
//! (`cleave-config`) names them without linking those crates, which re-export them.

use std::str::FromStr;

/// The element type of stored keys and values (`--kv-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    /// 4 bytes per element, exact.
    F32,
    /// 2 bytes per element, half the memory (the default, as llama.cpp's).
    #[default]
    F16,
    /// llama.cpp's Q8_0: blocks of 32 elements, each an f16 scale and 32 signed bytes (34 bytes,
    /// 8.5 bits per element); needs a head size that is a multiple of 32.
    #[serde(rename = "q8_0")]
    #[cfg_attr(feature = "clap", value(name = "q8_0"))]
    Q8_0,
}

impl KvDtype {
    /// Every value.
    pub const ALL: [KvDtype; 3] = [KvDtype::F32, KvDtype::F16, KvDtype::Q8_0];

    /// The flag value (`f32`, `f16`, `q8_0`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Q8_0 => "q8_0",
        }
    }

    /// Elements per stored unit: a row of keys or values is a whole number of units.
    pub fn unit_elems(self) -> usize {
        match self {
            KvDtype::F32 | KvDtype::F16 => 1,
            KvDtype::Q8_0 => 32,
        }
    }

    /// Bytes per stored unit.
    pub fn unit_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
            KvDtype::Q8_0 => 34,
        }
    }

    /// Bytes of a row of `elems` elements (a multiple of [`KvDtype::unit_elems`]).
    pub fn row_bytes(self, elems: usize) -> usize {
        elems / self.unit_elems() * self.unit_bytes()
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        lookup(&KvDtype::ALL, KvDtype::as_str, s)
            .ok_or_else(|| format!("unknown KV dtype {s:?} (expected f32, f16 or q8_0)"))
    }
}

/// Which backend the KV transport uses (`--transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum KvBackendChoice {
    /// UCX when this build and machine have it, else TCP.
    #[default]
    Auto,
    /// UCX or an error.
    Ucx,
    /// TCP only.
    Tcp,
}

impl KvBackendChoice {
    /// Every value.
    pub const ALL: [KvBackendChoice; 3] = [
        KvBackendChoice::Auto,
        KvBackendChoice::Ucx,
        KvBackendChoice::Tcp,
    ];

    /// The flag value (`auto`, `ucx`, `tcp`).
    pub fn as_str(self) -> &'static str {
        match self {
            KvBackendChoice::Auto => "auto",
            KvBackendChoice::Ucx => "ucx",
            KvBackendChoice::Tcp => "tcp",
        }
    }
}

impl FromStr for KvBackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        lookup(&KvBackendChoice::ALL, KvBackendChoice::as_str, s)
            .ok_or_else(|| format!("unknown transport {s:?} (expected auto, ucx or tcp)"))
    }
}

/// How the ranks of a worker group talk to each other (`--group-transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum CollectiveTransport {
    /// One TCP connection per pair of ranks (TCP_NODELAY).
    #[default]
    Tcp,
    /// UCX tag messages (shared memory on one host, RDMA where available), with the TCP mesh
    /// kept as the control path. Refused in builds without UCX.
    Ucx,
}

impl CollectiveTransport {
    /// Every value.
    pub const ALL: [CollectiveTransport; 2] = [CollectiveTransport::Tcp, CollectiveTransport::Ucx];

    /// The flag value (`tcp`, `ucx`).
    pub fn as_str(self) -> &'static str {
        match self {
            CollectiveTransport::Tcp => "tcp",
            CollectiveTransport::Ucx => "ucx",
        }
    }
}

impl FromStr for CollectiveTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        lookup(
            &CollectiveTransport::ALL,
            CollectiveTransport::as_str,
            &s.to_ascii_lowercase(),
        )
        .ok_or_else(|| {
            format!(
                "unknown transport {:?} (tcp or ucx)",
                s.to_ascii_lowercase()
            )
        })
    }
}

/// The value of `all` whose flag name is `s`.
fn lookup<T: Copy>(all: &[T], name: fn(T) -> &'static str, s: &str) -> Option<T> {
    all.iter().copied().find(|&v| name(v) == s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_their_flag_values_and_name_the_bad_one() {
        assert_eq!("f16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert_eq!(KvDtype::F16.row_bytes(64), 128);
        assert_eq!("q8_0".parse::<KvDtype>(), Ok(KvDtype::Q8_0));
        assert_eq!(KvDtype::Q8_0.row_bytes(64), 68);
        assert!("bf16".parse::<KvDtype>().unwrap_err().contains("\"bf16\""));
        assert_eq!("tcp".parse::<KvBackendChoice>(), Ok(KvBackendChoice::Tcp));
        assert!("rdma"
            .parse::<KvBackendChoice>()
            .unwrap_err()
            .contains("\"rdma\""));
        assert_eq!(
            "UCX".parse::<CollectiveTransport>(),
            Ok(CollectiveTransport::Ucx)
        );
        assert!("mpi".parse::<CollectiveTransport>().is_err());
        for v in KvDtype::ALL {
            assert_eq!(v.as_str().parse::<KvDtype>(), Ok(v));
        }
        for v in [
            KvBackendChoice::Auto,
            KvBackendChoice::Ucx,
            KvBackendChoice::Tcp,
        ] {
            assert_eq!(v.as_str().parse::<KvBackendChoice>(), Ok(v));
        }
        for v in CollectiveTransport::ALL {
            assert_eq!(v.as_str().parse::<CollectiveTransport>(), Ok(v));
        }
    }
}
