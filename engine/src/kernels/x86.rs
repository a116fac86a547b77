//! x86-64 backends: AVX2 (+FMA, F16C) and AVX512-VNNI (256-bit `vpdpbusd`). Both are stamped out
//! from one macro and differ only in the 32-byte `u8 × i8 → 8 × i32` dot steps (Q8_0 uses the
//! sign trick with AVX2 and an exact +128 offset with VNNI) and in the row tile height; the
//! integer lane sums are exact and the float work follows the order defined in `scalar.rs`, so
//! all backends agree bit for bit.
//!
//! Register micro-kernels compute an R-rows × T-tokens tile: each weight block is loaded and
//! unpacked once per tile and used for all T tokens (from L1), and each activation block is used
//! for all R rows. Per 8-block chunk the scales `dw · dx` of every (row, token) pair are computed
//! with one vector multiply, and each pair's eight block dots are reduced in registers.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Activations, OutPtr, PackedRow, QMatrix, QK};

mod kquant;
pub(super) mod peak;
pub(super) mod quant;
mod width;
pub(super) mod zmm;

/// The AVX2 integer dot: `maddubs` (u8 × i8 → pairs of i16; at most 2·255·127 never happens
/// here: Q4 nibbles are <= 15 and Q8 uses |w| <= 128 against |x| <= 127, so no saturation) then
/// `madd` with ones → lane k = Σ of bytes 4k..4k+3 of the products.
#[target_feature(enable = "avx2")]
#[inline]
fn dot_avx2(a: __m256i, b: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
}

/// The VNNI integer dot: lane k = Σ of the u8 × i8 products of bytes 4k..4k+3 (no saturation).
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
fn dot_vnni(a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b)
}

/// Converts 8 f16 scales starting at block `b` of `bytes` (little-endian f16s), zero-padding
/// blocks at or past `nb`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn load_f16x8(bytes: &[u8], b: usize, nb: usize) -> __m256 {
    let mut tmp = [0u8; 16];
    let src = if b + 8 <= nb {
        &bytes[2 * b..2 * b + 16]
    } else {
        let n = 2 * (nb - b);
        tmp[..n].copy_from_slice(&bytes[2 * b..2 * nb]);
        &tmp[..]
    };
    // SAFETY: `src` is exactly 16 readable bytes; the load is unaligned.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast())) }
}

/// `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`, as `scalar::hsum`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let h = _mm256_hadd_ps(v, v);
    let h = _mm256_hadd_ps(h, h);
    _mm_cvtss_f32(_mm_add_ss(
        _mm256_castps256_ps128(h),
        _mm256_extractf128_ps::<1>(h),
    ))
}

/// `[hsum(a), hsum(b), hsum(c), hsum(d)]` with the same order of additions as [`hsum`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> [f32; 4] {
    let q = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    let s = _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps::<1>(q));
    let mut v = [0f32; 4];
    // SAFETY: `v` has room for 4 f32s; unaligned store.
    unsafe { _mm_storeu_ps(v.as_mut_ptr(), s) };
    v
}

/// Lane `j` of the result is the sum of the eight lanes of `l[j]`: the whole-block integer dots
/// of eight blocks, one block per lane, from their per-lane partial sums (exact, so the order of
/// the additions does not matter).
#[target_feature(enable = "avx2")]
#[inline]
fn block_sums(l: &[__m256i; 8]) -> __m256i {
    let a = _mm256_hadd_epi32(_mm256_hadd_epi32(l[0], l[1]), _mm256_hadd_epi32(l[2], l[3]));
    let b = _mm256_hadd_epi32(_mm256_hadd_epi32(l[4], l[5]), _mm256_hadd_epi32(l[6], l[7]));
    // a = [l0..l3 over lanes 0..4 | l0..l3 over lanes 4..8], b likewise for l4..l7.
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(a, b),
        _mm256_permute2x128_si256::<0x31>(a, b),
    )
}

/// Reduces and writes the accumulators of rows `r0..r0 + R` × tokens `t0..t0 + T`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn finish<const R: usize, const T: usize>(
    acc: &[[__m256; T]; R],
    rows: usize,
    r0: usize,
    t0: usize,
    out: OutPtr,
) {
    if R == 4 {
        // Four rows of one token are contiguous in `out`: one reduction, one store.
        #[allow(clippy::needless_range_loop)]
        for t in 0..T {
            let v = hsum4(acc[0][t], acc[1][t], acc[2][t], acc[3][t]);
            out.write4((t0 + t) * rows + r0, v);
        }
    } else if T.is_multiple_of(4) {
        for (r, a) in acc.iter().enumerate() {
            for c in (0..T).step_by(4) {
                let v = hsum4(a[c], a[c + 1], a[c + 2], a[c + 3]);
                for (t, v) in v.into_iter().enumerate() {
                    out.write((t0 + c + t) * rows + r0 + r, v);
                }
            }
        }
    } else {
        for (r, a) in acc.iter().enumerate() {
            for (t, &a) in a.iter().enumerate() {
                out.write((t0 + t) * rows + r0 + r, hsum(a));
            }
        }
    }
}

/// Unpacks the 16 `qs` bytes at `p` to 32 nibbles in element order (low nibbles then high).
///
/// # Safety
/// `p` must point to 16 readable bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_q4(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at `p`; the load is unaligned.
    let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(p.cast()) });
    let shifted = _mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4));
    _mm256_and_si256(shifted, _mm256_set1_epi8(15))
}

/// The fifth bits of block `b` of a Q5 row (`qh`: little-endian u32 masks, bit `i` for
/// element `i`) as `0x10` in each byte of the 32 (element order) whose bit is set.
#[target_feature(enable = "avx2")]
#[inline]
fn expand_qh(qh: &[u8], b: usize) -> __m256i {
    let h: [u8; 4] = qh[4 * b..4 * b + 4].try_into().expect("4 bytes");
    let v = _mm256_set1_epi32(i32::from_le_bytes(h));
    // Byte i takes byte i / 8 of the mask (each 128-bit lane holds the whole mask).
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let v = _mm256_shuffle_epi8(v, spread);
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// IQ4_NL's 16 table values in both 128-bit lanes, for `pshufb` lookups.
#[target_feature(enable = "avx2")]
#[inline]
fn iq4nl_table() -> __m256i {
    let t = super::scalar::IQ4NL_VALUES;
    // SAFETY: `t` is 16 readable bytes; unaligned load.
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(t.as_ptr().cast()) })
}

/// How far ahead of the weights being multiplied the tiles prefetch, in bytes. Decode streams
/// every weight from memory once per step, and the hardware prefetchers alone keep too few
/// misses in flight (this took batch-1 Q4_1 from ~27 to ~80 GF/s on a Zen 4 core; 4–8 KiB are
/// best there, more starts to evict data still in use).
const PREFETCH_DIST: usize = 4096;

/// Software prefetch of a tile's weight stream.
#[derive(Clone, Copy)]
struct Prefetch {
    base: *const u8,
    /// Bytes of the tile consumed per block, and bytes from `base` to the end of the matrix.
    step: usize,
    rem: usize,
    dist: usize,
}

impl Prefetch {
    fn new<const R: usize>(m: &QMatrix, r0: usize, base: *const u8) -> Self {
        Prefetch {
            base,
            step: R * m.row_bytes / m.nb,
            rem: (m.rows - r0) * m.row_bytes,
            dist: PREFETCH_DIST,
        }
    }

    /// Prefetches the bytes `dist` ahead of those that block `b` of the tile consumes (the
    /// tile's rows are contiguous, so a tile consumes `step` bytes per block on average).
    #[inline(always)]
    fn block(self, b: usize) {
        let mut o = b * self.step + self.dist;
        let end = (o + self.step).min(self.rem);
        while o < end {
            // SAFETY: `o < rem`, so the address is inside the matrix; prefetches never fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.base.add(o).cast()) };
            o += 64;
        }
    }
}

/// The 32-element block formats of the tiles (the `F` of `tile_q`): unsigned nibbles with an
/// offset term (Q4_0 / Q4_1 / Q5_0 / Q5_1), signed bytes (Q8_0), nibbles that index a table of
/// signed values (IQ4_NL).
const NIBBLES: u8 = 0;
const BYTES: u8 = 1;
const TABLE: u8 = 2;

/// The weights of the offset term of blocks `b0..b0 + 8` of a Q4/Q5 row: Q4_1 / Q5_1 store
/// them (`load` reads them from the `m` bytes); Q4_0 / Q5_0 have `d · −8` / `d · −16` (their
/// quants are stored plus 8 / 16), with the block scales `d` computed only then.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn offset_weights(
    row: &PackedRow<'_>,
    d: impl FnOnce() -> __m256,
    load: impl FnOnce(&[u8]) -> __m256,
) -> __m256 {
    match row.m {
        Some(mb) => load(mb),
        None => {
            let zero = if row.qh.is_some() { -16.0 } else { -8.0 };
            _mm256_mul_ps(d(), _mm256_set1_ps(zero))
        }
    }
}

/// Calls `tile(r, true)` for each whole group of `R` rows `r..r + R` of `rows`, then
/// `tile(r, false)` for each row left over.
#[inline(always)]
fn row_tiles<const R: usize>(rows: Range<usize>, mut tile: impl FnMut(usize, bool)) {
    let mut r = rows.start;
    while r + R <= rows.end {
        tile(r, true);
        r += R;
    }
    while r < rows.end {
        tile(r, false);
        r += 1;
    }
}

macro_rules! backend {
    ($name:ident, $feat:literal, $rt:literal, $dot:ident, $q8prep:ident, $q8dot:ident) => {
        pub(super) mod $name {
            use std::arch::x86_64::*;
            use std::ops::Range;

            use super::super::{Activations, Cells, OutPtr, QMatrix, WeightType};
            use super::{
                block_sums, chunk_scales, expand_qh, finish, iq4nl_table, kquant, load_f16x8,
                offset_weights, packed_rows, row_tiles, unpack_q4, Prefetch, Tokens, BYTES,
                NIBBLES, TABLE,
            };
            use super::{$dot, $q8dot, $q8prep};

            /// Tile of rows `r0..r0 + R` × the tokens of `tok` of a 32-element block format:
            /// `F` is [`NIBBLES`] (Q4_0 / Q4_1 / Q5_0 / Q5_1: unsigned quants and an offset
            /// term), [`BYTES`] (Q8_0) or [`TABLE`] (IQ4_NL: Q8_0's dot on weights looked up
            /// from the nibbles, `pshufb` on the 16-entry table).
            #[target_feature(enable = $feat)]
            fn tile_q<const R: usize, const T: usize, const F: u8>(
                m: &QMatrix,
                r0: usize,
                tok: &Tokens<'_, T>,
                out: OutPtr,
            ) {
                let (rows, qs) = packed_rows::<R>(m, r0);
                let nb = m.nb;
                let pf = Prefetch::new::<R>(m, r0, rows[0].d.as_ptr());
                let table = iq4nl_table();
                let mut acc = [[_mm256_setzero_ps(); T]; R];
                let mut b0 = 0;
                while b0 < nb {
                    if F == NIBBLES {
                        // The offset term, lane k for block b0 + k.
                        for r in 0..R {
                            let mw = offset_weights(
                                &rows[r],
                                || load_f16x8(rows[r].d, b0, nb),
                                |mb| load_f16x8(mb, b0, nb),
                            );
                            for t in 0..T {
                                acc[r][t] = _mm256_fmadd_ps(mw, tok.s8(t, b0), acc[r][t]);
                            }
                        }
                    }
                    let sc = chunk_scales(&rows, tok, b0, nb);
                    let nj = (nb - b0).min(8);
                    for j in 0..nj {
                        pf.block(b0 + j);
                    }
                    // Row by row, then token by token: the eight partial-dot vectors of one
                    // (row, token) pair stay in registers (all R × T × 8 of them spilled to the
                    // stack on AVX2's 16 registers); the row's unpacked blocks sit in L1.
                    for r in 0..R {
                        let mut w = [(_mm256_setzero_si256(), _mm256_setzero_si256()); 8];
                        for (j, w) in w.iter_mut().enumerate().take(nj) {
                            let b = b0 + j;
                            *w = if F == BYTES {
                                // SAFETY: `b < nb` and each row's qs holds `32 · nb` bytes
                                // (checked in `packed_rows`); unaligned load.
                                $q8prep(unsafe { _mm256_loadu_si256(qs[r].add(32 * b).cast()) })
                            } else {
                                // SAFETY: `b < nb` and each row's qs holds `16 · nb` bytes
                                // (checked in `packed_rows`).
                                let q = unsafe { unpack_q4(qs[r].add(16 * b)) };
                                if F == TABLE {
                                    $q8prep(_mm256_shuffle_epi8(table, q))
                                } else if let Some(qh) = rows[r].qh {
                                    let q = _mm256_or_si256(q, expand_qh(qh, b));
                                    (q, q)
                                } else {
                                    (q, q)
                                }
                            };
                        }
                        for t in 0..T {
                            // Lane j: block b0 + j's whole dot (zero past `nb`, where the
                            // scale is zero too).
                            let mut l = [_mm256_setzero_si256(); 8];
                            for j in 0..nj {
                                let xv = tok.xq32(t, b0 + j);
                                l[j] = if F == NIBBLES {
                                    $dot(w[j].0, xv)
                                } else {
                                    $q8dot(w[j], xv)
                                };
                            }
                            let l = _mm256_cvtepi32_ps(block_sums(&l));
                            // SAFETY: `sc[r][t]` is 8 readable f32s; unaligned load.
                            let s = unsafe { _mm256_loadu_ps(sc[r][t].as_ptr()) };
                            acc[r][t] = _mm256_fmadd_ps(l, s, acc[r][t]);
                        }
                    }
                    b0 += 8;
                }
                finish(&acc, m.rows, r0, tok.t0, out);
            }

            /// F32 tile of rows `r0..r0 + R` × the tokens of `tok`.
            #[target_feature(enable = $feat)]
            fn tile_f32<const R: usize, const T: usize>(
                m: &QMatrix,
                r0: usize,
                tok: &Tokens<'_, T>,
                out: OutPtr,
            ) {
                let mut wr = [&[][..]; R];
                for (r, w) in wr.iter_mut().enumerate() {
                    *w = m.f32_row(r0 + r);
                }
                let mut acc = [[_mm256_setzero_ps(); T]; R];
                let mut c = 0;
                while c < m.cols {
                    let mut w = [_mm256_setzero_ps(); R];
                    for r in 0..R {
                        w[r] = load_f32x8(wr[r], c);
                    }
                    for t in 0..T {
                        let xv = load_f32x8(tok.xf[t], c);
                        for r in 0..R {
                            acc[r][t] = _mm256_fmadd_ps(w[r], xv, acc[r][t]);
                        }
                    }
                    c += 8;
                }
                finish(&acc, m.rows, r0, tok.t0, out);
            }

            /// Loads `v[c..c + 8]`, zero-padded past the end.
            #[target_feature(enable = $feat)]
            fn load_f32x8(v: &[f32], c: usize) -> __m256 {
                let mut tmp = [0f32; 8];
                let src = if c + 8 <= v.len() {
                    &v[c..c + 8]
                } else {
                    tmp[..v.len() - c].copy_from_slice(&v[c..]);
                    &tmp[..]
                };
                // SAFETY: `src` is exactly 8 readable f32s; unaligned load.
                unsafe { _mm256_loadu_ps(src.as_ptr()) }
            }

            /// Rows `r0..r0 + R` × the tokens of `tok`, by weight type.
            #[target_feature(enable = $feat)]
            #[inline]
            fn tile<const R: usize, const T: usize>(
                m: &QMatrix,
                r0: usize,
                tok: &Tokens<'_, T>,
                out: OutPtr,
            ) {
                match m.ty {
                    WeightType::F32 => tile_f32::<R, T>(m, r0, tok, out),
                    WeightType::Q8_0 => tile_q::<R, T, BYTES>(m, r0, tok, out),
                    WeightType::IQ4_NL => tile_q::<R, T, TABLE>(m, r0, tok, out),
                    WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q5_0 | WeightType::Q5_1 => {
                        tile_q::<R, T, NIBBLES>(m, r0, tok, out)
                    }
                    WeightType::Q2_K
                    | WeightType::Q3_K
                    | WeightType::Q4_K
                    | WeightType::Q5_K
                    | WeightType::Q6_K => kquant::tile::<R, T>(m, r0, tok, out),
                }
            }

            /// Rows `rows` × the tokens of `tok`, R rows at a time, then one at a time.
            #[target_feature(enable = $feat)]
            fn tiles<const R: usize, const T: usize>(
                m: &QMatrix,
                tok: &Tokens<'_, T>,
                out: OutPtr,
                rows: Range<usize>,
            ) {
                row_tiles::<R>(rows, |r, whole| {
                    if whole {
                        tile::<R, T>(m, r, tok, out)
                    } else {
                        tile::<1, T>(m, r, tok, out)
                    }
                });
            }

            /// Computes `c` (1 or 4 tokens).
            #[target_feature(enable = $feat)]
            pub(in crate::kernels) fn block(m: &QMatrix, x: &Activations, out: OutPtr, c: Cells) {
                if c.tokens.len() == 4 {
                    tiles::<$rt, 4>(m, &Tokens::new(m, x, c.tokens.start), out, c.rows);
                } else {
                    for t in c.tokens {
                        tiles::<4, 1>(m, &Tokens::new(m, x, t), out, c.rows.clone());
                    }
                }
            }
        }
    };
}

backend!(
    avx2,
    "avx2,fma,f16c",
    2,
    dot_avx2,
    q8_prep_avx2,
    q8_dot_avx2
);
backend!(
    vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    4,
    dot_vnni,
    q8_prep_vnni,
    q8_dot_vnni
);

/// The rows `r0..r0 + R` of a quantized matrix and pointers to their quants, each checked to
/// hold `qs_bytes · nb` bytes (inlined: returning the arrays by value otherwise costs a memcpy
/// per tile).
#[inline(always)]
fn packed_rows<const R: usize>(m: &QMatrix, r0: usize) -> ([PackedRow<'_>; R], [*const u8; R]) {
    let mut rows = [PackedRow {
        d: &[],
        m: None,
        qh: None,
        qs: &[],
    }; R];
    let mut qs = [std::ptr::null(); R];
    for r in 0..R {
        rows[r] = m.packed_row(r0 + r);
        assert_eq!(rows[r].qs.len(), m.ty.qs_bytes() * m.nb);
        qs[r] = rows[r].qs.as_ptr();
    }
    (rows, qs)
}

/// Validated views of the activations of tokens `t0..t0 + T`, shared by all row tiles.
struct Tokens<'a, const T: usize> {
    t0: usize,
    /// Quantized rows, each checked to hold `32 · nb` values (quantized matrices only).
    xq: [*const i8; T],
    /// Block scales and `d · Σq`, `nb` rounded up to a multiple of 8 long.
    xd: [&'a [f32]; T],
    xs: [&'a [f32]; T],
    /// f32 rows (F32 matrices only).
    xf: [&'a [f32]; T],
}

impl<'a, const T: usize> Tokens<'a, T> {
    fn new(m: &QMatrix, x: &'a Activations, t0: usize) -> Self {
        let mut tok = Tokens {
            t0,
            xq: [std::ptr::null(); T],
            xd: [&[]; T],
            xs: [&[]; T],
            xf: [&[]; T],
        };
        for t in 0..T {
            if m.ty.is_quantized() {
                let q = x.q_row(t0 + t);
                assert_eq!(q.len(), QK * m.nb);
                tok.xq[t] = q.as_ptr();
                tok.xd[t] = x.d_row(t0 + t);
                tok.xs[t] = x.s_row(t0 + t);
            } else {
                tok.xf[t] = x.x_row(t0 + t);
            }
        }
        tok
    }

    /// The 32 quantized activations of token `t`, block `b < nb`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn xq32(&self, t: usize, b: usize) -> __m256i {
        // SAFETY: `b < nb` and token rows hold `32 · nb` values (checked in `new`); the load
        // is unaligned.
        unsafe { _mm256_loadu_si256(self.xq[t].add(QK * b).cast()) }
    }

    /// Activation scales of token `t`, blocks `b0..b0 + 8` (zero-padded past `nb`).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn xd8(&self, t: usize, b0: usize) -> __m256 {
        let d = &self.xd[t][b0..b0 + 8];
        // SAFETY: `d` is 8 readable f32s; unaligned load.
        unsafe { _mm256_loadu_ps(d.as_ptr()) }
    }

    /// `d · Σq` of token `t`, blocks `b0..b0 + 8` (zero-padded past `nb`).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn s8(&self, t: usize, b0: usize) -> __m256 {
        let s = &self.xs[t][b0..b0 + 8];
        // SAFETY: `s` is 8 readable f32s; unaligned load.
        unsafe { _mm256_loadu_ps(s.as_ptr()) }
    }
}

/// Per-(row, token) scales `dw · dx` of blocks `b0..b0 + 8` of a tile (zero past `nb`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn chunk_scales<const R: usize, const T: usize>(
    rows: &[PackedRow<'_>; R],
    tok: &Tokens<'_, T>,
    b0: usize,
    nb: usize,
) -> [[[f32; 8]; T]; R] {
    let mut sc = [[[0f32; 8]; T]; R];
    for (row, sc) in rows.iter().zip(sc.iter_mut()) {
        let dw = load_f16x8(row.d, b0, nb);
        for (t, sc) in sc.iter_mut().enumerate() {
            // SAFETY: `sc` has room for 8 f32s; unaligned store.
            unsafe { _mm256_storeu_ps(sc.as_mut_ptr(), _mm256_mul_ps(dw, tok.xd8(t, b0))) };
        }
    }
    sc
}

/// Q8_0 with AVX2, sign trick: `|w| × (x · sign(w))`, prepared as `(|w|, w)`.
#[target_feature(enable = "avx2")]
#[inline]
fn q8_prep_avx2(w: __m256i) -> (__m256i, __m256i) {
    (_mm256_abs_epi8(w), w)
}

#[target_feature(enable = "avx2")]
#[inline]
fn q8_dot_avx2(w: (__m256i, __m256i), x: __m256i) -> __m256i {
    dot_avx2(w.0, _mm256_sign_epi8(x, w.1))
}

/// Q8_0 with VNNI, offset trick: `(x + 128) × w − 128 · Σw` per lane, all exact in i32 (the
/// activations are in -127..=127, so `x ^ 0x80` is `x + 128` as u8). Prepared as
/// `(w, −128 · Σw per lane)`.
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
fn q8_prep_vnni(w: __m256i) -> (__m256i, __m256i) {
    let zero = _mm256_setzero_si256();
    let sum128 = _mm256_dpbusd_epi32(zero, _mm256_set1_epi8(-128), w);
    (w, _mm256_sub_epi32(zero, sum128))
}

#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
#[inline]
fn q8_dot_vnni(w: (__m256i, __m256i), x: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(w.1, _mm256_xor_si256(x, _mm256_set1_epi8(-128)), w.0)
}
