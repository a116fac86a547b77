//! 512-bit token-pair tiles for Q4_K, Q5_K and Q6_K (batched decode, prefill on VNNI), with
//! the float operations of `kquant::dot` lane for lane, like the other pair tiles.
//!
//! The integer step is AVX512-BW's `madd(maddubs(q, x), sc)` over the interleaved pair (the
//! sub-block scale applied in integers as in the 256-bit tiles; `vpdpbusd` would need a
//! separate multiply). Q6_K has no 512-bit `sign`, so its `q − 32` is `maddubs(q, x) −
//! maddubs(32, x)`, the second term computed once per token pair and block for all rows (both
//! `i16` sums are exact: at most `2·63·127`).

use std::arch::x86_64::*;

use super::super::super::kquant::K6_D;
use super::super::super::{OutPtr, QMatrix, WeightType, QK_K};
use super::super::kquant::{f16_le, k45_head, k45_quants, k6_quants, k6_scales, SuperRows};
use super::{chunk_scales, dup_epi32, dup_ps, finish_tile, pair_scale, PairView};

/// Rows `r0..r0 + R` × the `T = 2·TP` tokens of `x` of a Q4_K / Q5_K / Q6_K matrix.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(super) fn tile<const R: usize, const T: usize, const TP: usize>(
    m: &QMatrix,
    r0: usize,
    x: &PairView<'_, TP>,
    out: OutPtr,
) {
    assert_eq!(T, 2 * TP);
    match m.ty {
        WeightType::Q4_K => tile_k45::<R, T, TP, false>(m, r0, x, out),
        WeightType::Q5_K => tile_k45::<R, T, TP, true>(m, r0, x, out),
        WeightType::Q6_K => tile_k6::<R, T, TP>(m, r0, x, out),
        other => unreachable!("{other:?} has no token-pair tile"),
    }
}

/// Q4_K (`Q5 = false`) or Q5_K pair tile.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
fn tile_k45<const R: usize, const T: usize, const TP: usize, const Q5: bool>(
    m: &QMatrix,
    r0: usize,
    x: &PairView<'_, TP>,
    out: OutPtr,
) {
    let rows = SuperRows::<R>::new(m, r0);
    let mut acc = [[_mm512_setzero_ps(); TP]; R];
    let mut dd = [[[0f32; 16]; TP]; R];
    for s in 0..m.cols / QK_K {
        let b0 = 8 * s;
        let mut sc = [[0u8; 8]; R];
        for r in 0..R {
            let (d, scs, mneg) = k45_head(rows.block(r, s));
            sc[r] = scs;
            let mneg = dup_ps(mneg);
            for p in 0..TP {
                acc[r][p] = _mm512_fmadd_ps(mneg, x.s16(p, b0), acc[r][p]);
            }
            chunk_scales::<TP>(_mm512_set1_ps(d), x, b0, &mut dd[r]);
        }
        // Keep the scales in memory so that they are broadcast by loads.
        std::hint::black_box(&mut dd);
        for g in 0..4 {
            let (j0, j1) = (2 * g, 2 * g + 1);
            rows.pf.block(b0 + j0);
            rows.pf.block(b0 + j1);
            let mut lo = [_mm512_setzero_si512(); R];
            let mut hi = [_mm512_setzero_si512(); R];
            let mut s0 = [_mm512_setzero_si512(); R];
            let mut s1 = [_mm512_setzero_si512(); R];
            for r in 0..R {
                s0[r] = _mm512_set1_epi16(sc[r][j0].into());
                s1[r] = _mm512_set1_epi16(sc[r][j1].into());
                let (l, h) = k45_quants::<Q5>(rows.block(r, s), g);
                lo[r] = dup_epi32(l);
                hi[r] = dup_epi32(h);
            }
            for p in 0..TP {
                let (x0, x1) = (x.xq(p, b0 + j0), x.xq(p, b0 + j1));
                for r in 0..R {
                    let l0 = _mm512_madd_epi16(_mm512_maddubs_epi16(lo[r], x0), s0[r]);
                    let f0 = pair_scale(&dd[r][p], j0);
                    acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l0), f0, acc[r][p]);
                    let l1 = _mm512_madd_epi16(_mm512_maddubs_epi16(hi[r], x1), s1[r]);
                    let f1 = pair_scale(&dd[r][p], j1);
                    acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l1), f1, acc[r][p]);
                }
            }
        }
    }
    finish_tile::<R, T, TP>(&acc, m.rows, r0, x.t0, out);
}

/// Q6_K pair tile.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
fn tile_k6<const R: usize, const T: usize, const TP: usize>(
    m: &QMatrix,
    r0: usize,
    x: &PairView<'_, TP>,
    out: OutPtr,
) {
    let rows = SuperRows::<R>::new(m, r0);
    let m32 = _mm512_set1_epi8(32);
    let mut acc = [[_mm512_setzero_ps(); TP]; R];
    let mut dd = [[[0f32; 16]; TP]; R];
    for s in 0..m.cols / QK_K {
        let b0 = 8 * s;
        for r in 0..R {
            let blk = rows.block(r, s);
            chunk_scales::<TP>(_mm512_set1_ps(f16_le(blk, K6_D)), x, b0, &mut dd[r]);
        }
        // Keep the scales in memory so that they are broadcast by loads.
        std::hint::black_box(&mut dd);
        for j in 0..8 {
            rows.pf.block(b0 + j);
            let mut w = [_mm512_setzero_si512(); R];
            let mut scv = [_mm512_setzero_si512(); R];
            for r in 0..R {
                let blk = rows.block(r, s);
                w[r] = dup_epi32(k6_quants(blk, j));
                let (sa, sb) = k6_scales(blk, j);
                scv[r] = _mm512_inserti64x4::<1>(
                    _mm512_set1_epi16(sa.into()),
                    _mm256_set1_epi16(sb.into()),
                );
            }
            for p in 0..TP {
                let xv = x.xq(p, b0 + j);
                let x32 = _mm512_maddubs_epi16(m32, xv);
                for r in 0..R {
                    let pr = _mm512_sub_epi16(_mm512_maddubs_epi16(w[r], xv), x32);
                    let l = _mm512_cvtepi32_ps(_mm512_madd_epi16(pr, scv[r]));
                    acc[r][p] = _mm512_fmadd_ps(l, pair_scale(&dd[r][p], j), acc[r][p]);
                }
            }
        }
    }
    finish_tile::<R, T, TP>(&acc, m.rows, r0, x.t0, out);
}
