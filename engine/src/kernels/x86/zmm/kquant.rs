//! 512-bit token-pair tiles for Q4_K, Q5_K and Q6_K (batched decode, prefill on VNNI): the
//! loops of `x86/kquant.rs` at the [`Zmm`] width, with the float operations of `kquant::dot`
//! lane for lane like the other pair tiles.
//!
//! A weight register is the 256-bit one with each 32-bit lane duplicated for the pair; the
//! integer step is AVX512-BW's `madd(maddubs(q, x), sc)` over the interleaved pair (the
//! sub-block scale applied in integers as in the 256-bit tiles; `vpdpbusd` would need a
//! separate multiply).

use std::arch::x86_64::*;

use super::super::super::{OutPtr, QMatrix, WeightType};
use super::super::kquant::tile_k;
use super::super::width::Width;
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
    let zmm = Zmm(());
    match m.ty {
        WeightType::Q4_K => tile_k::<_, R, T, TP, 4>(zmm, m, r0, x, out),
        WeightType::Q5_K => tile_k::<_, R, T, TP, 5>(zmm, m, r0, x, out),
        WeightType::Q6_K => tile_k::<_, R, T, TP, 6>(zmm, m, r0, x, out),
        other => unreachable!("{other:?} has no token-pair tile"),
    }
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
    fn widen_ps(self, v: __m256) -> __m512 {
        unsafe { dup_ps(v) }
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
    fn dot(self, w: __m512i, x: __m512i, sc: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(_mm512_madd_epi16(_mm512_maddubs_epi16(w, x), sc)) }
    }
    #[inline(always)]
    fn dot_minus32(self, w: __m512i, x: __m512i, x32: __m512i, sc: __m512i) -> __m512 {
        unsafe {
            let p = _mm512_sub_epi16(_mm512_maddubs_epi16(w, x), x32);
            _mm512_cvtepi32_ps(_mm512_madd_epi16(p, sc))
        }
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
    fn xs<const N: usize>(self, x: &PairView<'_, N>, n: usize, b0: usize) -> __m512 {
        unsafe { x.s16(n, b0) }
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
    fn scale(self, sc: &[f32; 16], j: usize) -> __m512 {
        unsafe { pair_scale(sc, j) }
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
