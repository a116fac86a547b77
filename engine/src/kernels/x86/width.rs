//! The register width of a K-quant tile. The Q6_K loop (`kquant.rs`) is written
//! once over [`Width`] and compile to the 256-bit tiles, one token per register ([`Ymm`]), and
//! to the 512-bit tiles, a token pair per register (`zmm::kquant::Zmm`). What differs between
//! the two is only how a register is filled: a 256-bit weight register is used as it is or with
//! each 32-bit lane duplicated for the pair, an activation scale is one broadcast f32 or a
//! broadcast pair.

use std::arch::x86_64::*;

use super::super::OutPtr;
use super::kquant::{block_scales, k6_quants, pair_scales};
use super::{block_sums, finish, Tokens};

/// The vector operations of a K-quant tile at one register width.
///
/// The methods are `inline(always)` so that they compile into the `#[target_feature]` tile
/// dispatcher that calls the generic loop, and they issue their instructions unchecked.
///
/// # Safety
/// A value of an implementing type may exist only on a CPU that has AVX2, FMA and F16C and the
/// width's own instructions: holding one is the proof the methods rely on.
pub(super) unsafe trait Width: Copy {
    /// An f32 register.
    type F: Copy;
    /// An integer register.
    type I: Copy;
    /// The activations of a tile, `N` registers per row.
    type View<'a, const N: usize>;
    /// `d · dx` of a super-block's eight 32-element blocks, for one (row, register).
    type Scales: Copy;
    /// All-zero [`Width::Scales`].
    const NO_SCALES: Self::Scales;

    /// 0.0 in every lane.
    fn zero(self) -> Self::F;
    /// `a · b + c`.
    fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// A block's 32 quants (one token's order) as a weight register.
    fn widen(self, q: __m256i) -> Self::I;
    /// `v` in every i16 lane.
    fn set16(self, v: i16) -> Self::I;
    /// The i16 scale vector of a block of two 16-element halves: `a` for the first, `b` for
    /// the second.
    fn half_scales(self, a: i16, b: i16) -> Self::I;
    /// `Σ (w − 32)·x` over each four bytes, pairs scaled by `sc` (i16), given
    /// `x32 = maddubs(32, x)` (both i16 sums are exact).
    fn dot_minus32(self, w: Self::I, x: Self::I, x32: Self::I, sc: Self::I) -> Self::I;
    /// Lane `j` (both lanes of pair `j` at 512 bits) of the result: the sum of the lanes of
    /// `l[j]`, block `j`'s whole dot (exact).
    fn block_sums(self, l: &[Self::I; 8]) -> Self::I;
    /// The i32 lanes as f32.
    fn cvt(self, v: Self::I) -> Self::F;
    /// `maddubs(32, x)`.
    fn times32(self, x: Self::I) -> Self::I;
    /// The quantized activations of register `n`, block `b`.
    fn xq<const N: usize>(self, x: &Self::View<'_, N>, n: usize, b: usize) -> Self::I;
    /// Stores `d · dx` of blocks `b0..b0 + 8` for every register of the row.
    fn scales<const N: usize>(
        self,
        d: f32,
        x: &Self::View<'_, N>,
        b0: usize,
        out: &mut [Self::Scales; N],
    );
    /// The scales of the eight blocks, in the lanes [`Width::block_sums`] leaves their dots.
    fn load_scales(self, sc: &Self::Scales) -> Self::F;
    /// Reduces the accumulators of rows `r0..r0 + R` × the `T` tokens of `x` and writes them.
    fn finish<const R: usize, const T: usize, const N: usize>(
        self,
        acc: &[[Self::F; N]; R],
        rows: usize,
        r0: usize,
        x: &Self::View<'_, N>,
        out: OutPtr,
    );

    /// Block `j`'s quants `q` (the weight is `q − 32`) of a Q6_K super-block.
    #[inline(always)]
    fn quants6(self, blk: &[u8], j: usize) -> Self::I {
        // SAFETY: a `Width` value proves AVX2, FMA and F16C (the trait's contract).
        self.widen(unsafe { k6_quants(blk, j) })
    }
}

/// 256-bit registers, one token each (AVX2).
#[derive(Clone, Copy)]
pub(super) struct Ymm(());

impl Ymm {
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[inline(always)]
    pub(super) unsafe fn new() -> Ymm {
        Ymm(())
    }
}

// SAFETY: `Ymm::new` requires AVX2, FMA and F16C, all these methods use.
unsafe impl Width for Ymm {
    type F = __m256;
    type I = __m256i;
    type View<'a, const N: usize> = Tokens<'a, N>;
    type Scales = [f32; 8];
    const NO_SCALES: [f32; 8] = [0.0; 8];

    #[inline(always)]
    fn zero(self) -> __m256 {
        // SAFETY: `self` proves the features (the trait's contract); the same below.
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    fn widen(self, q: __m256i) -> __m256i {
        q
    }
    #[inline(always)]
    fn set16(self, v: i16) -> __m256i {
        unsafe { _mm256_set1_epi16(v) }
    }
    #[inline(always)]
    fn half_scales(self, a: i16, b: i16) -> __m256i {
        unsafe { pair_scales(a, b) }
    }
    #[inline(always)]
    fn dot_minus32(self, w: __m256i, x: __m256i, x32: __m256i, sc: __m256i) -> __m256i {
        unsafe {
            let p = _mm256_sub_epi16(_mm256_maddubs_epi16(w, x), x32);
            _mm256_madd_epi16(p, sc)
        }
    }
    #[inline(always)]
    fn block_sums(self, l: &[__m256i; 8]) -> __m256i {
        unsafe { block_sums(l) }
    }
    #[inline(always)]
    fn cvt(self, v: __m256i) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(v) }
    }
    #[inline(always)]
    fn times32(self, x: __m256i) -> __m256i {
        unsafe { _mm256_maddubs_epi16(_mm256_set1_epi8(32), x) }
    }
    #[inline(always)]
    fn xq<const N: usize>(self, x: &Tokens<'_, N>, n: usize, b: usize) -> __m256i {
        unsafe { x.xq32(n, b) }
    }
    #[inline(always)]
    fn scales<const N: usize>(self, d: f32, x: &Tokens<'_, N>, b0: usize, out: &mut [[f32; 8]; N]) {
        unsafe { block_scales::<N>(d, x, b0, out) }
    }
    #[inline(always)]
    fn load_scales(self, sc: &[f32; 8]) -> __m256 {
        unsafe { _mm256_loadu_ps(sc.as_ptr()) }
    }
    #[inline(always)]
    fn finish<const R: usize, const T: usize, const N: usize>(
        self,
        acc: &[[__m256; N]; R],
        rows: usize,
        r0: usize,
        x: &Tokens<'_, N>,
        out: OutPtr,
    ) {
        debug_assert_eq!(T, N);
        unsafe { finish(acc, rows, r0, x.t0, out) }
    }
}
