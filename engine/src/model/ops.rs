//! Element-wise pieces of the transformer: RMSNorm, rotary embeddings, SwiGLU/GeGLU,
//! soft-capping.
//!
//! Each function works on one token's row at a time, so a token's result never depends on which
//! other tokens share the batch.

use super::config::{RopeScaling, RopeStyle};
use crate::kernels::{Activations, QMatrix};

/// `out = x / rms(x) * weight`, row by row (`x.len()` a multiple of `weight.len()`).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// In-place RMSNorm of each `weight.len()`-wide piece of `x` (per-head Q/K norm).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for xr in x.chunks_exact_mut(n) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for (v, w) in xr.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// Rotary embedding tables: cos/sin per token and rotated pair.
pub struct Rope {
    inv_freq: Vec<f32>,
    style: RopeStyle,
    head_dim: usize,
    /// Positions are multiplied by this (linear scaling).
    freq_scale: f32,
    /// cos/sin are multiplied by this (LongRoPE's attention factor).
    mscale: f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// Frequencies `theta^(-2i/rope_dim)` for `rope_dim/2` pairs.
    pub fn new(theta: f32, rope_dim: usize, head_dim: usize, style: RopeStyle) -> Self {
        Self::scaled(theta, rope_dim, head_dim, style, &RopeScaling::default())
    }

    /// Frequencies `theta^(-2i/rope_dim) / factor[i]`, angles `pos * freq_scale * freq`, tables
    /// times `attn_factor` (llama.cpp's `ggml_rope_ext` without YaRN).
    pub fn scaled(
        theta: f32,
        rope_dim: usize,
        head_dim: usize,
        style: RopeStyle,
        scaling: &RopeScaling,
    ) -> Self {
        let inv_freq = (0..rope_dim / 2)
            .map(|i| {
                let f = theta.powf(-2.0 * i as f32 / rope_dim as f32);
                scaling.factors.as_ref().map_or(f, |ff| f / ff[i])
            })
            .collect();
        Rope {
            inv_freq,
            style,
            head_dim,
            freq_scale: scaling.freq_scale,
            mscale: scaling.attn_factor,
            cos: Vec::new(),
            sin: Vec::new(),
        }
    }

    /// Fills the tables for these token positions.
    pub fn prepare(&mut self, positions: &[usize]) {
        let half = self.inv_freq.len();
        self.cos.resize(positions.len() * half, 0.0);
        self.sin.resize(positions.len() * half, 0.0);
        for (t, &p) in positions.iter().enumerate() {
            let p = p as f32 * self.freq_scale;
            for (i, f) in self.inv_freq.iter().enumerate() {
                let (s, c) = (p * f).sin_cos();
                self.cos[t * half + i] = c * self.mscale;
                self.sin[t * half + i] = s * self.mscale;
            }
        }
    }

    /// Rotates every head of token `t`'s row `x` (`x.len()` a multiple of head_dim).
    pub fn apply(&self, t: usize, x: &mut [f32]) {
        let half = self.inv_freq.len();
        let (cos, sin) = (
            &self.cos[t * half..(t + 1) * half],
            &self.sin[t * half..(t + 1) * half],
        );
        for head in x.chunks_exact_mut(self.head_dim) {
            for i in 0..half {
                let (a, b) = match self.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

/// `gate = silu(gate) * up`, in place.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `gate = gelu_tanh(gate) * up`, in place (GeGLU with GELU's tanh approximation).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh()) * u;
    }
}

/// `x = cap * tanh(x / cap)`, element by element.
pub fn softcap(x: &mut [f32], cap: f32) {
    for v in x {
        *v = cap * (*v / cap).tanh();
    }
}

/// Adds `b` to each `b.len()`-wide row of `x`.
pub fn add_bias(x: &mut [f32], b: &[f32]) {
    for row in x.chunks_exact_mut(b.len()) {
        for (v, w) in row.iter_mut().zip(b) {
            *v += w;
        }
    }
}

/// `x += y`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// `out = m · x` for `n` rows of `x` (quantizing the activations once for the product).
pub(super) fn matmul(
    m: &QMatrix,
    acts: &mut Activations,
    x: &[f32],
    n: usize,
    out: &mut Vec<f32>,
    th: &crate::kernels::Threads,
) {
    acts.set(x, n, m.cols());
    out.resize(n * m.rows(), 0.0);
    m.matmul(acts, out, th);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0, 1.0, 1.0];
        let mut out = [0.0; 6];
        rms_norm(&x, &[1.0, 1.0], 1e-6, &mut out);
        // rms of (3,4) is sqrt(12.5)
        assert!((out[0] - 3.0 / 12.5f32.sqrt()).abs() < 1e-6);
        assert_eq!(out[2], 0.0);
        assert!((out[1] - 4.0 / 12.5f32.sqrt()).abs() < 1e-6);
        assert!((out[4] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_position_zero_is_identity_and_preserves_norm() {
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            let mut rope = Rope::new(10_000.0, 4, 4, style);
            rope.prepare(&[0, 7]);
            let mut a = [1.0, 2.0, 3.0, 4.0];
            rope.apply(0, &mut a);
            assert_eq!(a, [1.0, 2.0, 3.0, 4.0]);
            rope.apply(1, &mut a);
            let n: f32 = a.iter().map(|v| v * v).sum();
            assert!((n - 30.0).abs() < 1e-4, "{style:?} changed the norm: {n}");
            assert_ne!(a, [1.0, 2.0, 3.0, 4.0]);
        }
    }

    #[test]
    fn scaled_rope_divides_frequencies_and_scales_positions() {
        let scaling = RopeScaling {
            freq_scale: 0.25,
            factors: Some(vec![1.0, 8.0]),
            attn_factor: 1.0,
        };
        let mut a = Rope::scaled(10_000.0, 4, 4, RopeStyle::Neox, &scaling);
        let mut b = Rope::new(10_000.0, 4, 4, RopeStyle::Neox);
        a.prepare(&[8]);
        b.prepare(&[2]);
        // Pair 0: position 8 at a quarter the speed is position 2.
        assert!((a.cos[0] - b.cos[0]).abs() < 1e-6);
        // Pair 1: a factor of 8 on top makes it position 2 / 8 = 0.25 of the plain rope.
        let want = (0.25f32 * 10_000f32.powf(-0.5)).cos();
        assert!((a.cos[1] - want).abs() < 1e-6, "{} vs {want}", a.cos[1]);
    }

    #[test]
    fn geglu_and_softcap_match_formulas() {
        let mut g = [0.0, 1.0, -3.0];
        geglu(&mut g, &[2.0, 2.0, 2.0]);
        assert_eq!(g[0], 0.0);
        // gelu_tanh(1) = 0.841192, gelu_tanh(-3) = -0.003637
        assert!((g[1] - 2.0 * 0.841_192).abs() < 1e-5, "{}", g[1]);
        assert!((g[2] - 2.0 * -0.003_637).abs() < 1e-5, "{}", g[2]);
        let mut x = [0.0, 30.0, -1000.0];
        softcap(&mut x, 30.0);
        assert_eq!(x[0], 0.0);
        assert!((x[1] - 30.0 * 1f32.tanh()).abs() < 1e-5);
        assert!((x[2] + 30.0).abs() < 1e-4);
    }

    #[test]
    fn swiglu_matches_formula() {
        let mut g = [0.0, 1.0, -2.0];
        swiglu(&mut g, &[2.0, 2.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!((g[2] - 2.0 * -2.0 / (1.0 + 2.0f32.exp())).abs() < 1e-6);
    }
}
