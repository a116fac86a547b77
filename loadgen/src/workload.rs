//! What is sent: a list of requests (prompt, length, optional arrival offset), from a trace
//! ([`crate::trace`]) or synthetic: prompt/output lengths drawn uniformly around a mean, and a
//! stated fraction of each prompt taken from one of a few shared prefixes.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::tokens::{Prompt, PromptFormat, TokenMap};
use crate::LoadgenError;

/// One request to send.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    /// The prompt.
    pub prompt: Prompt,
    /// Its length in tokens (as built; text prompts are re-tokenized by the server).
    pub prompt_tokens: usize,
    /// `max_tokens` (with `ignore_eos`, the exact output length).
    pub max_tokens: usize,
    /// Arrival offset from the start of the run when replaying timestamps.
    pub at: Option<Duration>,
}

/// Lengths uniform in `[mean·(1−spread), mean·(1+spread)]`, at least 1.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LengthDist {
    /// Mean length in tokens.
    pub mean: usize,
    /// Relative half-width, 0 (fixed) .. 1.
    pub spread: f64,
}

impl LengthDist {
    fn draw(&self, rng: &mut StdRng) -> usize {
        if self.spread <= 0.0 {
            return self.mean.max(1);
        }
        let lo = self.mean as f64 * (1.0 - self.spread);
        let hi = self.mean as f64 * (1.0 + self.spread);
        (rng.gen_range(lo..=hi).round() as usize).max(1)
    }

    fn check(&self, name: &str) -> Result<(), LoadgenError> {
        if self.mean == 0 || !(0.0..=1.0).contains(&self.spread) {
            return Err(LoadgenError::Invalid(format!(
                "{name}: mean must be > 0 and spread in [0, 1], got {} and {}",
                self.mean, self.spread
            )));
        }
        Ok(())
    }
}

/// A synthetic workload.
#[derive(Clone, Debug, Serialize)]
pub struct Synthetic {
    /// Prompt lengths.
    pub input: LengthDist,
    /// Output lengths.
    pub output: LengthDist,
    /// Fraction of each prompt (from its start) taken from a shared prefix, 0..=1.
    pub prefix_fraction: f64,
    /// How many distinct shared prefixes the requests draw from.
    pub prefix_groups: usize,
    /// Requests to generate.
    pub requests: usize,
    /// RNG seed (lengths and group choice).
    pub seed: u64,
}

/// Block ids of shared prefixes live at the top of the id space, away from trace ids.
const PREFIX_BASE: u64 = 1 << 62;
/// Block ids of unique suffixes.
const UNIQUE_BASE: u64 = 1 << 61;

impl Synthetic {
    /// Generates the requests (no arrival offsets: the arrival process decides).
    ///
    /// # Errors
    /// [`LoadgenError::Invalid`] for an out-of-range parameter.
    pub fn generate(
        &self,
        map: &TokenMap,
        format: PromptFormat,
    ) -> Result<Vec<RequestSpec>, LoadgenError> {
        self.input.check("prompt length")?;
        self.output.check("output length")?;
        if !(0.0..=1.0).contains(&self.prefix_fraction) || self.prefix_groups == 0 {
            return Err(LoadgenError::Invalid(format!(
                "prefix fraction must be in [0, 1] and prefix groups ≥ 1, got {} and {}",
                self.prefix_fraction, self.prefix_groups
            )));
        }
        let mut rng = StdRng::seed_from_u64(self.seed);
        Ok((0..self.requests)
            .map(|i| {
                let input = self.input.draw(&mut rng);
                let output = self.output.draw(&mut rng);
                let shared = (input as f64 * self.prefix_fraction).round() as usize;
                let group = rng.gen_range(0..self.prefix_groups) as u64;
                let mut blocks = Vec::new();
                if shared > 0 {
                    blocks.push((PREFIX_BASE + group, shared));
                }
                if input > shared {
                    blocks.push((
                        UNIQUE_BASE + self.seed.wrapping_mul(1 << 20) + i as u64,
                        input - shared,
                    ));
                }
                RequestSpec {
                    prompt: map.prompt(&blocks, format),
                    prompt_tokens: input,
                    max_tokens: output,
                    at: None,
                }
            })
            .collect())
    }
}

/// `n` warm-up requests: unique prompts (sharing nothing with the workload) of `prompt_tokens`
/// tokens and `max_tokens` outputs.
pub fn warmup(
    n: usize,
    prompt_tokens: usize,
    max_tokens: usize,
    map: &TokenMap,
    format: PromptFormat,
) -> Vec<RequestSpec> {
    (0..n)
        .map(|i| RequestSpec {
            prompt: map.prompt(&[((1 << 60) + i as u64, prompt_tokens.max(1))], format),
            prompt_tokens: prompt_tokens.max(1),
            max_tokens: max_tokens.max(1),
            at: None,
        })
        .collect()
}
