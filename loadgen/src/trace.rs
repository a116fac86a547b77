//! Mooncake-format traces turned into real requests: sampled (whole sessions or the first N
//! requests), scaled to the model's context by a stated factor, each `hash_id` mapped to a
//! deterministic run of tokens so shared ids give identical prompt prefixes.

use serde::Serialize;

use cleave_types::trace::TraceRequest;

use crate::tokens::{PromptFormat, TokenMap};
use crate::workload::RequestSpec;
use crate::LoadgenError;

/// Tokens per `hash_id` block in the published Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// How a trace is shrunk to fit a small model; every field is printed in the report.
#[derive(Clone, Debug, Serialize)]
pub struct TraceScale {
    /// Prompt lengths (and block lengths) are multiplied by this.
    pub input_scale: f64,
    /// Output lengths are multiplied by this.
    pub output_scale: f64,
    /// Prompts are cut to at most this many tokens after scaling (None: no cap).
    pub max_input: Option<usize>,
    /// Outputs are capped at this many tokens after scaling (None: no cap).
    pub max_output: Option<usize>,
    /// Tokens per trace block in the source trace (512 for Mooncake).
    pub source_block_tokens: usize,
}

impl TraceScale {
    /// Tokens per block after scaling (at least 1).
    pub fn block_tokens(&self) -> usize {
        ((self.source_block_tokens as f64 * self.input_scale).round() as usize).max(1)
    }

    fn check(&self) -> Result<(), LoadgenError> {
        for (name, v) in [
            ("input scale", self.input_scale),
            ("output scale", self.output_scale),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return Err(LoadgenError::Invalid(format!(
                    "{name} must be in (0, 1], got {v}"
                )));
            }
        }
        Ok(())
    }
}

/// Which requests of the trace to use.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TraceSample {
    /// Keep only requests whose first block is among the first `sessions` distinct first
    /// blocks (whole multi-turn sessions, so the sample keeps the trace's prefix reuse).
    pub sessions: Option<usize>,
    /// Then keep at most this many requests, in arrival order.
    pub limit: Option<usize>,
}

/// Applies `sample` to a parsed trace (which is in arrival order).
pub fn sample(trace: &[TraceRequest], sample: &TraceSample) -> Vec<TraceRequest> {
    let mut out: Vec<TraceRequest> = match sample.sessions {
        None => trace.to_vec(),
        Some(k) => {
            let mut roots = Vec::new();
            for r in trace {
                if let Some(&root) = r.hash_ids.first() {
                    if !roots.contains(&root) && roots.len() < k {
                        roots.push(root);
                    }
                }
            }
            trace
                .iter()
                .filter(|r| r.hash_ids.first().is_some_and(|h| roots.contains(h)))
                .cloned()
                .collect()
        }
    };
    if let Some(n) = sample.limit {
        out.truncate(n);
    }
    out
}

/// The requests of a (sampled) trace at `scale`, prompts built by `map`; arrival offsets are
/// the trace's timestamps relative to its first request, multiplied by `time_scale`.
///
/// # Errors
/// [`LoadgenError::Invalid`] for a scale outside (0, 1] or an empty trace.
pub fn to_requests(
    trace: &[TraceRequest],
    scale: &TraceScale,
    map: &TokenMap,
    format: PromptFormat,
    time_scale: f64,
) -> Result<Vec<RequestSpec>, LoadgenError> {
    scale.check()?;
    let first = trace
        .first()
        .ok_or_else(|| LoadgenError::Invalid("the trace sample has no requests".into()))?
        .timestamp;
    let bt = scale.block_tokens();
    Ok(trace
        .iter()
        .map(|r| {
            let mut input = ((r.input_length as f64 * scale.input_scale).round() as usize).max(1);
            if let Some(cap) = scale.max_input {
                input = input.min(cap);
            }
            let mut blocks = Vec::new();
            let mut left = input;
            for &h in &r.hash_ids {
                if left == 0 {
                    break;
                }
                let n = left.min(bt);
                blocks.push((h, n));
                left -= n;
            }
            // A prompt longer than its ids cover (or with no ids): unique filler.
            if left > 0 {
                blocks.push((u64::MAX - r.timestamp, left));
            }
            let mut output =
                ((r.output_length as f64 * scale.output_scale).round() as usize).max(1);
            if let Some(cap) = scale.max_output {
                output = output.min(cap);
            }
            RequestSpec {
                prompt: map.prompt(&blocks, format),
                prompt_tokens: input,
                max_tokens: output,
                at: Some(std::time::Duration::from_secs_f64(
                    (r.timestamp - first) as f64 / 1000.0 * time_scale,
                )),
            }
        })
        .collect())
}

/// The fraction of prompt blocks that repeat a block an earlier request already had as the
/// same prefix (an infinite shared cache's hit rate): the workload's prefix overlap.
pub fn prefix_overlap(trace: &[TraceRequest]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut hit, mut total) = (0usize, 0usize);
    for r in trace {
        let mut prefix = true;
        for h in &r.hash_ids {
            total += 1;
            if prefix && seen.contains(h) {
                hit += 1;
            } else {
                prefix = false;
            }
            seen.insert(*h);
        }
    }
    if total == 0 {
        0.0
    } else {
        hit as f64 / total as f64
    }
}
