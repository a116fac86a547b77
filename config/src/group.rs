//! Worker-group membership (tensor-/expert-parallel ranks in several processes): the flags, and
//! the membership they resolve to with the environment LeaderWorkerSet provides (`LWS_*`).
//! Joining the group is `cleave_worker::group::connect`.

// Settings are read here: LeaderWorkerSet's LWS_* variables complete the flags.
#![allow(clippy::disallowed_methods)]

use std::net::SocketAddr;
use std::time::Duration;

use crate::ConfigError;
use clap::Args;
use cleave_types::choices::CollectiveTransport;
use cleave_types::duration::parse_duration;

/// Group membership and behaviour (flags, `CLEAVE_GROUP_*`, or LeaderWorkerSet's `LWS_*`).
#[derive(Clone, Debug, Args)]
pub struct GroupArgs {
    /// Ranks in this worker's group (the tensor-parallel size); default `LWS_GROUP_SIZE`, else 1.
    #[arg(long = "tp", env = "CLEAVE_GROUP_SIZE")]
    pub size: Option<usize>,
    /// Expert-parallel size: an MoE model's experts are split over this many ranks, tokens
    /// reach them by all-to-all, and attention runs tensor-parallel over the same ranks — so
    /// it is the group size (`--tp`, when also given, must be equal). Refused for a dense model.
    #[arg(long = "ep", env = "CLEAVE_EP_SIZE")]
    pub ep: Option<usize>,
    /// This process's rank, 0 being the leader; default `LWS_WORKER_INDEX`, else 0.
    #[arg(long = "group-rank", env = "CLEAVE_GROUP_RANK")]
    pub rank: Option<usize>,
    /// This pod's name, whose ordinal suffix (`…-2`) is the rank when `--group-rank` is not
    /// given: StatefulSet pods know their name on every Kubernetes version, their
    /// `apps.kubernetes.io/pod-index` label only from 1.28.
    #[arg(long = "group-pod-name", env = "CLEAVE_GROUP_POD_NAME")]
    pub pod_name: Option<String>,
    /// `host:port` of the leader's group listener; default `LWS_LEADER_ADDRESS` with
    /// `--group-port`, else `127.0.0.1` with `--group-port`.
    #[arg(long = "group-leader", env = "CLEAVE_GROUP_LEADER")]
    pub leader: Option<String>,
    /// Port of the leader's group listener when `--group-leader` names none.
    #[arg(
        long = "group-port",
        env = "CLEAVE_GROUP_PORT",
        default_value_t = 29400
    )]
    pub port: u16,
    /// Where this rank listens for its peers (default: the leader on every interface at the
    /// group port, the others on an ephemeral port).
    #[arg(long = "group-bind", env = "CLEAVE_GROUP_BIND")]
    pub bind: Option<SocketAddr>,
    /// Host the other ranks use to reach this one (default: found from the route to the leader).
    #[arg(long = "group-advertise", env = "CLEAVE_GROUP_ADVERTISE")]
    pub advertise: Option<String>,
    /// Transport of the collectives between ranks: tcp (default) or ucx (tag messages; shared
    /// memory on one host, RDMA where present).
    #[arg(
        long = "group-transport",
        env = "CLEAVE_GROUP_TRANSPORT",
        value_enum,
        default_value = "tcp"
    )]
    pub collective_transport: CollectiveTransport,
    /// Deadline of each collective call (a rank silent for longer fails the group).
    #[arg(long = "group-timeout", env = "CLEAVE_GROUP_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub timeout: Duration,
    /// How long forming the group may take.
    #[arg(long = "group-connect-timeout", env = "CLEAVE_GROUP_CONNECT_TIMEOUT", value_parser = parse_duration, default_value = "120s")]
    pub connect_timeout: Duration,
    /// How often an idle leader checks that every rank is alive.
    #[arg(long = "group-heartbeat", env = "CLEAVE_GROUP_HEARTBEAT", value_parser = parse_duration, default_value = "1s")]
    pub heartbeat: Duration,
    /// After the group fails, the leader stays up (not ready, deregistered) this long, then
    /// exits with status 1 so its supervisor restarts the group.
    #[arg(long = "group-failed-exit-after", env = "CLEAVE_GROUP_FAILED_EXIT_AFTER", value_parser = parse_duration, default_value = "2s")]
    pub failed_exit_after: Duration,
}

impl Default for GroupArgs {
    fn default() -> Self {
        GroupArgs {
            size: None,
            ep: None,
            rank: None,
            pod_name: None,
            leader: None,
            port: 29400,
            bind: None,
            advertise: None,
            collective_transport: CollectiveTransport::Tcp,
            timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(120),
            heartbeat: Duration::from_secs(1),
            failed_exit_after: Duration::from_secs(2),
        }
    }
}

/// Resolved membership of a group of more than one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Membership {
    /// Ranks in the group.
    pub size: usize,
    /// This rank.
    pub rank: usize,
    /// The leader's group listener.
    pub leader: String,
}

fn env_usize(name: &'static str) -> Result<Option<usize>, ConfigError> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| ConfigError::BadEnv { name, value: v }),
        _ => Ok(None),
    }
}

/// The group size `--tp` and `--ep` give (`None`: neither). Attention runs tensor-parallel over
/// the expert-parallel ranks, so both name the same number when both are given.
pub fn size_from_flags(tp: Option<usize>, ep: Option<usize>) -> Result<Option<usize>, ConfigError> {
    match (tp, ep) {
        (Some(tp), Some(ep)) if tp != ep => Err(ConfigError::GroupSizes { tp, ep }),
        (Some(n), _) | (None, Some(n)) => Ok(Some(n)),
        (None, None) => Ok(None),
    }
}

impl GroupArgs {
    /// The membership from flags, then `CLEAVE_GROUP_*`, then `LWS_*`; `None` for a group of
    /// one.
    pub fn membership(&self) -> Result<Option<Membership>, ConfigError> {
        let size = match size_from_flags(self.size, self.ep)? {
            Some(s) => s,
            None => env_usize("LWS_GROUP_SIZE")?.unwrap_or(1),
        };
        if size == 0 {
            return Err(ConfigError::BadValue {
                flag: "--tp/--ep",
                problem: "must be at least 1 (the group size)".into(),
            });
        }
        let rank = match (self.rank, self.pod_name.as_deref()) {
            (Some(r), _) => r,
            (None, Some(name)) => name
                .rsplit_once('-')
                .and_then(|(_, n)| n.parse().ok())
                .ok_or_else(|| ConfigError::BadValue {
                    flag: "--group-pod-name",
                    problem: format!(
                        "{name:?} does not end in -ORDINAL (a StatefulSet pod's name)"
                    )
                    .into(),
                })?,
            (None, None) => env_usize("LWS_WORKER_INDEX")?.unwrap_or(0),
        };
        if rank >= size {
            return Err(ConfigError::RankOutOfRange { rank, size });
        }
        if size == 1 {
            return Ok(None);
        }
        let leader = match self.leader.as_deref().map(str::trim) {
            Some(l) if !l.is_empty() => l.to_string(),
            _ => match std::env::var("LWS_LEADER_ADDRESS") {
                Ok(h) if !h.trim().is_empty() => format!("{}:{}", h.trim(), self.port),
                _ => format!("127.0.0.1:{}", self.port),
            },
        };
        Ok(Some(Membership { size, rank, leader }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_from_flags() {
        let mut a = GroupArgs::default();
        // With no LWS_* variables in the test environment a default is a group of one.
        if std::env::var("LWS_GROUP_SIZE").is_err() && std::env::var("LWS_WORKER_INDEX").is_err() {
            assert_eq!(a.membership().unwrap(), None);
        }
        a.size = Some(3);
        a.rank = Some(2);
        a.leader = Some("10.0.0.1:7000".into());
        assert_eq!(
            a.membership().unwrap(),
            Some(Membership {
                size: 3,
                rank: 2,
                leader: "10.0.0.1:7000".into()
            })
        );
        a.rank = Some(3);
        assert!(a.membership().unwrap_err().to_string().contains("rank 3"));
        a.size = Some(0);
        assert!(a.membership().is_err());
        // --ep alone sets the size; with --tp the two must agree.
        a.size = None;
        a.ep = Some(4);
        a.rank = Some(3);
        assert_eq!(a.membership().unwrap().unwrap().size, 4);
        a.size = Some(2);
        let e = a.membership().unwrap_err().to_string();
        assert!(e.contains("--tp 2 and --ep 4"), "{e}");
        a.size = Some(4);
        assert_eq!(a.membership().unwrap().unwrap().size, 4);
    }

    #[test]
    fn the_rank_from_a_statefulset_pod_name() {
        let mut a = GroupArgs {
            size: Some(3),
            leader: Some("m-decode-g0-0.m-decode:29400".into()),
            pod_name: Some("m-decode-g0-2".into()),
            ..GroupArgs::default()
        };
        assert_eq!(a.membership().unwrap().unwrap().rank, 2);
        a.rank = Some(1);
        assert_eq!(
            a.membership().unwrap().unwrap().rank,
            1,
            "--group-rank wins"
        );
        a.rank = None;
        a.pod_name = Some("no-ordinal".into());
        let e = a.membership().unwrap_err().to_string();
        assert!(e.contains("does not end in -ORDINAL"), "{e}");
    }
}
