//! When requests are sent: open loop (Poisson arrivals at a rate, or the trace's own
//! timestamps) or closed loop (a fixed number of requests always in flight).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// One load point of a run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum Load {
    /// Poisson arrivals at `rate` requests per second (open loop).
    Rate {
        /// Requests per second.
        rate: f64,
    },
    /// The workload's own arrival offsets (trace timestamps × time scale; open loop).
    Replay {
        /// Multiplier applied to the trace's timestamps.
        time_scale: f64,
    },
    /// `concurrency` requests in flight at all times (closed loop).
    Concurrency {
        /// Requests in flight.
        concurrency: usize,
    },
}

impl Load {
    /// The x value of this point in load sweeps and its label.
    pub fn label(&self) -> String {
        match self {
            Load::Rate { rate } => format!("{rate} req/s"),
            Load::Replay { time_scale } => format!("replay ×{time_scale}"),
            Load::Concurrency { concurrency } => format!("concurrency {concurrency}"),
        }
    }

    /// A number for the x axis of sweep charts.
    pub fn x(&self) -> f64 {
        match self {
            Load::Rate { rate } => *rate,
            Load::Replay { time_scale } => 1.0 / time_scale,
            Load::Concurrency { concurrency } => *concurrency as f64,
        }
    }
}

/// `n` Poisson arrival offsets at `rate` per second: exponential gaps with mean `1/rate`,
/// reproducible from `seed`. The first request arrives at 0.
pub fn poisson(rate: f64, n: usize, seed: u64) -> Vec<Duration> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut t = 0.0f64;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if i > 0 {
            // Inverse CDF of Exp(rate); 1 - U is in (0, 1], so the log is finite.
            let u: f64 = rng.gen();
            t += -(1.0 - u).ln() / rate;
        }
        out.push(Duration::from_secs_f64(t));
    }
    out
}
