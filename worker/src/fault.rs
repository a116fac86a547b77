//! Named fault points, so that a failure test exercises exactly the path it names instead of
//! racing a `sleep` against the thing it kills.
//!
//! `CLEAVE_FAULT=NAME=N[,NAME=N…]` in a worker's environment makes the process exit at once
//! (status [`EXIT_CODE`], as a crash would: no graceful shutdown, sockets reset) when the point
//! `NAME` is reached with a count of at least `N`. Points:
//! - `decode.tokens_streamed`: a decode worker has handed the N-th token of one stream to gRPC;
//! - `prefill.kv_blocks_sent`: a prefill worker has handed N KV blocks of one request to the
//!   transport (writes in flight, the first token not yet answered);
//! - `decode.generate_calls`: a decode worker receives its N-th `Generate` call (the router's
//!   call fails before any event: it places the request again);
//! - `group.all_reduces`: a follower rank enters its N-th all-reduce of model computation (the
//!   other ranks are inside that collective, waiting for its part: the group fails mid-step).
//!
//! Unset (the default), a point costs one branch on a value read once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cleave_types::collective::{Collective, CollectiveError};

/// The exit status of a process stopped by a fault point.
pub const EXIT_CODE: i32 = 86;

fn points() -> &'static HashMap<String, u64> {
    static POINTS: OnceLock<HashMap<String, u64>> = OnceLock::new();
    // Tests arm fault points per process through the environment, not a flag users could set.
    #[allow(clippy::disallowed_methods)]
    POINTS.get_or_init(|| {
        std::env::var("CLEAVE_FAULT")
            .map(|v| parse(&v))
            .unwrap_or_default()
    })
}

/// `NAME=N` pairs, comma-separated; a malformed entry is logged and ignored.
fn parse(spec: &str) -> HashMap<String, u64> {
    let mut out = HashMap::new();
    for entry in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry
            .split_once('=')
            .map(|(k, v)| (k.trim(), v.trim().parse::<u64>()))
        {
            Some((name, Ok(n))) => {
                out.insert(name.to_string(), n);
            }
            _ => tracing::error!(entry, "CLEAVE_FAULT entry is not NAME=N: ignored"),
        }
    }
    out
}

/// Whether `name` is armed in this process.
pub fn armed(name: &str) -> bool {
    points().contains_key(name)
}

/// Exits the process when `name` is armed for `count` or less.
pub fn point(name: &str, count: u64) {
    if points().get(name).is_some_and(|&n| count >= n) {
        tracing::error!(point = name, count, "fault point reached: exiting");
        eprintln!("cleave: fault point {name}={count} reached: exiting with status {EXIT_CODE}");
        std::process::exit(EXIT_CODE);
    }
}

/// `group`, passing the `group.all_reduces` point on each all-reduce when it is armed (else
/// `group` itself: an unarmed point costs nothing in the forward pass).
pub fn compute_collective(group: Arc<dyn Collective>) -> Arc<dyn Collective> {
    if armed(ALL_REDUCES) {
        Arc::new(Faulty {
            inner: group,
            all_reduces: AtomicU64::new(0),
        })
    } else {
        group
    }
}

const ALL_REDUCES: &str = "group.all_reduces";

/// A collective that counts its all-reduces into [`ALL_REDUCES`].
struct Faulty {
    inner: Arc<dyn Collective>,
    all_reduces: AtomicU64,
}

impl Collective for Faulty {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        point(
            ALL_REDUCES,
            self.all_reduces.fetch_add(1, Ordering::Relaxed) + 1,
        );
        self.inner.all_reduce_sum(buf)
    }
    fn all_gather(&self, local: &[f32], out: &mut Vec<f32>) -> Result<(), CollectiveError> {
        self.inner.all_gather(local, out)
    }
    fn all_to_all_v(
        &self,
        send: &[Vec<f32>],
        recv: &mut Vec<Vec<f32>>,
    ) -> Result<(), CollectiveError> {
        self.inner.all_to_all_v(send, recv)
    }
    fn broadcast(&self, root: usize, buf: &mut Vec<u8>) -> Result<(), CollectiveError> {
        self.inner.broadcast(root, buf)
    }
    fn barrier(&self) -> Result<(), CollectiveError> {
        self.inner.barrier()
    }
}

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn parses_pairs_and_skips_malformed_entries() {
        let p = parse("decode.tokens_streamed=5, bad, x=y,prefill.blocks=2");
        assert_eq!(p.len(), 2);
        assert_eq!(p["decode.tokens_streamed"], 5);
        assert_eq!(p["prefill.blocks"], 2);
    }
}
