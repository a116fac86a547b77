//! Turning logits into the next token: greedy, temperature, top-k, top-p, seeded RNG, and
//! per-token log-probabilities with the top alternatives.

use llguidance::toktrie::SimpleVob;
use serde::{Deserialize, Serialize};

use crate::constrain::Constraint;

/// How to pick tokens and when to stop, per request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1.0 = all).
    pub top_p: f32,
    /// Seed of this request's RNG; the same seed and prompt give the same tokens.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Generation stops when the text contains any of these (the stop string is not returned).
    pub stop: Vec<String>,
    /// Generation stops at any of these token ids (in addition to the model's end tokens).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's end-of-generation tokens.
    pub ignore_eos: bool,
    /// Return each sampled token's log-probability and this many top alternatives.
    pub logprobs: Option<usize>,
    /// What the output must match (JSON schema, regex, grammar, choice), if anything.
    pub constraint: Option<Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
        }
    }
}

impl SamplingParams {
    /// Whether a token costs one random draw (greedy and top-k 1 take none).
    pub fn draws(&self) -> bool {
        self.temperature > 0.0 && self.top_k != 1
    }

    /// Checks value ranges; the error names the field.
    pub fn validate(&self) -> Result<(), ParamError> {
        if !(0.0..=2.0).contains(&self.temperature) || self.temperature.is_nan() {
            return Err(ParamError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ParamError::TopP(self.top_p));
        }
        if self.max_tokens == 0 {
            return Err(ParamError::MaxTokens);
        }
        if let Some(n) = self.logprobs {
            if n > 20 {
                return Err(ParamError::TopLogprobs(n));
            }
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return Err(ParamError::EmptyStop);
        }
        Ok(())
    }
}

/// A sampling parameter out of its range; the message names the field as the OpenAI API
/// spells it.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ParamError {
    /// `temperature` outside [0, 2] (or NaN).
    #[error("`temperature` must be in [0, 2], got {0}")]
    Temperature(f32),
    /// `top_p` outside (0, 1].
    #[error("`top_p` must be in (0, 1], got {0}")]
    TopP(f32),
    /// `max_tokens` of 0.
    #[error("`max_tokens` must be at least 1")]
    MaxTokens,
    /// `top_logprobs` above 20.
    #[error("`top_logprobs` must be at most 20, got {0}")]
    TopLogprobs(usize),
    /// An empty stop string.
    #[error("`stop` strings must not be empty")]
    EmptyStop,
}

impl ParamError {
    /// The request field at fault, as the OpenAI API names it (an error's `param`).
    pub fn field(&self) -> &'static str {
        match self {
            ParamError::Temperature(_) => "temperature",
            ParamError::TopP(_) => "top_p",
            ParamError::MaxTokens => "max_tokens",
            ParamError::TopLogprobs(_) => "top_logprobs",
            ParamError::EmptyStop => "stop",
        }
    }
}

/// The chosen token's log-probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    /// The sampled token.
    pub token: u32,
    /// Its log-probability under the model (before temperature and truncation).
    pub logprob: f32,
    /// The `n` most likely tokens and their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// SplitMix64: small, fast and fully reproducible from a seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Jumps ahead as if `n` values had been drawn (SplitMix64's state is a counter).
    pub fn skip(&mut self, n: u64) {
        self.0 = self.0.wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-sequence sampler state.
#[derive(Clone, Debug)]
pub struct Sampler {
    rng: Rng,
    scratch: Vec<(u32, f32)>,
}

/// Index of the largest logit (lowest id on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Index of the largest logit among the tokens `ok` allows (lowest id on ties; 0 if none).
fn argmax_where(logits: &[f32], ok: impl Fn(u32) -> bool) -> u32 {
    let mut best: Option<usize> = None;
    for (i, &v) in logits.iter().enumerate() {
        if ok(i as u32) && best.is_none_or(|b| v > logits[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// log-softmax normaliser: `log Σ exp(l)`.
fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    max + s.ln() as f32
}

impl Sampler {
    /// A sampler seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Sampler {
            rng: Rng::new(seed),
            scratch: Vec::new(),
        }
    }

    /// Skips the random draws of `tokens` sampled tokens (one draw each when temperature > 0):
    /// a migrated request continues from the same RNG position.
    pub fn skip(&mut self, tokens: u64) {
        self.rng.skip(tokens);
    }

    /// Picks the next token from `logits` and, if asked, its log-probabilities.
    pub fn sample(&mut self, logits: &[f32], p: &SamplingParams) -> (u32, Option<TokenLogprob>) {
        self.sample_masked(logits, p, None)
    }

    /// [`Self::sample`] among the tokens `allowed` permits (a grammar's mask; ids past its end
    /// are not allowed). Log-probabilities stay the model's own, before the mask, as vLLM
    /// reports them. The mask must allow at least one token.
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        p: &SamplingParams,
        allowed: Option<&SimpleVob>,
    ) -> (u32, Option<TokenLogprob>) {
        let token = match allowed {
            None if !p.draws() => argmax(logits),
            None => self.sample_random(logits, p, |_| true),
            Some(m) => {
                let ok = |i: u32| (i as usize) < m.len() && m.is_allowed(i);
                if !p.draws() {
                    argmax_where(logits, ok)
                } else {
                    self.sample_random(logits, p, ok)
                }
            }
        };
        let lp = p.logprobs.map(|n| {
            let lse = log_sum_exp(logits);
            let mut top: Vec<(u32, f32)> = Vec::with_capacity(n);
            if n > 0 {
                let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
                let k = n.min(idx.len());
                idx.select_nth_unstable_by(k - 1, |a, b| {
                    logits[*b as usize]
                        .total_cmp(&logits[*a as usize])
                        .then(a.cmp(b))
                });
                idx.truncate(k);
                idx.sort_by(|a, b| {
                    logits[*b as usize]
                        .total_cmp(&logits[*a as usize])
                        .then(a.cmp(b))
                });
                top = idx
                    .into_iter()
                    .map(|i| (i, logits[i as usize] - lse))
                    .collect();
            }
            TokenLogprob {
                token,
                logprob: logits[token as usize] - lse,
                top,
            }
        });
        (token, lp)
    }

    fn sample_random(
        &mut self,
        logits: &[f32],
        p: &SamplingParams,
        allowed: impl Fn(u32) -> bool,
    ) -> u32 {
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(i, _)| allowed(*i as u32))
                .map(|(i, &l)| (i as u32, l / p.temperature)),
        );
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_by(by_logit);
        let Some(&(_, max)) = c.first() else {
            return 0;
        };
        let mut total = 0.0f64;
        for e in c.iter_mut() {
            e.1 = ((e.1 - max) as f64).exp() as f32;
            total += e.1 as f64;
        }
        if p.top_p < 1.0 {
            let mut cum = 0.0f64;
            let mut keep = c.len();
            for (i, e) in c.iter().enumerate() {
                cum += e.1 as f64 / total;
                if cum >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            c.truncate(keep);
            total = c.iter().map(|e| e.1 as f64).sum();
        }
        let mut r = self.rng.next_f64() * total;
        for e in c.iter() {
            r -= e.1 as f64;
            if r < 0.0 {
                return e.0;
            }
        }
        c.last().map(|e| e.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_lowest_on_ties() {
        let mut s = Sampler::new(1);
        let (t, _) = s.sample(&[0.1, 3.0, 3.0, -1.0], &SamplingParams::default());
        assert_eq!(t, 1);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 7) as f32 * 0.5).collect();
        let p = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            ..Default::default()
        };
        let draw = |seed| {
            let mut s = Sampler::new(seed);
            (0..50).map(|_| s.sample(&logits, &p).0).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // top-3 of logits with value 3.0 (i % 7 == 6): ids 6, 13, 20.
        assert!(
            draw(7).iter().all(|t| [6, 13, 20].contains(t)),
            "{:?}",
            draw(7)
        );
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        let logits = [10.0, 0.0, 0.0, 0.0];
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            ..Default::default()
        };
        let mut s = Sampler::new(3);
        assert!((0..100).all(|_| s.sample(&logits, &p).0 == 0));
    }

    #[test]
    fn temperature_sampling_follows_the_distribution() {
        // p = softmax([ln 1, ln 3]) = [0.25, 0.75]
        let logits = [0.0, 3f32.ln()];
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut s = Sampler::new(42);
        let ones = (0..4000).filter(|_| s.sample(&logits, &p).0 == 1).count();
        assert!((2800..3200).contains(&ones), "{ones} of 4000");
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let logits = [1.0, 2.0, 3.0, 0.5];
        let p = SamplingParams {
            logprobs: Some(2),
            ..Default::default()
        };
        let (t, lp) = Sampler::new(0).sample(&logits, &p);
        let lp = lp.unwrap();
        assert_eq!(t, 2);
        let z: f32 = logits.iter().map(|l: &f32| l.exp()).sum();
        assert!((lp.logprob - (3.0 - z.ln())).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![2, 1]);
    }

    #[test]
    fn validation_names_the_field() {
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert_eq!(bad.validate(), Err(ParamError::TopP(bad.top_p)));
        let bad = SamplingParams {
            temperature: 3.0,
            ..Default::default()
        };
        assert_eq!(bad.validate(), Err(ParamError::Temperature(3.0)));
        assert!(ParamError::TopP(0.0).to_string().starts_with("`top_p` "));
        assert_eq!(ParamError::TopP(0.0).field(), "top_p");
    }

    #[test]
    fn a_mask_limits_greedy_and_random_picks_but_not_logprobs() {
        let logits = [5.0, 1.0, 3.0, 2.0];
        let mut m = SimpleVob::alloc(4);
        m.allow_token(2);
        m.allow_token(3);
        let p = SamplingParams {
            logprobs: Some(1),
            ..Default::default()
        };
        let (t, lp) = Sampler::new(0).sample_masked(&logits, &p, Some(&m));
        assert_eq!(t, 2);
        // The model's own distribution: token 0 is still the most likely.
        assert_eq!(lp.unwrap().top[0].0, 0);
        let hot = SamplingParams {
            temperature: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(9);
        for _ in 0..200 {
            let (t, _) = s.sample_masked(&logits, &hot, Some(&m));
            assert!(t == 2 || t == 3, "{t}");
        }
    }
}
