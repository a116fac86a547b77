//! K-quant tiles (Q2_K … Q6_K), bit-identical to `kquant::dot`, and the block decoders the
//! 256-bit and 512-bit tiles share.
//!
//! Per super-block and row the scales are decoded once (scalar: 12 bytes of 6-bit fields, or 16
//! `i8`s) and the products `d · dx` of all eight activation blocks are formed with one vector
//! multiply per token; the quants are unpacked 32 bytes at a time (a Q4_K/Q5_K load yields two
//! sub-blocks: low and high nibbles; Q6_K combines `ql` nibbles with 2-bit `qh` fields). The
//! integer step is `madd(maddubs(q, x), sc)`: the sub-block scale takes the place of the ones
//! vector of the 32-element formats, so scaling costs nothing. Q6_K's `q − 32` is
//! `maddubs(q, x) − maddubs(32, x)`; Q3_K's signed quants use the sign trick (`|w| × sign(x,
//! w)`). Sums never saturate: a `maddubs` pair is at most `2·63·127` (Q6_K) or `2·31·127`
//! (Q5_K), and a lane at most `2^21`.
//!
//! The Q4_K/Q5_K and Q6_K loops are written once over the register width ([`Width`]): the
//! 256-bit tiles of both x86 backends use them with [`Ymm`], the 512-bit token-pair tiles of the
//! VNNI backend (`zmm/kquant.rs`) with `Zmm`. Q2_K and Q3_K have 256-bit tiles only.

use std::arch::x86_64::*;

use super::super::kquant::{
    scales_k3, scales_k4, K2_D, K2_QS, K3_D, K3_QS, K3_SC, K4_QS, K5_QH, K5_QS, K6_D, K6_QH, K6_SC,
};
use super::super::{OutPtr, QMatrix, WeightType, QK_K};
use super::width::{Width, Ymm};
use super::{block_sums, dot_avx2, finish, Prefetch, Tokens};

/// Rows `r0..r0 + R` × the tokens of `tok` of a K-quant matrix.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn tile<const R: usize, const T: usize>(
    m: &QMatrix,
    r0: usize,
    tok: &Tokens<'_, T>,
    out: OutPtr,
) {
    // SAFETY: this function's features are those `Ymm` requires.
    let ymm = unsafe { Ymm::new() };
    match m.ty {
        WeightType::Q2_K => tile_k23::<R, T, false>(m, r0, tok, out),
        WeightType::Q3_K => tile_k23::<R, T, true>(m, r0, tok, out),
        WeightType::Q4_K => tile_k45::<R, T, false>(m, r0, tok, out),
        WeightType::Q5_K => tile_k45::<R, T, true>(m, r0, tok, out),
        WeightType::Q6_K => tile_k6::<_, R, T, T>(ymm, m, r0, tok, out),
        other => unreachable!("{other:?} is not a K-quant"),
    }
}

/// The rows `r0..r0 + R` of a K-quant tile, each checked to hold `cols / 256` super-blocks,
/// and the prefetcher of their weight stream.
pub(super) struct SuperRows<'a, const R: usize> {
    rows: [&'a [u8]; R],
    /// Bytes per super-block.
    bb: usize,
    pub(super) pf: Prefetch,
}

impl<'a, const R: usize> SuperRows<'a, R> {
    #[inline(always)]
    pub(super) fn new(m: &'a QMatrix, r0: usize) -> Self {
        let bb = m.ty.block_bytes();
        let mut rows = [&[][..]; R];
        for (r, row) in rows.iter_mut().enumerate() {
            *row = m.raw_row(r0 + r);
            assert_eq!(row.len(), m.cols / QK_K * bb);
        }
        let pf = Prefetch::new::<R>(m, r0, rows[0].as_ptr());
        SuperRows { rows, bb, pf }
    }

    /// Super-block `s` of row `r` of the tile.
    #[inline(always)]
    pub(super) fn block(&self, r: usize, s: usize) -> &'a [u8] {
        &self.rows[r][s * self.bb..(s + 1) * self.bb]
    }
}

/// The little-endian f16 at `b[at..at + 2]`, widened with F16C (exact, as `half`'s conversion,
/// but one instruction inlined into the tile instead of a call that detects the CPU each time).
#[target_feature(enable = "f16c")]
#[inline]
pub(super) fn f16_le(b: &[u8], at: usize) -> f32 {
    let bits = u16::from_le_bytes([b[at], b[at + 1]]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Loads 32 bytes at `p`.
///
/// # Safety
/// `p` must point to 32 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes; unaligned load.
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Stores `d · dx` of blocks `b0..b0 + 8` for every token of the tile.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn block_scales<const T: usize>(
    d: f32,
    tok: &Tokens<'_, T>,
    b0: usize,
    dd: &mut [[f32; 8]; T],
) {
    let dv = _mm256_set1_ps(d);
    for (t, dd) in dd.iter_mut().enumerate() {
        // SAFETY: room for 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(dd.as_mut_ptr(), _mm256_mul_ps(dv, tok.xd8(t, b0))) };
    }
}

/// `−dmin · m_k` for a Q4_K / Q5_K super-block's eight sub-block mins (negating the product
/// or a factor rounds the same).
#[target_feature(enable = "avx2")]
#[inline]
fn neg_mins(dmin: f32, mins: &[u8; 8]) -> __m256 {
    let mut mi = [0i32; 8];
    for (mi, &v) in mi.iter_mut().zip(mins) {
        *mi = v.into();
    }
    // SAFETY: `mi` is 8 readable i32s; unaligned load.
    let mv = _mm256_cvtepi32_ps(unsafe { _mm256_loadu_si256(mi.as_ptr().cast()) });
    _mm256_mul_ps(_mm256_set1_ps(-dmin), mv)
}

/// A Q4_K / Q5_K super-block's eight sub-block scales `d·sc_j` and offset weights
/// `−(dmin·m_j)`, lane `j` for sub-block `j` (as `kquant::k45_block_scales`: exact products).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn k45_scales(blk: &[u8]) -> (__m256, __m256) {
    let (d, dmin) = (f16_le(blk, 0), f16_le(blk, 2));
    let (scs, mins) = scales_k4(&blk[4..16]);
    // SAFETY: `scs` is 8 readable bytes; unaligned 64-bit load.
    let sv = unsafe { _mm_loadl_epi64(scs.as_ptr().cast()) };
    let sv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sv));
    (_mm256_mul_ps(_mm256_set1_ps(d), sv), neg_mins(dmin, &mins))
}

/// The quants (0..=15, or 0..=31 for Q5_K) of sub-blocks `2g` and `2g + 1` (`g < 4`) of the
/// Q4_K (`Q5 = false`) or Q5_K super-block `blk`, in element order.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn k45_quants<const Q5: bool>(blk: &[u8], g: usize) -> (__m256i, __m256i) {
    let qs_at = if Q5 { K5_QS } else { K4_QS };
    debug_assert!(g < 4 && qs_at + 32 * g + 32 <= blk.len());
    let nib = _mm256_set1_epi8(15);
    // SAFETY: `blk` is a whole super-block and `qs_at + 32g + 32 <= ` its size for `g < 4`.
    let v = unsafe { load32(blk.as_ptr().add(qs_at + 32 * g)) };
    let mut lo = _mm256_and_si256(v, nib);
    let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib);
    if Q5 {
        let five = _mm256_set1_epi8(0x10);
        // SAFETY: `K5_QH + 32 <=` the super-block's size.
        let qh = unsafe { load32(blk.as_ptr().add(K5_QH)) };
        let (m0, m1) = (
            _mm256_set1_epi8(1 << (2 * g)),
            _mm256_set1_epi8(1 << (2 * g + 1)),
        );
        let h0 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, m0), m0);
        let h1 = _mm256_cmpeq_epi8(_mm256_and_si256(qh, m1), m1);
        lo = _mm256_or_si256(lo, _mm256_and_si256(h0, five));
        hi = _mm256_or_si256(hi, _mm256_and_si256(h1, five));
    }
    (lo, hi)
}

/// The quants `q` (0..=63; the weight is `q − 32`) of 32-element block `j < 8` of the Q6_K
/// super-block `blk`, in element order: `ql` nibbles with 2-bit `qh` fields on top.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn k6_quants(blk: &[u8], j: usize) -> __m256i {
    let (n, g) = (j / 4, j % 4);
    debug_assert!(j < 8 && K6_SC <= blk.len());
    let p = blk.as_ptr();
    // SAFETY: `64n + 32(g % 2) + 32 <= K6_QH` and `K6_QH + 32n + 32 <= K6_SC`: inside the
    // super-block.
    let (ql, qh) = unsafe {
        (
            load32(p.add(64 * n + 32 * (g % 2))),
            load32(p.add(K6_QH + 32 * n)),
        )
    };
    let nib = _mm256_set1_epi8(15);
    let low = if g < 2 {
        _mm256_and_si256(ql, nib)
    } else {
        _mm256_and_si256(_mm256_srli_epi16::<4>(ql), nib)
    };
    let high = match g {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)))
}

/// The scales of the two 16-element halves of Q6_K block `j` of the super-block `blk`.
#[inline]
pub(super) fn k6_scales(blk: &[u8], j: usize) -> (i8, i8) {
    (blk[K6_SC + 2 * j] as i8, blk[K6_SC + 2 * j + 1] as i8)
}

/// Q4_K (`Q5 = false`) or Q5_K tile of rows `r0..r0 + R` × the tokens of `tok`: the
/// nibble tile of the 32-element formats with each sub-block as a Q4_1 / Q5_1 block (see
/// `kquant::dot`): per super-block the offset terms, then per (row, token) the eight
/// sub-blocks' integer dots reduced to whole-block sums in registers before one convert and
/// FMA.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_k45<const R: usize, const T: usize, const Q5: bool>(
    m: &QMatrix,
    r0: usize,
    tok: &Tokens<'_, T>,
    out: OutPtr,
) {
    let rows = SuperRows::<R>::new(m, r0);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for s in 0..m.cols / QK_K {
        let b0 = 8 * s;
        // Per (row, token): `dw_j · dx` of the eight sub-blocks.
        let mut sc = [[[0f32; 8]; T]; R];
        for r in 0..R {
            let (dw, mw) = k45_scales(rows.block(r, s));
            for t in 0..T {
                acc[r][t] = _mm256_fmadd_ps(mw, tok.s8(t, b0), acc[r][t]);
                let v = _mm256_mul_ps(dw, tok.xd8(t, b0));
                // SAFETY: room for 8 f32s; unaligned store.
                unsafe { _mm256_storeu_ps(sc[r][t].as_mut_ptr(), v) };
            }
        }
        for j in 0..8 {
            rows.pf.block(b0 + j);
        }
        for r in 0..R {
            let blk = rows.block(r, s);
            let mut w = [_mm256_setzero_si256(); 8];
            for g in 0..4 {
                (w[2 * g], w[2 * g + 1]) = k45_quants::<Q5>(blk, g);
            }
            for t in 0..T {
                let mut l = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    l[j] = dot_avx2(w[j], tok.xq32(t, b0 + j));
                }
                let l = _mm256_cvtepi32_ps(block_sums(&l));
                // SAFETY: `sc[r][t]` is 8 readable f32s; unaligned load.
                let v = unsafe { _mm256_loadu_ps(sc[r][t].as_ptr()) };
                acc[r][t] = _mm256_fmadd_ps(l, v, acc[r][t]);
            }
        }
    }
    finish(&acc, m.rows, r0, tok.t0, out);
}

/// Q6_K tile of rows `r0..r0 + R` × the `T` tokens of `x` (`N` registers per row) at width
/// `W`: per row the eight blocks' quants and scales of a super-block are unpacked once, then
/// per register the blocks' integer dots (the signed `q − 32` as `maddubs(q, x) − maddubs(32,
/// x)`, the 16-element scales in the `madd` step) are reduced to whole-block sums before one
/// convert and FMA.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
pub(super) fn tile_k6<W: Width, const R: usize, const T: usize, const N: usize>(
    w: W,
    m: &QMatrix,
    r0: usize,
    x: &W::View<'_, N>,
    out: OutPtr,
) {
    let rows = SuperRows::<R>::new(m, r0);
    let mut acc = [[w.zero(); N]; R];
    let mut dd = [[W::NO_SCALES; N]; R];
    for s in 0..m.cols / QK_K {
        let b0 = 8 * s;
        for r in 0..R {
            // SAFETY: a `Width` value proves AVX2, FMA and F16C (the trait's contract).
            let d = unsafe { f16_le(rows.block(r, s), K6_D) };
            w.scales(d, x, b0, &mut dd[r]);
        }
        for j in 0..8 {
            rows.pf.block(b0 + j);
        }
        for r in 0..R {
            let blk = rows.block(r, s);
            let mut q = [w.set16(0); 8];
            let mut scv = [w.set16(0); 8];
            for j in 0..8 {
                q[j] = w.quants6(blk, j);
                let (sa, sb) = k6_scales(blk, j);
                scv[j] = w.half_scales(sa.into(), sb.into());
            }
            for n in 0..N {
                let mut l = [w.set16(0); 8];
                for j in 0..8 {
                    let xv = w.xq(x, n, b0 + j);
                    l[j] = w.dot_minus32(q[j], xv, w.times32(xv), scv[j]);
                }
                let l = w.cvt(w.block_sums(&l));
                acc[r][n] = w.fma(l, w.load_scales(&dd[r][n]), acc[r][n]);
            }
        }
    }
    w.finish::<R, T, N>(&acc, m.rows, r0, x, out);
}

/// The i16 scale vector of a 32-element block made of two 16-element sub-blocks: `a` for the
/// first eight `maddubs` pairs, `b` for the last eight.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn pair_scales(a: i16, b: i16) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a))
}

/// Q2_K (`Q3 = false`) or Q3_K tile: 2-bit quants from `qs` (plus Q3_K's `hmask` bit), two
/// 16-element sub-blocks per 32-element block.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile_k23<const R: usize, const T: usize, const Q3: bool>(
    m: &QMatrix,
    r0: usize,
    tok: &Tokens<'_, T>,
    out: OutPtr,
) {
    let rows = SuperRows::<R>::new(m, r0);
    let qs_at = if Q3 { K3_QS } else { K2_QS };
    let (three, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    // `d · dx` and (Q2_K) `−dmin · dx` per row, token and block.
    let mut dd = [[[0f32; 8]; T]; R];
    let mut dm = [[[0f32; 8]; T]; R];
    for s in 0..m.cols / QK_K {
        let b0 = 8 * s;
        // Per row and sub-block: the scale (Q3_K: signed) and, for Q2_K, the minimum.
        let mut sc = [[0i16; 16]; R];
        let mut mn = [[0u8; 16]; R];
        for r in 0..R {
            let blk = rows.block(r, s);
            if Q3 {
                let k3 = scales_k3(&blk[K3_SC..K3_SC + 12]);
                for (o, &v) in sc[r].iter_mut().zip(&k3) {
                    *o = v.into();
                }
                block_scales::<T>(f16_le(blk, K3_D), tok, b0, &mut dd[r]);
            } else {
                for i in 0..16 {
                    sc[r][i] = (blk[i] & 15).into();
                    mn[r][i] = blk[i] >> 4;
                }
                block_scales::<T>(f16_le(blk, K2_D), tok, b0, &mut dd[r]);
                block_scales::<T>(-f16_le(blk, K2_D + 2), tok, b0, &mut dm[r]);
            }
        }
        // Keep the scales in memory so that they are broadcast by loads.
        std::hint::black_box(&mut dd);
        std::hint::black_box(&mut dm);
        for n in 0..2 {
            let mut qv = [_mm256_setzero_si256(); R];
            let mut hm = [_mm256_setzero_si256(); R];
            for r in 0..R {
                let p = rows.block(r, s).as_ptr();
                // SAFETY: `qs_at + 64 <= bb` and `32 <= bb`: inside the super-block.
                qv[r] = unsafe { load32(p.add(qs_at + 32 * n)) };
                if Q3 {
                    // SAFETY: as above.
                    hm[r] = unsafe { load32(p) };
                }
            }
            for g in 0..4 {
                let j = 4 * n + g;
                rows.pf.block(b0 + j);
                let mut w = [(_mm256_setzero_si256(), _mm256_setzero_si256()); R];
                let mut scv = [_mm256_setzero_si256(); R];
                let mut mv = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let sh = _mm_cvtsi32_si128(2 * g as i32);
                    let q = _mm256_and_si256(_mm256_srl_epi16(qv[r], sh), three);
                    w[r] = if Q3 {
                        let bit = _mm256_set1_epi8(1 << j);
                        let h = _mm256_cmpeq_epi8(_mm256_and_si256(hm[r], bit), bit);
                        let v =
                            _mm256_sub_epi8(_mm256_or_si256(q, _mm256_and_si256(h, four)), four);
                        (_mm256_abs_epi8(v), v)
                    } else {
                        (q, q)
                    };
                    scv[r] = pair_scales(sc[r][2 * j], sc[r][2 * j + 1]);
                    if !Q3 {
                        let (ma, mb) = (mn[r][2 * j] as i8, mn[r][2 * j + 1] as i8);
                        mv[r] = _mm256_set_m128i(_mm_set1_epi8(mb), _mm_set1_epi8(ma));
                    }
                }
                for t in 0..T {
                    let x = tok.xq32(t, b0 + j);
                    for r in 0..R {
                        let p = if Q3 {
                            _mm256_maddubs_epi16(w[r].0, _mm256_sign_epi8(x, w[r].1))
                        } else {
                            _mm256_maddubs_epi16(w[r].0, x)
                        };
                        let l = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, scv[r]));
                        let f = _mm256_broadcast_ss(&dd[r][t][j]);
                        acc[r][t] = _mm256_fmadd_ps(l, f, acc[r][t]);
                        if !Q3 {
                            let ms = _mm256_madd_epi16(
                                _mm256_maddubs_epi16(mv[r], x),
                                _mm256_set1_epi16(1),
                            );
                            let f = _mm256_broadcast_ss(&dm[r][t][j]);
                            acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ms), f, acc[r][t]);
                        }
                    }
                }
            }
        }
    }
    finish(&acc, m.rows, r0, tok.t0, out);
}
