//! [`Activations`]: the f32 activations of a batch of tokens and their per-block Q8
//! quantization, reused across matmuls and steps.

use super::{scalar, QK};

/// Reusable per-step activation buffer: an f32 copy plus the Q8 blocks, so no allocation per
/// call after warm-up.
#[derive(Clone, Debug, Default)]
pub struct Activations {
    pub(super) n_tokens: usize,
    pub(super) cols: usize,
    /// Blocks per token (`cols / 32`), and the padded stride of `d` / `s` (multiple of 8).
    pub(super) nb: usize,
    pub(super) nb8: usize,
    pub(super) quantized: bool,
    pub(super) x: Vec<f32>,
    pub(super) q: Vec<i8>,
    /// Per token, `nb8` block scales (f16-rounded, zero-padded).
    pub(super) d: Vec<f32>,
    /// Per token, `nb8` values `d · Σq` (zero-padded).
    pub(super) s: Vec<f32>,
}

impl Activations {
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `n_tokens` rows of `cols` activations (`x.len() == n_tokens * cols`) and quantizes
    /// them when `cols` is a multiple of 32. Otherwise only F32 weights may be used with them
    /// (their column count is the same, so a quantized matrix would fail `matmul`'s shape
    /// check).
    pub fn set(&mut self, x: &[f32], n_tokens: usize, cols: usize) {
        assert_eq!(
            x.len(),
            n_tokens * cols,
            "Activations::set: x.len() != n_tokens * cols"
        );
        self.n_tokens = n_tokens;
        self.cols = cols;
        self.x.clear();
        self.x.extend_from_slice(x);
        self.quantized = cols.is_multiple_of(QK);
        if !self.quantized {
            return;
        }
        self.nb = cols / QK;
        self.nb8 = self.nb.next_multiple_of(8);
        self.q.resize(n_tokens * cols, 0);
        self.d.clear();
        self.d.resize(n_tokens * self.nb8, 0.0);
        self.s.clear();
        self.s.resize(n_tokens * self.nb8, 0.0);
        for (i, (xb, qb)) in x
            .chunks_exact(QK)
            .zip(self.q.chunks_exact_mut(QK))
            .enumerate()
        {
            let (t, b) = (i / self.nb, i % self.nb);
            let (d, sum) = scalar::quantize_block(xb, qb);
            self.d[t * self.nb8 + b] = d;
            self.s[t * self.nb8 + b] = d * sum as f32;
        }
    }

    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub(super) fn x_row(&self, t: usize) -> &[f32] {
        &self.x[t * self.cols..(t + 1) * self.cols]
    }

    pub(super) fn q_row(&self, t: usize) -> &[i8] {
        &self.q[t * self.cols..(t + 1) * self.cols]
    }

    /// Block scales of token `t`, `nb8` long (zero-padded).
    pub(super) fn d_row(&self, t: usize) -> &[f32] {
        &self.d[t * self.nb8..(t + 1) * self.nb8]
    }

    /// `d · Σq` of token `t`, `nb8` long (zero-padded).
    pub(super) fn s_row(&self, t: usize) -> &[f32] {
        &self.s[t * self.nb8..(t + 1) * self.nb8]
    }
}
