//! 512-bit token-pair tiles for Q4_K, Q5_K and Q6_K (batched decode, prefill on VNNI), with
//! the float operations of `kquant::dot` lane for lane like the other pair tiles: Q4_K / Q5_K
//! as the nibble tile of the 32-element formats over their sub-blocks, Q6_K as the loop of
//! `x86/kquant.rs` at the [`Zmm`] width.
//!
//! A weight register is the 256-bit one with each 32-bit lane duplicated for the pair; the
//! integer step is AVX512-BW's `madd(maddubs(q, x), sc)` over the interleaved pair (the
//! sub-block scale applied in integers as in the 256-bit tiles; `vpdpbusd` would need a
//! separate multiply).

use std::arch::x86_64::*;

use super::super::super::QK_K;
use super::super::super::{OutPtr, QMatrix, WeightType};
use super::super::kquant::{k45_quants, k45_scales, tile_k6, SuperRows};
use super::super::width::Width;
use super::{chunk_scales, dup_epi32, dup_ps, finish_tile, reduce, PairView};

/// Rows `r0..r0 + R` × the `T = 2·TP` tokens of `x` of a Q4_K / Q5_K / Q6_K matrix.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(super) fn tile<const R: usize, const T: usize, const TP: usize>(
    m: &QMatrix,
    r0: usize,
    x: &PairView<'_, TP>,
    out: OutPtr,
) {
    assert_eq!(T, 2 * TP);
    let zmm = Zmm(());
    match m.ty {
        WeightType::Q4_K => tile_k45::<R, T, TP, false>(m, r0, x, out),
        WeightType::Q5_K => tile_k45::<R, T, TP, true>(m, r0, x, out),
        WeightType::Q6_K => tile_k6::<_, R, T, TP>(zmm, m, r0, x, out),
        other => unreachable!("{other:?} has no token-pair tile"),
    }
}

/// Q4_K (`Q5 = false`) or Q5_K tile of rows `r0..r0 + R` × the `T = 2·TP` tokens of `x`: the
/// nibble tile of the 32-element formats (`zmm::tile_q`) with each sub-block as a Q4_1 / Q5_1
/// block (see `kquant::dot`).
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
fn tile_k45<const R: usize, const T: usize, const TP: usize, const Q5: bool>(
    m: &QMatrix,
    r0: usize,
    x: &PairView<'_, TP>,
    out: OutPtr,
) {
    assert_eq!(T, 2 * TP);
    let rows = SuperRows::<R>::new(m, r0);
    let mut acc = [[_mm512_setzero_ps(); TP]; R];
    let mut sc = [[[0f32; 16]; TP]; R];
    let zero = _mm512_setzero_si512();
    for s in 0..m.cols / QK_K {
        let b0 = 8 * s;
        for r in 0..R {
            let (dw, mw) = k45_scales(rows.block(r, s));
            let mw = dup_ps(mw);
            for p in 0..TP {
                acc[r][p] = _mm512_fmadd_ps(mw, x.s16(p, b0), acc[r][p]);
            }
            chunk_scales::<TP>(dup_ps(dw), x, b0, &mut sc[r]);
        }
        // Per (row, pair), the per-lane partial dots of each sub-block.
        let mut l = [[[zero; 8]; TP]; R];
        for g in 0..4 {
            let (j0, j1) = (2 * g, 2 * g + 1);
            rows.pf.block(b0 + j0);
            rows.pf.block(b0 + j1);
            let mut w = [(zero, zero); R];
            for r in 0..R {
                let (lo, hi) = k45_quants::<Q5>(rows.block(r, s), g);
                w[r] = (dup_epi32(lo), dup_epi32(hi));
            }
            for p in 0..TP {
                let (x0, x1) = (x.xq(p, b0 + j0), x.xq(p, b0 + j1));
                for r in 0..R {
                    l[r][p][j0] = _mm512_dpbusd_epi32(zero, w[r].0, x0);
                    l[r][p][j1] = _mm512_dpbusd_epi32(zero, w[r].1, x1);
                }
            }
        }
        // Lanes 2j, 2j + 1: sub-block j's whole dots.
        for r in 0..R {
            for p in 0..TP {
                let l = _mm512_cvtepi32_ps(reduce::block_sums(&l[r][p]));
                // SAFETY: `sc[r][p]` is 16 readable f32s; unaligned load.
                let v = unsafe { _mm512_loadu_ps(sc[r][p].as_ptr()) };
                acc[r][p] = _mm512_fmadd_ps(l, v, acc[r][p]);
            }
        }
    }
    finish_tile::<R, T, TP>(&acc, m.rows, r0, x.t0, out);
}

/// 512-bit registers, a token pair each (lanes interleaved as in [`PairView`]). Made only by
/// [`tile`], whose features are the ones it requires.
#[derive(Clone, Copy)]
pub(in super::super) struct Zmm(());

// SAFETY: a `Zmm` is made only inside `tile`, which runs with AVX2, FMA, F16C, AVX512F/BW/VL:
// every instruction these methods use.
unsafe impl Width for Zmm {
    type F = __m512;
    type I = __m512i;
    type View<'a, const N: usize> = PairView<'a, N>;
    type Scales = [f32; 16];
    const NO_SCALES: [f32; 16] = [0.0; 16];

    #[inline(always)]
    fn zero(self) -> __m512 {
        // SAFETY: `self` proves the features (the trait's contract); the same below.
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn widen(self, q: __m256i) -> __m512i {
        unsafe { dup_epi32(q) }
    }
    #[inline(always)]
    fn set16(self, v: i16) -> __m512i {
        unsafe { _mm512_set1_epi16(v) }
    }
    #[inline(always)]
    fn half_scales(self, a: i16, b: i16) -> __m512i {
        unsafe { _mm512_inserti64x4::<1>(_mm512_set1_epi16(a), _mm256_set1_epi16(b)) }
    }
    #[inline(always)]
    fn dot_minus32(self, w: __m512i, x: __m512i, x32: __m512i, sc: __m512i) -> __m512i {
        unsafe {
            let p = _mm512_sub_epi16(_mm512_maddubs_epi16(w, x), x32);
            _mm512_madd_epi16(p, sc)
        }
    }
    #[inline(always)]
    fn block_sums(self, l: &[__m512i; 8]) -> __m512i {
        unsafe { reduce::block_sums(l) }
    }
    #[inline(always)]
    fn cvt(self, v: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(v) }
    }
    #[inline(always)]
    fn times32(self, x: __m512i) -> __m512i {
        unsafe { _mm512_maddubs_epi16(_mm512_set1_epi8(32), x) }
    }
    #[inline(always)]
    fn xq<const N: usize>(self, x: &PairView<'_, N>, n: usize, b: usize) -> __m512i {
        unsafe { x.xq(n, b) }
    }
    #[inline(always)]
    fn scales<const N: usize>(
        self,
        d: f32,
        x: &PairView<'_, N>,
        b0: usize,
        out: &mut [[f32; 16]; N],
    ) {
        unsafe { chunk_scales::<N>(_mm512_set1_ps(d), x, b0, out) }
    }
    #[inline(always)]
    fn load_scales(self, sc: &[f32; 16]) -> __m512 {
        unsafe { _mm512_loadu_ps(sc.as_ptr()) }
    }
    #[inline(always)]
    fn finish<const R: usize, const T: usize, const N: usize>(
        self,
        acc: &[[__m512; N]; R],
        rows: usize,
        r0: usize,
        x: &PairView<'_, N>,
        out: OutPtr,
    ) {
        unsafe { finish_tile::<R, T, N>(acc, rows, r0, x.t0, out) }
    }
}
