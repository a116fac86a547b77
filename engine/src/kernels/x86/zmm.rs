//! 512-bit token-pair tiles for the VNNI backend (batched decode, prefill).
//!
//! A `zmm` accumulator holds two tokens' eight lanes interleaved: lane `2k` is lane `k` of
//! token `t`, lane `2k + 1` lane `k` of token `t + 1`. Each lane sees exactly the float
//! operations of the 256-bit kernels (and of `scalar.rs`), in the same order, so results stay
//! bit-identical; only the instruction count changes. Activations of a token pair come
//! interleaved per 4-byte group from [`Activations`] (built once per batch, not per tile),
//! weights have each 4-byte group duplicated (`vpermd`). Halving the instructions per
//! (row, token, block) roughly doubles the throughput of the 4×4 256-bit tile on Zen 4, whose
//! front end / vector pipes are the limit.
//!
//! Every tile here keeps each block's integer lanes (a `vpdpbusd`, or Q6_K's `maddubs`/`madd`
//! steps) and reduces eight blocks at once to whole-block sums (`reduce::block_sums`) before
//! one convert and FMA per (row, pair) and eight blocks; the activations are plain loads. So
//! tiles wide in tokens (2 rows × 16 tokens for batches of 16) spend the fewest ops per
//! product. The 32-element block formats (and Q4_K in prefill) go through `lanes.rs` on whole
//! groups of 16 rows; their tile here takes the leftover rows.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::{Activations, Cells, OutPtr, QMatrix, WeightType};
mod kquant;
pub(in crate::kernels) mod lanes;
pub(in crate::kernels) mod one;
mod reduce;

use super::{expand_qh, finish, offset_weights, packed_rows, row_tiles, unpack_q4, Prefetch, QK};

/// Converts the f16 scales of blocks `b..min(b + 8, nb)` of `bytes` (little-endian f16s),
/// zero past `nb`, with one masked load (the tail of a row otherwise costs a memcpy call per
/// row and chunk, a lot for 18-block rows).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl")]
#[inline]
fn load_f16x8_masked(bytes: &[u8], b: usize, nb: usize) -> __m256 {
    let n = (nb - b).min(8);
    assert!(2 * (b + n) <= bytes.len());
    let mask = ((1u32 << n) - 1) as __mmask8;
    // SAFETY: the `n` selected f16s lie inside `bytes` (checked above); masked-off lanes are
    // not accessed.
    let v = unsafe { _mm_maskz_loadu_epi16(mask, bytes.as_ptr().add(2 * b).cast()) };
    _mm256_cvtph_ps(v)
}

/// Lane `i` of the result comes from lane `i / 2` (duplicates each 32-bit lane of a 256-bit
/// value).
#[target_feature(enable = "avx512f")]
#[inline]
fn dup_idx() -> __m512i {
    _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7)
}

#[target_feature(enable = "avx512f")]
#[inline]
fn dup_ps(a: __m256) -> __m512 {
    _mm512_permutexvar_ps(dup_idx(), _mm512_castps256_ps512(a))
}

#[target_feature(enable = "avx512f")]
#[inline]
fn dup_epi32(a: __m256i) -> __m512i {
    _mm512_permutexvar_epi32(dup_idx(), _mm512_castsi256_si512(a))
}

/// Splits interleaved accumulators back into per-token 256-bit ones and writes the tile.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
#[inline]
fn finish_pairs<const R: usize, const T: usize, const TP: usize>(
    acc: &[[__m512; TP]; R],
    rows: usize,
    r0: usize,
    t0: usize,
    out: OutPtr,
) {
    let deint = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    let mut ys = [[_mm256_setzero_ps(); T]; R];
    for r in 0..R {
        for p in 0..TP {
            let v = _mm512_permutexvar_ps(deint, acc[r][p]);
            ys[r][2 * p] = _mm512_castps512_ps256(v);
            ys[r][2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        }
    }
    finish(&ys, rows, r0, t0, out);
}

/// Writes the tile: the joint reduction of [`reduce`] where the shape allows, else per token.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
#[inline]
fn finish_tile<const R: usize, const T: usize, const TP: usize>(
    acc: &[[__m512; TP]; R],
    rows: usize,
    r0: usize,
    t0: usize,
    out: OutPtr,
) {
    if (R == 2 || R == 4) && (R * TP).is_multiple_of(8) {
        reduce::finish::<R, TP>(acc, rows, r0, t0, out);
    } else {
        finish_pairs::<R, T, TP>(acc, rows, r0, t0, out);
    }
}

/// Validated views of the interleaved token pairs `t0 / 2 .. t0 / 2 + TP` (see
/// [`Activations`]'s `pairs`), shared by all row tiles.
pub(super) struct PairView<'a, const TP: usize> {
    t0: usize,
    /// Per pair, `64 · nb` bytes: the signed activations and the same `+ 128` (for Q8_0).
    q: [*const u8; TP],
    qu: [*const u8; TP],
    /// Per pair, `2 · nb8` f32s: `(d_t, d_{t+1})` and `(s_t, s_{t+1})` per block.
    d: [&'a [f32]; TP],
    s: [&'a [f32]; TP],
}

impl<'a, const TP: usize> PairView<'a, TP> {
    fn new(m: &QMatrix, x: &'a Activations, t0: usize) -> Self {
        let (nb, nb8) = (m.nb, x.nb8);
        assert!(t0.is_multiple_of(2) && t0 / 2 + TP <= x.pairs.n && x.nb == nb);
        let mut v = PairView {
            t0,
            q: [std::ptr::null(); TP],
            qu: [std::ptr::null(); TP],
            d: [&[]; TP],
            s: [&[]; TP],
        };
        for i in 0..TP {
            let p = t0 / 2 + i;
            let (q, qu) = (&x.pairs.q[p * nb * 64..], &x.pairs.qu[p * nb * 64..]);
            assert!(q.len() >= 2 * QK * nb && qu.len() >= 2 * QK * nb);
            v.q[i] = q.as_ptr();
            v.qu[i] = qu.as_ptr();
            v.d[i] = &x.pairs.d[p * 2 * nb8..(p + 1) * 2 * nb8];
            v.s[i] = &x.pairs.s[p * 2 * nb8..(p + 1) * 2 * nb8];
        }
        v
    }

    /// The interleaved activations of pair `i`, block `b < nb`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn xq(&self, i: usize, b: usize) -> __m512i {
        // SAFETY: `b < nb` and pair rows hold `64 · nb` bytes (checked in `new`); unaligned.
        unsafe { _mm512_loadu_si512(self.q[i].add(64 * b).cast()) }
    }

    /// As [`PairView::xq`], plus 128 (as u8).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn xu(&self, i: usize, b: usize) -> __m512i {
        // SAFETY: as in `xq`.
        unsafe { _mm512_loadu_si512(self.qu[i].add(64 * b).cast()) }
    }

    /// `(d_t, d_{t+1})` of pair `i`, blocks `b0..b0 + 8` (zero past `nb`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn d16(&self, i: usize, b0: usize) -> __m512 {
        let d = &self.d[i][2 * b0..2 * b0 + 16];
        // SAFETY: `d` is 16 readable f32s; unaligned load.
        unsafe { _mm512_loadu_ps(d.as_ptr()) }
    }

    /// `(s_t, s_{t+1})` of pair `i`, blocks `b0..b0 + 8` (zero past `nb`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn s16(&self, i: usize, b0: usize) -> __m512 {
        let s = &self.s[i][2 * b0..2 * b0 + 16];
        // SAFETY: `s` is 16 readable f32s; unaligned load.
        unsafe { _mm512_loadu_ps(s.as_ptr()) }
    }
}

/// Stores the per-(row, token pair) scales `(dw·dx_t, dw·dx_{t+1})` of blocks `b0..b0 + 8`.
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
#[inline]
fn chunk_scales<const TP: usize>(
    dw: __m512,
    x: &PairView<'_, TP>,
    b0: usize,
    sc: &mut [[f32; 16]; TP],
) {
    for (p, sc) in sc.iter_mut().enumerate() {
        // SAFETY: room for 16 f32s; unaligned store.
        unsafe { _mm512_storeu_ps(sc.as_mut_ptr(), _mm512_mul_ps(dw, x.d16(p, b0))) };
    }
}

/// Q4_0 / Q4_1 / Q5_0 / Q5_1 (`Q8 = false`) or Q8_0 tile of rows `r0..r0 + R` × the
/// `T = 2·TP` tokens of `x`. Q8_0 uses the offset trick of `q8_dot_vnni`: `(x + 128) × w −
/// 128 · Σw`, exact in i32.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
fn tile_q<const R: usize, const T: usize, const TP: usize, const Q8: bool>(
    m: &QMatrix,
    r0: usize,
    x: &PairView<'_, TP>,
    out: OutPtr,
) {
    assert_eq!(T, 2 * TP);
    let (rows, qs) = packed_rows::<R>(m, r0);
    let nb = m.nb;
    let pf = Prefetch::new::<R>(m, r0, rows[0].d.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); TP]; R];
    let mut sc = [[[0f32; 16]; TP]; R];
    let zero = _mm512_setzero_si512();
    let m128 = _mm512_set1_epi8(-128);
    let mut b0 = 0;
    while b0 < nb {
        for r in 0..R {
            let d = load_f16x8_masked(rows[r].d, b0, nb);
            if !Q8 {
                let mw = offset_weights(&rows[r], || d, |mb| load_f16x8_masked(mb, b0, nb));
                let mw = dup_ps(mw);
                #[allow(clippy::needless_range_loop)]
                for p in 0..TP {
                    acc[r][p] = _mm512_fmadd_ps(mw, x.s16(p, b0), acc[r][p]);
                }
            }
            chunk_scales::<TP>(dup_ps(d), x, b0, &mut sc[r]);
        }
        // Per (row, pair), the per-lane partial dots of each block of the chunk.
        let mut l = [[[zero; 8]; TP]; R];
        #[allow(clippy::needless_range_loop)]
        for j in 0..(nb - b0).min(8) {
            let b = b0 + j;
            pf.block(b);
            // Per row: the weights and the i32 start of the dot (Q8_0's correction).
            let mut w = [(zero, zero); R];
            for r in 0..R {
                w[r] = if Q8 {
                    // SAFETY: `b < nb` and each row's qs holds `32 · nb` bytes (checked in
                    // `packed_rows`); unaligned load.
                    let v = unsafe { _mm256_loadu_si256(qs[r].add(32 * b).cast()) };
                    let v = dup_epi32(v);
                    (
                        v,
                        _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, m128, v)),
                    )
                } else {
                    // SAFETY: `b < nb` and each row's qs holds `16 · nb` bytes (checked in
                    // `packed_rows`).
                    let mut q = unsafe { unpack_q4(qs[r].add(16 * b)) };
                    if let Some(qh) = rows[r].qh {
                        q = _mm256_or_si256(q, expand_qh(qh, b));
                    }
                    (dup_epi32(q), zero)
                };
            }
            for p in 0..TP {
                // The unsigned operand of `vpdpbusd`: Q8_0's activations plus 128, else the
                // nibbles.
                let xv = if Q8 { x.xu(p, b) } else { x.xq(p, b) };
                for r in 0..R {
                    l[r][p][j] = if Q8 {
                        _mm512_dpbusd_epi32(w[r].1, xv, w[r].0)
                    } else {
                        _mm512_dpbusd_epi32(w[r].1, w[r].0, xv)
                    };
                }
            }
        }
        // Lanes 2j, 2j + 1: block b0 + j's whole dots (zero past `nb`, where the scales are
        // zero too).
        for r in 0..R {
            for p in 0..TP {
                let l = _mm512_cvtepi32_ps(reduce::block_sums(&l[r][p]));
                // SAFETY: `sc[r][p]` is 16 readable f32s; unaligned load.
                let s = unsafe { _mm512_loadu_ps(sc[r][p].as_ptr()) };
                acc[r][p] = _mm512_fmadd_ps(l, s, acc[r][p]);
            }
        }
        b0 += 8;
    }
    finish_tile::<R, T, TP>(&acc, m.rows, r0, x.t0, out);
}

/// Rows `r0..r0 + R` × the `T = 2·TP` tokens of `x`, by weight type (quantized matrices).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
#[inline]
fn tile<const R: usize, const T: usize, const TP: usize>(
    m: &QMatrix,
    r0: usize,
    x: &PairView<'_, TP>,
    out: OutPtr,
) {
    match m.ty {
        WeightType::Q8_0 => tile_q::<R, T, TP, true>(m, r0, x, out),
        t if t.is_k() => kquant::tile::<R, T, TP>(m, r0, x, out),
        _ => tile_q::<R, T, TP, false>(m, r0, x, out),
    }
}

/// Rows `rows` × tokens `t0..t0 + T` (`T = 2·TP`, `t0` even), R rows at a time, then one at
/// a time.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
fn tiles<const R: usize, const T: usize, const TP: usize>(
    m: &QMatrix,
    x: &Activations,
    t0: usize,
    rows: Range<usize>,
    out: OutPtr,
) {
    let x = PairView::<TP>::new(m, x, t0);
    row_tiles::<R>(rows, |r, whole| {
        if whole {
            tile::<R, T, TP>(m, r, &x, out)
        } else {
            tile::<1, T, TP>(m, r, &x, out)
        }
    });
}

/// Computes `c` (4, 8 or 16 tokens from an even one) of a quantized matrix.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(in crate::kernels) fn block(m: &QMatrix, x: &Activations, out: OutPtr, c: Cells) {
    assert!(m.ty.is_quantized());
    let t0 = c.tokens.start;
    match c.tokens.len() {
        16 => tiles::<2, 16, 8>(m, x, t0, c.rows, out),
        8 => tiles::<4, 8, 4>(m, x, t0, c.rows, out),
        nt => {
            assert_eq!(nt, 4);
            tiles::<4, 4, 2>(m, x, t0, c.rows, out);
        }
    }
}
