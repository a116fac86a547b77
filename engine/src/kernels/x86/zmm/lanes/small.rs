//! Small batches (decode): each block's repacked quants stay in registers while every token of
//! the batch takes its dot with them, instead of going through the group's buffer.
//!
//! With a few tokens per group, storing the repacked quants and loading them back costs about
//! as much as the arithmetic, and the buffer (twice the quants' size for the 4-bit formats)
//! competes in L1 with the group being read and the next one being fetched. Here a block's
//! eight vectors are used as soon as they are made; the per-token accumulators of the eight
//! lanes live in a small array. The float work and its order are the same as in
//! [`super::tokens`]: block `b` goes into lane `b % 8`, in increasing `b`.

use std::arch::x86_64::*;

use super::super::super::super::kquant::{K4_QS, K5_QH, K5_QS};
use super::super::super::super::{QK, QK_K};
use super::{
    int_dot, k45_scales16, k6_scales16, quads, quads4, quant_ptrs, walk, write_sums, Blk, Fetch,
    Pass, QMatrix, Scales, Unit, WeightType, G, K6, OFFSET, SIGNED,
};

/// The most tokens this path takes (beyond, the buffered path reuses each group's repacking
/// for more tokens than fit in registers).
pub(super) const MAX: usize = 8;

/// All `N` tokens of `p.x` for one group (`p.g` is not used): out rows `r0..r0 + 16`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
pub(super) fn tokens<const N: usize, const MODE: u8>(p: &Pass<'_>, fetch: &mut Fetch<'_>) {
    let Pass {
        g: _,
        m,
        x,
        corr,
        r0,
        out,
    } = *p;
    let nb = m.nb;
    assert_eq!(x.n_tokens, N);
    let mut xq = [std::ptr::null(); N];
    let (mut xd, mut xs, mut xc) = ([&[][..]; N], [&[][..]; N], [&[][..]; N]);
    for t in 0..N {
        let q = x.q_row(t);
        assert_eq!(q.len(), QK * nb);
        xq[t] = q.as_ptr();
        xd[t] = &x.d_row(t)[..nb];
        xs[t] = &x.s_row(t)[..nb];
        match MODE {
            SIGNED => xc[t] = &corr[t * nb..(t + 1) * nb],
            K6 => xc[t] = &corr[t * 2 * nb..(t + 1) * 2 * nb],
            _ => {}
        }
    }
    let mut lanes = [[_mm512_setzero_ps(); 8]; N];
    // All of the next group's lines during the walk.
    // The float step is written out as in `super::tokens`: sharing it through a struct of the
    // token rows measured 6–9% slower prefill and batch 16 (the cause was not traced).
    walk!(m, r0, fetch, 1, |b, w, s| {
        for t in 0..N {
            // SAFETY: `xq[t]` holds `32 · nb` activations (checked above) and `b < nb`.
            let l = unsafe { int_dot::<MODE>(w, xq[t], b, xc[t], s.sc) };
            let acc = &mut lanes[t][b % 8];
            if MODE == OFFSET {
                *acc = _mm512_fmadd_ps(s.mw, _mm512_set1_ps(xs[t][b]), *acc);
            }
            let sc = _mm512_mul_ps(s.dw, _mm512_set1_ps(xd[t][b]));
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), sc, *acc);
        }
    });
    write_sums(&lanes, m.rows, r0, 0, out);
}
