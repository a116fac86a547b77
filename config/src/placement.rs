//! The placement cost's weights and the conditional-disaggregation threshold: the router's
//! flags, and the one home of their defaults (the router's `PlaceConfig::default` is built from
//! [`PlacementArgs::DEFAULT`], so a flag's default and the code's cannot drift apart). What each
//! weight does and how the defaults were tuned: docs/routing.md.

use clap::Args;

/// Placement settings (`--prefill-weight` … `--disagg-min-uncached-blocks`).
#[derive(Clone, Debug, PartialEq, Args)]
pub struct PlacementArgs {
    /// Weight of a request's uncached prompt blocks in the placement cost (a decode block weighs
    /// 1): prefill is compute-bound.
    #[arg(long, env = "CLEAVE_PREFILL_WEIGHT", value_parser = weight,
          default_value_t = PlacementArgs::DEFAULT.prefill_weight)]
    pub prefill_weight: f64,
    /// Weight of the prefill blocks already queued or running on a worker.
    #[arg(long, env = "CLEAVE_QUEUED_PREFILL_WEIGHT", value_parser = weight,
          default_value_t = PlacementArgs::DEFAULT.queued_prefill_weight)]
    pub queued_prefill_weight: f64,
    /// Weight of the uncached prompt blocks that fit in a worker's free KV space, in place of
    /// `--prefill-weight` (holding them evicts nothing); `--prefill-weight`'s value turns it off.
    #[arg(long, env = "CLEAVE_FREE_PREFILL_WEIGHT", value_parser = weight,
          default_value_t = PlacementArgs::DEFAULT.free_prefill_weight)]
    pub free_prefill_weight: f64,
    /// Weight of the prefill blocks the router placed on a worker lately (decayed per
    /// placement), which spreads work that could go anywhere; 0 turns it off.
    #[arg(long, env = "CLEAVE_RECENT_PREFILL_WEIGHT", value_parser = weight,
          default_value_t = PlacementArgs::DEFAULT.recent_prefill_weight)]
    pub recent_prefill_weight: f64,
    /// Disaggregate only when at least this many prompt blocks (16 tokens) are uncached on the
    /// decode worker; shorter prompts are prefilled where they decode.
    #[arg(long, env = "CLEAVE_DISAGG_MIN_UNCACHED_BLOCKS",
          default_value_t = PlacementArgs::DEFAULT.disagg_min_uncached_blocks)]
    pub disagg_min_uncached_blocks: usize,
}

impl PlacementArgs {
    /// The defaults: weights tuned with `cleave bench route --sweep` for `prefix-optimistic`,
    /// the threshold with `cleave bench compare` (docs/routing.md, docs/benchmarking.md).
    pub const DEFAULT: PlacementArgs = PlacementArgs {
        prefill_weight: 24.0,
        queued_prefill_weight: 3.0,
        free_prefill_weight: 16.0,
        recent_prefill_weight: 2.0,
        disagg_min_uncached_blocks: 9,
    };
}

impl Default for PlacementArgs {
    fn default() -> Self {
        PlacementArgs::DEFAULT
    }
}

/// A weight: a finite number, 0 or more.
fn weight(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(w) if w.is_finite() && w >= 0.0 => Ok(w),
        _ => Err(format!(
            "{s:?} is not a weight (a finite number, 0 or more)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        placement: PlacementArgs,
    }

    fn parse(args: &[&str]) -> Result<PlacementArgs, clap::Error> {
        Flags::try_parse_from([&["x"], args].concat()).map(|f| f.placement)
    }

    #[test]
    fn the_flags_defaults_are_the_codes() {
        assert_eq!(parse(&[]).unwrap(), PlacementArgs::DEFAULT);
    }

    #[test]
    fn weights_are_finite_and_not_negative() {
        let p = parse(&["--prefill-weight", "8", "--recent-prefill-weight", "0"]).unwrap();
        assert_eq!((p.prefill_weight, p.recent_prefill_weight), (8.0, 0.0));
        for bad in ["-1", "inf", "NaN", "lots"] {
            let flag = format!("--queued-prefill-weight={bad}");
            let e = parse(&[&flag]).unwrap_err().to_string();
            assert!(e.contains("not a weight"), "{bad}: {e}");
        }
    }
}
