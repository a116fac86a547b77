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
    /// Token pairs `(2p, 2p + 1)` interleaved for the 512-bit tiles (batches of 4 or more
    /// tokens only), built once here rather than in every tile; see [`Pairs`].
    pub(super) pairs: Pairs,
}

/// Quantized activations of token pairs `(2p, 2p + 1)`, interleaved per 4-byte group as the
/// 512-bit token-pair tiles consume them (`x86/zmm.rs`): per pair and block 64 bytes
/// `t0[0..4] t1[0..4] t0[4..8] t1[4..8] …`, the same bytes XORed with 0x80 (`x + 128` as u8,
/// for Q8_0 weights), and the scales and `d · Σq` as `(t0, t1)` f32 pairs, `2 · nb8` per pair.
#[derive(Clone, Debug, Default)]
pub(super) struct Pairs {
    pub(super) n: usize,
    pub(super) q: Vec<u8>,
    pub(super) qu: Vec<u8>,
    pub(super) d: Vec<f32>,
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
        self.pairs.n = 0;
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
        #[cfg(target_arch = "x86_64")]
        if super::isa() != super::Isa::Scalar {
            // SAFETY: every non-scalar backend is only selected with AVX2, FMA and F16C.
            unsafe { super::x86::quant::quantize_rows(self, x) };
            self.interleave_pairs();
            return;
        }
        self.quantize_rows(x, scalar::quantize_block);
        self.interleave_pairs();
    }

    /// Fills [`Pairs`] from the per-token quantization (only for 4 or more tokens: smaller
    /// batches never use the 512-bit tiles).
    fn interleave_pairs(&mut self) {
        let p = &mut self.pairs;
        p.n = if self.n_tokens >= 4 {
            self.n_tokens / 2
        } else {
            0
        };
        let (nb, nb8, cols) = (self.nb, self.nb8, self.cols);
        p.q.resize(p.n * nb * 64, 0);
        p.qu.resize(p.n * nb * 64, 0);
        p.d.resize(p.n * 2 * nb8, 0.0);
        p.s.resize(p.n * 2 * nb8, 0.0);
        for i in 0..p.n {
            let (x0, x1) = (
                &self.q[2 * i * cols..(2 * i + 1) * cols],
                &self.q[(2 * i + 1) * cols..(2 * i + 2) * cols],
            );
            let dst = &mut p.q[i * nb * 64..(i + 1) * nb * 64];
            for ((d, a), b) in dst
                .chunks_exact_mut(8)
                .zip(x0.chunks_exact(4))
                .zip(x1.chunks_exact(4))
            {
                for k in 0..4 {
                    d[k] = a[k] as u8;
                    d[4 + k] = b[k] as u8;
                }
            }
            let (src, dst) = (
                &p.q[i * nb * 64..(i + 1) * nb * 64],
                &mut p.qu[i * nb * 64..],
            );
            for (u, &v) in dst.iter_mut().zip(src) {
                *u = v ^ 0x80;
            }
            for (src, dst) in [(&self.d, &mut p.d), (&self.s, &mut p.s)] {
                let (a, b) = (
                    &src[2 * i * nb8..(2 * i + 1) * nb8],
                    &src[(2 * i + 1) * nb8..(2 * i + 2) * nb8],
                );
                let dst = &mut dst[i * 2 * nb8..(i + 1) * 2 * nb8];
                for (d, (a, b)) in dst.chunks_exact_mut(2).zip(a.iter().zip(b)) {
                    d[0] = *a;
                    d[1] = *b;
                }
            }
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

    /// Quantizes every block of `x` (tokens of `nb` blocks) with `quantize_block`: the values
    /// into `q`, the scales into `d` and `d · Σq` into `s` (`nb8` per token).
    #[inline(always)]
    pub(super) fn quantize_rows(
        &mut self,
        x: &[f32],
        mut quantize_block: impl FnMut(&[f32], &mut [i8]) -> (f32, i32),
    ) {
        let (nb, nb8) = (self.nb, self.nb8);
        for (i, (xb, qb)) in x
            .chunks_exact(QK)
            .zip(self.q.chunks_exact_mut(QK))
            .enumerate()
        {
            let (t, b) = (i / nb, i % nb);
            let (dv, sum) = quantize_block(xb, qb);
            self.d[t * nb8 + b] = dv;
            self.s[t * nb8 + b] = dv * sum as f32;
        }
    }
}
