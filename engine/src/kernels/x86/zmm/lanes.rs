//! Rows in lanes: the kernel of the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
//! IQ4_NL) and of Q4_K, Q5_K and Q6_K on AVX512-VNNI, for every batch size.
//!
//! A K-quant super-block is eight 32-element blocks to this kernel: Q4_K / Q5_K sub-blocks are
//! Q4_1 / Q5_1 blocks (scale `d·sc_j`, offset `−dmin·m_j`, exact), and a Q6_K block is two
//! 16-element halves whose `Σ (q − 32)·x` are scaled in integers before its float step (see
//! `kquant.rs`). Their scales are gathered for the 16 rows per super-block and unpacked in the
//! lanes; the quants come out of the same 64-byte loads and transposes as the other formats'.
//!
//! The token-pair tiles keep one row's block in a register and put tokens in the lanes, so
//! every (row, token) pair ends each block with eight per-lane partial sums to add up before
//! the block's float work. Here a group of 16 rows is first repacked, once per matmul, so that
//! vector `j` of block `b` holds elements `4j..4j + 3` of that block for each of the 16 rows
//! (one row per 32-bit lane). A `vpdpbusd` with the token's matching 4 activations broadcast
//! then adds four products to each row, eight of them give each lane its row's whole block dot,
//! and the float work of `scalar::dot_q4` (offset FMA, scale, dot FMA of lane `b % 8`) is done
//! for 16 rows by one instruction each. Per (16 rows, block, token) that is 8 `vpdpbusd`, an
//! add, a convert, a multiply and two FMAs. The repacking is paid once per group and block for
//! all the tokens of the batch: one 64-byte load per row for four blocks' quants, 4 × 4
//! transposes of 128-bit lanes and of 32-bit elements, nibble masks, the fifth bits by a table
//! lookup, and one gather per two blocks for the scales. Q8_0 and IQ4_NL weights are stored
//! plus 128 (the unsigned operand) and `128 · Σx` per token and block is taken back off.
//! Up to 8 tokens (decode), each block's vectors are used while they are in registers
//! ([`small`]); beyond, they are stored in the group's buffer and reused per 8 tokens. Decode
//! streams the weights from memory, so the next group's rows are prefetched a few lines per
//! block, in the order the walk reads them.
//!
//! Lane `k` of the scalar reference is a separate accumulator per token here: the blocks
//! `k, k + 8, …` are taken in order, then `hsum`'s tree adds the eight accumulators, so every
//! (row, token) result is bit-identical to the other backends.

use std::arch::x86_64::*;
use std::ops::Range;

use super::super::super::kquant::{K4_QS, K5_QH, K5_QS, K6_D, K6_SC};
use super::super::super::scalar::IQ4NL_VALUES;
use super::super::super::{Activations, OutPtr, QMatrix, WeightType, QK, QK_K};

mod small;

/// Rows per group: one per 32-bit lane of a 512-bit register.
const G: usize = 16;

/// Tokens computed together (their accumulators and the block's weights stay in registers).
const T: usize = 8;

/// Whether [`rows`] computes a matrix of type `ty`, at any batch size: the 32-element formats
/// (on a Sapphire Rapids core it was faster than the tiles, under the same float semantics,
/// from one token on); Q4_K and Q5_K (their sub-blocks are Q4_1 / Q5_1 blocks) and Q6_K too.
pub(in crate::kernels) fn fits(ty: WeightType) -> bool {
    // Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q4_K, Q5_K and Q6_K.
    ty.is_quantized() && !matches!(ty, WeightType::Q2_K | WeightType::Q3_K)
}

/// One group of 16 rows, repacked: per block `b`, `w[8b + j]` lane `r` = elements `4j..4j + 3`
/// of row `r` (quants, fifth bit included), `dw[b]` / `mw[b]` lane `r` = that row's scale and
/// offset weight.
struct Group {
    w: Vec<__m512i>,
    dw: Vec<__m512>,
    mw: Vec<__m512>,
    /// Q6_K: per block, the scales of its two 16-element halves (i32 lane `r` for row `r`).
    sc: Vec<__m512i>,
}

/// The scales of one block of 16 rows, as [`walk!`] hands them over: `dw` and `mw` lane `r` =
/// row `r`'s scale and offset weight (Q6_K: `d`, no offset), and for Q6_K the two halves'
/// integer scales.
#[derive(Clone, Copy)]
struct Blk {
    dw: __m512,
    mw: __m512,
    sc: [__m512i; 2],
}

/// The next group's rows, prefetched a few lines at a time during this group's repacking and
/// arithmetic (a burst of prefetches would wait for the line fill buffers and stall the core),
/// in the order the walk reads them: the first 64 bytes of each row, then the next 64, and so
/// on (row by row, the last rows' first blocks arrived too late for long rows).
struct Fetch<'a> {
    bytes: &'a [u8],
    rows: usize,
    row_bytes: usize,
    /// Lines fetched so far (`64 · col` bytes into row `row`), and the count to reach by the
    /// end of the current plan.
    done: usize,
    row: usize,
    col: usize,
    end: usize,
    /// Progress through the plan and its increment per step, in 1/65536 lines (no division per
    /// step: at batch 1 a step is a dozen cycles).
    at: usize,
    inc: usize,
}

impl<'a> Fetch<'a> {
    /// `bytes`: whole rows of `row_bytes` each.
    fn new(bytes: &'a [u8], row_bytes: usize) -> Self {
        Fetch {
            bytes,
            rows: bytes.len() / row_bytes.max(1),
            row_bytes,
            done: 0,
            row: 0,
            col: 0,
            end: 0,
            at: 0,
            inc: 0,
        }
    }

    /// Plans to have fetched the first `1 / part` of the lines after `steps` calls of
    /// [`Fetch::step`].
    fn plan(&mut self, part: usize, steps: usize) {
        // A row spans at most `row_bytes / 64 + 2` lines.
        self.end = self.rows * (self.row_bytes / 64 + 2) / part;
        self.at = self.done << 16;
        self.inc = (self.end.saturating_sub(self.done) << 16).div_ceil(steps.max(1));
    }

    /// One step of the plan.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn step(&mut self) {
        self.at += self.inc;
        let line = (self.at >> 16).min(self.end);
        while self.done < line {
            let at = self.row * self.row_bytes + (64 * self.col).min(self.row_bytes - 1);
            // SAFETY: `row < rows`, so `at < rows · row_bytes <= bytes.len()`; prefetches never
            // fault.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.bytes.as_ptr().add(at).cast()) };
            self.done += 1;
            self.row += 1;
            if self.row == self.rows {
                self.row = 0;
                self.col += 1;
            }
        }
    }
}

/// Entry `v`: `0x10` in byte `p` for each bit `p` set in `v` (four fifth bits → their bytes).
const FIFTH: [i32; 16] = {
    let mut t = [0i32; 16];
    let mut v = 0;
    while v < 16 {
        let mut p = 0;
        while p < 4 {
            t[v] |= (((v >> p) & 1) as i32) << (8 * p + 4);
            p += 1;
        }
        v += 1;
    }
    t
};

/// Per 32-bit lane `r`, the four fifth bits `4j..4j + 3` of `qh` lane `r` as `0x10` in the byte
/// they belong to (a table lookup on the four bits).
#[target_feature(enable = "avx512f")]
#[inline]
fn fifth_bits(qh: __m512i, j: u32) -> __m512i {
    // SAFETY: 16 readable i32s; unaligned load.
    let table = unsafe { _mm512_loadu_si512(FIFTH.as_ptr().cast()) };
    let nib = _mm512_and_si512(
        _mm512_srlv_epi32(qh, _mm512_set1_epi32(4 * j as i32)),
        _mm512_set1_epi32(15),
    );
    _mm512_permutexvar_epi32(nib, table)
}

/// The 32-bit values at byte `at` of rows `r0..r0 + 16` of a quantized matrix (packed, or a
/// K-quant's ggml layout).
#[target_feature(enable = "avx512f")]
#[inline]
fn gather(m: &QMatrix, r0: usize, at: usize) -> __m512i {
    let base = m.raw_row(r0).as_ptr();
    let stride = m.row_bytes;
    assert!(at + 4 <= stride && r0 + G <= m.rows && G * stride < 1 << 31);
    let idx = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride as i32),
    );
    let idx = _mm512_add_epi32(idx, _mm512_set1_epi32(at as i32));
    // SAFETY: rows `r0..r0 + 16` are whole rows of the matrix (`stride` bytes each, contiguous
    // from `base`), and each lane reads 4 bytes at `at + 4 <= stride` into its row.
    unsafe { _mm512_i32gather_epi32::<1>(idx, base.cast()) }
}

/// Where the quants of rows `r0..r0 + 16` start. Every row has the same layout, `row_bytes`
/// apart, so only row `r0` is split into its fields (`packed_row` per row cost a fifth of a
/// decode step's repacking).
fn quant_ptrs(m: &QMatrix, r0: usize) -> [*const u8; G] {
    let bytes = m.packed_bytes();
    let at = m.packed_row(r0).qs.as_ptr() as usize - bytes.as_ptr() as usize;
    let len = m.ty.qs_bytes() * m.nb;
    // Row `r0 + r`'s quants are `bytes[at + r · row_bytes..][..len]`.
    std::array::from_fn(|r| bytes[at + r * m.row_bytes..][..len].as_ptr())
}

/// A 4 × 4 transpose of 32-bit elements in each 128-bit lane of `v`.
#[target_feature(enable = "avx512f")]
#[inline]
fn transpose4(v: [__m512i; 4]) -> [__m512i; 4] {
    let t0 = _mm512_unpacklo_epi32(v[0], v[1]);
    let t1 = _mm512_unpackhi_epi32(v[0], v[1]);
    let t2 = _mm512_unpacklo_epi32(v[2], v[3]);
    let t3 = _mm512_unpackhi_epi32(v[2], v[3]);
    [
        _mm512_unpacklo_epi64(t0, t2),
        _mm512_unpackhi_epi64(t0, t2),
        _mm512_unpacklo_epi64(t1, t3),
        _mm512_unpackhi_epi64(t1, t3),
    ]
}

/// The 16 bytes at `off` of the quants of 16 rows, as `p[j]` lane `r` = bytes `off + 4j..off +
/// 4j + 3` of row `r`.
#[target_feature(enable = "avx2,avx512f")]
#[inline]
fn quads(qs: &[*const u8; G], off: usize) -> [__m512i; 4] {
    let ld = |r: usize| {
        // SAFETY: callers pass `off + 16` inside each row's quants (`packed_rows` checked
        // their length); unaligned load.
        unsafe { _mm_loadu_si128(qs[r].add(off).cast()) }
    };
    // v[q] holds rows q, 4 + q, 8 + q, 12 + q in its 128-bit lanes, so that the transpose in
    // each 128-bit lane leaves the rows in order.
    let mut v = [_mm512_setzero_si512(); 4];
    for (q, v) in v.iter_mut().enumerate() {
        let lo = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(ld(q)), ld(4 + q));
        let hi = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(ld(8 + q)), ld(12 + q));
        *v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
    }
    transpose4(v)
}

/// As [`quads`] for the four 16-byte pieces at `off`, `off + 16`, … at once (one 64-byte load
/// per row and a transpose of 128-bit lanes instead of sixteen 16-byte loads and inserts).
#[target_feature(enable = "avx2,avx512f")]
#[inline]
fn quads4(qs: &[*const u8; G], off: usize) -> [[__m512i; 4]; 4] {
    let ld = |r: usize| {
        // SAFETY: callers pass `off + 64` inside each row's quants (`packed_rows` checked
        // their length); unaligned load.
        unsafe { _mm512_loadu_si512(qs[r].add(off).cast()) }
    };
    // v[i][q] = piece i of rows q, 4 + q, 8 + q, 12 + q (a 4 × 4 transpose of 128-bit lanes).
    let mut v = [[_mm512_setzero_si512(); 4]; 4];
    #[allow(clippy::needless_range_loop)]
    for q in 0..4 {
        let (a, b, c, d) = (ld(q), ld(4 + q), ld(8 + q), ld(12 + q));
        let t0 = _mm512_shuffle_i32x4::<0x44>(a, b);
        let t1 = _mm512_shuffle_i32x4::<0xEE>(a, b);
        let t2 = _mm512_shuffle_i32x4::<0x44>(c, d);
        let t3 = _mm512_shuffle_i32x4::<0xEE>(c, d);
        v[0][q] = _mm512_shuffle_i32x4::<0x88>(t0, t2);
        v[1][q] = _mm512_shuffle_i32x4::<0xDD>(t0, t2);
        v[2][q] = _mm512_shuffle_i32x4::<0x88>(t1, t3);
        v[3][q] = _mm512_shuffle_i32x4::<0xDD>(t1, t3);
    }
    [
        transpose4(v[0]),
        transpose4(v[1]),
        transpose4(v[2]),
        transpose4(v[3]),
    ]
}

impl Group {
    #[target_feature(enable = "avx512f")]
    /// Room for `nb` blocks (and their half scales when `k6`).
    fn new(nb: usize, k6: bool) -> Self {
        Group {
            w: vec![_mm512_setzero_si512(); 8 * nb],
            dw: vec![_mm512_setzero_ps(); nb],
            mw: vec![_mm512_setzero_ps(); nb],
            sc: vec![_mm512_setzero_si512(); if k6 { 2 * nb } else { 0 }],
        }
    }

    /// Repacks rows `r0..r0 + 16` of `m`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
    fn fill(&mut self, m: &QMatrix, r0: usize, fetch: &mut Fetch<'_>) {
        // The first half of the next group's lines while repacking.
        let k6 = m.ty == WeightType::Q6_K;
        walk!(m, r0, fetch, 2, |b, w, s| {
            self.w[8 * b..8 * b + 8].copy_from_slice(w);
            (self.dw[b], self.mw[b]) = (s.dw, s.mw);
            if k6 {
                self.sc[2 * b..2 * b + 2].copy_from_slice(&s.sc);
            }
        });
    }
}

/// The scales, offsets and fifth bits of 16 rows, read as the walk reaches each block (so that
/// their gathers overlap with the previous blocks' arithmetic).
struct Scales<'a> {
    m: &'a QMatrix,
    r0: usize,
    /// Offsets in the row of the offset weights and of the fifth bits.
    m_at: Option<usize>,
    qh_at: Option<usize>,
    /// The offset of the formats without offset weights: `-8 · d`, or `-16 · d` with the fifth
    /// bit.
    zero: f32,
}

impl<'a> Scales<'a> {
    fn new(m: &'a QMatrix, r0: usize) -> Self {
        let row = m.packed_row(r0);
        let base = row.d.as_ptr() as usize;
        Scales {
            m,
            r0,
            m_at: row.m.map(|v| v.as_ptr() as usize - base),
            qh_at: row.qh.map(|v| v.as_ptr() as usize - base),
            zero: if row.qh.is_some() { -16.0 } else { -8.0 },
        }
    }

    /// `(dw, mw)` of blocks `b` and `b + 1`: one 32-bit gather at the rows' stride covers the
    /// 16-bit fields of two blocks (for the last block, the next 2 bytes of the row).
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
    #[inline]
    fn pair(&self, b: usize) -> [(__m512, __m512); 2] {
        let halves = |at: usize| {
            let v = gather(self.m, self.r0, at + 2 * b);
            [
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)),
                _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(v))),
            ]
        };
        let d = halves(0);
        let mw = match self.m_at {
            Some(at) => halves(at),
            None => d.map(|d| _mm512_mul_ps(d, _mm512_set1_ps(self.zero))),
        };
        [(d[0], mw[0]), (d[1], mw[1])]
    }

    /// Block `b`'s fifth bits (a 32-bit mask per row), for Q5_0 / Q5_1.
    #[target_feature(enable = "avx2,avx512f")]
    #[inline]
    fn qh(&self, b: usize) -> Option<__m512i> {
        self.qh_at.map(|at| gather(self.m, self.r0, at + 4 * b))
    }
}

/// `(dw_j, mw_j)` of the eight sub-blocks of the Q4_K / Q5_K super-blocks at `hdr` (16 rows),
/// lane `r` for row `r` (as `kquant::k45_block_scales`: exact products): the 16-byte heads
/// transposed into four words per row (`d` and `dmin`, then three words of 6-bit fields) and
/// the fields unpacked in the lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
#[inline]
fn k45_scales16(hdr: &[*const u8; G]) -> [(__m512, __m512); 8] {
    let [dd, w0, w1, w2] = quads(hdr, 0);
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    // `−dmin` by flipping the sign bit, as the scalar negation (`0 − dmin` would give +0).
    let dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
    let neg_dmin = _mm512_castsi512_ps(_mm512_xor_si512(
        _mm512_castps_si512(dmin),
        _mm512_set1_epi32(i32::MIN),
    ));
    let w = [w0, w1, w2];
    let field = |v: __m512i, shift: u32, mask: i32| {
        _mm512_and_si512(
            _mm512_srlv_epi32(v, _mm512_set1_epi32(shift as i32)),
            _mm512_set1_epi32(mask),
        )
    };
    let mut out = [(_mm512_setzero_ps(), _mm512_setzero_ps()); 8];
    for j in 0..4u32 {
        let sh = 8 * j;
        let high = |v, lo| _mm512_or_si512(lo, _mm512_slli_epi32::<4>(field(v, sh + 6, 3)));
        let (sc, mn) = (field(w[0], sh, 63), field(w[1], sh, 63));
        let sc4 = high(w[0], field(w[2], sh, 15));
        let mn4 = high(w[1], field(w[2], sh + 4, 15));
        for (k, (sc, mn)) in [(j, (sc, mn)), (j + 4, (sc4, mn4))] {
            out[k as usize] = (
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)),
                _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(mn)),
            );
        }
    }
    out
}

/// `d` and the sixteen 16-element scales of super-block `sb` of 16 Q6_K rows (starting at
/// `blk`), lane `r` for row `r`: the 16 scale bytes transposed into four words per row, a
/// 32-bit gather for `d` (the high half of the word two bytes before it, which stays inside
/// the super-block), and the signed bytes extended in the lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
#[inline]
fn k6_scales16(m: &QMatrix, r0: usize, sb: usize, blk: &[*const u8; G]) -> (__m512, [__m512i; 16]) {
    let dd = gather(m, r0, sb * m.ty.block_bytes() + K6_D - 2);
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dd)));
    let w = quads(blk, K6_SC);
    // Byte `i % 4` of word `i / 4`, sign-extended: shifted to the top, then back arithmetically.
    let sc = std::array::from_fn(|i| {
        let up = _mm512_sllv_epi32(w[i / 4], _mm512_set1_epi32(24 - 8 * (i % 4) as i32));
        _mm512_srai_epi32::<24>(up)
    });
    (d, sc)
}

/// Walks the quants of rows `$r0..$r0 + 16` of `$m` in storage order and runs `$body` with
/// `$b` = each block, `$w` = its eight vectors (fifth bits included; Q8_0 and IQ4_NL plus 128)
/// and `$s` = its scale and offset weight per row, fetching the first `1 / $part` of the next
/// group's lines on the way. (A macro: the body must be inlined into the walk, which a closure
/// was not.)
macro_rules! walk {
    ($m:expr, $r0:expr, $fetch:expr, $part:expr, |$b:ident, $w:ident, $s:ident| $body:block) => {{
        let m: &QMatrix = $m;
        if matches!(m.ty, WeightType::Q4_K | WeightType::Q5_K) {
            // Per super-block: the sub-blocks' scales of the 16 rows, then its 128 bytes of
            // quants as two 64-byte pieces per row, each holding four sub-blocks (the low and
            // high nibbles of two 32-byte groups); Q5_K's fifth bits are bit `j` of its 32 `qh`
            // bytes for sub-block `j`.
            let q5 = m.ty == WeightType::Q5_K;
            let bb = m.ty.block_bytes();
            let rows: [&[u8]; G] = std::array::from_fn(|r| m.raw_row($r0 + r));
            let (low, one) = (_mm512_set1_epi8(15), _mm512_set1_epi8(1));
            $fetch.plan($part, m.nb);
            for sb in 0..m.cols / QK_K {
                let at = |o: usize| -> [*const u8; G] {
                    std::array::from_fn(|r| rows[r][sb * bb + o..(sb + 1) * bb].as_ptr())
                };
                let scales = k45_scales16(&at(0));
                let qs = at(if q5 { K5_QS } else { K4_QS });
                // (64 bytes from `qh`: its 32 and the first quants, not used.)
                let qh = if q5 {
                    quads4(&at(K5_QH), 0)
                } else {
                    [[_mm512_setzero_si512(); 4]; 4]
                };
                for h in 0..2 {
                    let p = quads4(&qs, 64 * h);
                    for (g, hi) in [(0, false), (0, true), (1, false), (1, true)] {
                        let j = 4 * h + 2 * g + usize::from(hi);
                        let shift = _mm_cvtsi32_si128(j as i32);
                        let w: [__m512i; 8] = std::array::from_fn(|jj| {
                            let v = p[2 * g + jj / 4][jj % 4];
                            let v = if hi { _mm512_srli_epi16::<4>(v) } else { v };
                            let q = _mm512_and_si512(v, low);
                            if !q5 {
                                return q;
                            }
                            let f = _mm512_srl_epi32(qh[jj / 4][jj % 4], shift);
                            let f = _mm512_and_si512(f, one);
                            _mm512_or_si512(q, _mm512_slli_epi16::<4>(f))
                        });
                        let $b = 8 * sb + j;
                        let $w = &w;
                        let $s = Blk {
                            dw: scales[j].0,
                            mw: scales[j].1,
                            sc: [_mm512_setzero_si512(); 2],
                        };
                        $fetch.step();
                        $body
                    }
                }
            }
        } else if m.ty == WeightType::Q6_K {
            // Per super-block: `d` and the sixteen 16-element scales of the 16 rows, then the
            // 128 bytes of low quant bits as two 64-byte pieces and the 64 bytes of high bits
            // as one; block `j` (half `n = j / 4`, group `g = j % 4`) takes 32 low-bit bytes
            // (nibbles: low for `g < 2`) and bits `2g, 2g + 1` of 32 high-bit bytes.
            let bb = m.ty.block_bytes();
            let rows: [&[u8]; G] = std::array::from_fn(|r| m.raw_row($r0 + r));
            let (low, two) = (_mm512_set1_epi8(15), _mm512_set1_epi8(3));
            $fetch.plan($part, m.nb);
            for sb in 0..m.cols / QK_K {
                let qs: [*const u8; G] =
                    std::array::from_fn(|r| rows[r][sb * bb..][..bb].as_ptr());
                let (d, scs) = k6_scales16(m, $r0, sb, &qs);
                let ql = [quads4(&qs, 0), quads4(&qs, 64)];
                let qh = quads4(&qs, 128);
                for j in 0..8 {
                    let (n, g) = (j / 4, j % 4);
                    let shift = _mm_cvtsi32_si128(2 * g as i32);
                    let mut w = [_mm512_setzero_si512(); 8];
                    for (jj, w) in w.iter_mut().enumerate() {
                        let l = ql[n][2 * (g % 2) + jj / 4][jj % 4];
                        let l = if g < 2 {
                            _mm512_and_si512(l, low)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(l), low)
                        };
                        let h = _mm512_srl_epi16(qh[2 * n + jj / 4][jj % 4], shift);
                        let h = _mm512_and_si512(h, two);
                        *w = _mm512_or_si512(l, _mm512_slli_epi16::<4>(h));
                    }
                    let $b = 8 * sb + j;
                    let $w = &w;
                    let $s = Blk {
                        dw: d,
                        mw: _mm512_setzero_ps(),
                        sc: [scs[2 * j], scs[2 * j + 1]],
                    };
                    $fetch.step();
                    $body
                }
            }
        } else {
        let qs = quant_ptrs(m, $r0);
        let unit = Unit::new(m.ty);
        let q8 = m.ty == WeightType::Q8_0;
        let sc = Scales::new(m, $r0);
        let qh = |b: usize| sc.qh(b);
        // Blocks `b` and `b + 1`'s scales are read at `b` (even).
        let mut pair = [(_mm512_setzero_ps(), _mm512_setzero_ps()); 2];
        let mut scales = |b: usize| {
            if b % 2 == 0 {
                pair = sc.pair(b);
            }
            let (dw, mw) = pair[b % 2];
            Blk {
                dw,
                mw,
                sc: [_mm512_setzero_si512(); 2],
            }
        };
        // 64 bytes of every row at a time (four blocks, or two of Q8_0) where the rows have
        // them, then a block at a time.
        let total = m.ty.qs_bytes() * m.nb;
        $fetch.plan($part, m.nb);
        let mut off = 0;
        while off + 64 <= total {
            let p = quads4(&qs, off);
            if q8 {
                for i in 0..2 {
                    let $b = off / 32 + i;
                    let $w = &unit.q8(p[2 * i], p[2 * i + 1]);
                    let $s = scales($b);
                    $fetch.step();
                    $body
                }
            } else {
                // (Indexing: `into_iter` copied the 1 KiB array through memcpy.)
                #[allow(clippy::needless_range_loop)]
                for i in 0..4 {
                    let $b = off / 16 + i;
                    let $w = &unit.q4(p[i], qh($b));
                    let $s = scales($b);
                    $fetch.step();
                    $body
                }
            }
            off += 64;
        }
        while off < total {
            let $b = off / m.ty.qs_bytes();
            let $w = &if q8 {
                unit.q8(quads(&qs, off), quads(&qs, off + 16))
            } else {
                unit.q4(quads(&qs, off), qh($b))
            };
            let $s = scales($b);
            $fetch.step();
            $body
            off += m.ty.qs_bytes();
        }
        }
    }};
}
use walk;

/// Turns 16-byte pieces of 16 rows' quants into blocks' eight vectors (see [`walk!`]).
struct Unit {
    iq4: bool,
    low: __m512i,
    flip: __m512i,
    /// IQ4_NL's table plus 128, in every 128-bit lane.
    table: __m512i,
}

impl Unit {
    #[target_feature(enable = "avx2,avx512f")]
    #[inline]
    fn new(ty: WeightType) -> Self {
        let mut table = [0u8; 16];
        for (t, v) in table.iter_mut().zip(IQ4NL_VALUES) {
            *t = (v as u8) ^ 0x80;
        }
        Unit {
            iq4: ty == WeightType::IQ4_NL,
            low: _mm512_set1_epi8(15),
            flip: _mm512_set1_epi8(-128),
            // SAFETY: 16 readable bytes; unaligned load.
            table: _mm512_broadcast_i32x4(unsafe { _mm_loadu_si128(table.as_ptr().cast()) }),
        }
    }

    /// A Q8_0 block from its two halves: signed bytes, stored plus 128 (the unsigned operand
    /// of `vpdpbusd`).
    #[target_feature(enable = "avx2,avx512f")]
    #[inline]
    fn q8(&self, a: [__m512i; 4], b: [__m512i; 4]) -> [__m512i; 8] {
        let f = |v| _mm512_xor_si512(v, self.flip);
        [
            f(a[0]),
            f(a[1]),
            f(a[2]),
            f(a[3]),
            f(b[0]),
            f(b[1]),
            f(b[2]),
            f(b[3]),
        ]
    }

    /// A 4-bit block (Q4_0, Q4_1, IQ4_NL; Q5_0 and Q5_1 with their fifth bits `qh`): low
    /// nibbles are elements `4j..`, high nibbles `16 + 4j..` (vector `j + 4`).
    #[target_feature(enable = "avx2,avx512f,avx512bw")]
    #[inline]
    fn q4(&self, p: [__m512i; 4], qh: Option<__m512i>) -> [__m512i; 8] {
        let mut w = [_mm512_setzero_si512(); 8];
        for j in 0..4 {
            w[j] = _mm512_and_si512(p[j], self.low);
            w[4 + j] = _mm512_and_si512(_mm512_srli_epi16::<4>(p[j]), self.low);
        }
        if self.iq4 {
            for w in w.iter_mut() {
                *w = _mm512_shuffle_epi8(self.table, *w);
            }
        }
        if let Some(qh) = qh {
            for (j, w) in w.iter_mut().enumerate() {
                *w = _mm512_or_si512(*w, fifth_bits(qh, j as u32));
            }
        }
        w
    }
}

/// The dot of block `b`'s 16 rows with token row `xq` (its 32 activations at `32b`).
///
/// # Safety
/// `xq` must point to a token's `32 · nb` activations and `b < nb`.
#[target_feature(enable = "avx2,avx512f,avx512vnni")]
#[inline]
unsafe fn block_dot(w: &[__m512i], xq: *const i8, b: usize) -> __m512i {
    // SAFETY: as this function's.
    let (p, q) = unsafe { half_dots(w, xq, b) };
    _mm512_add_epi32(p, q)
}

/// Block `b`'s integer dot in the given `MODE` (see [`tokens`]): `xc` is the token's
/// corrections (per block for [`SIGNED`], per half for [`K6`]), `k6` Q6_K's half scales.
///
/// # Safety
/// As [`block_dot`].
#[target_feature(enable = "avx2,avx512f,avx512vnni")]
#[inline]
unsafe fn int_dot<const MODE: u8>(
    w: &[__m512i],
    xq: *const i8,
    b: usize,
    xc: &[i32],
    k6: [__m512i; 2],
) -> __m512i {
    if MODE == K6 {
        // SAFETY: as this function's.
        let (lo, hi) = unsafe { half_dots(w, xq, b) };
        // Each half's `Σ (q − 32)·x` times its scale.
        let c = |v, i: usize| _mm512_sub_epi32(v, _mm512_set1_epi32(xc[2 * b + i]));
        return _mm512_add_epi32(
            _mm512_mullo_epi32(c(lo, 0), k6[0]),
            _mm512_mullo_epi32(c(hi, 1), k6[1]),
        );
    }
    // SAFETY: as this function's.
    let l = unsafe { block_dot(w, xq, b) };
    if MODE == SIGNED {
        // The weights were stored plus 128: take 128 · Σx back off.
        return _mm512_sub_epi32(l, _mm512_set1_epi32(xc[b]));
    }
    l
}

/// As [`block_dot`], the dots of the block's two 16-element halves apart.
///
/// # Safety
/// As [`block_dot`].
#[target_feature(enable = "avx2,avx512f,avx512vnni")]
#[inline]
unsafe fn half_dots(w: &[__m512i], xq: *const i8, b: usize) -> (__m512i, __m512i) {
    // SAFETY: the caller guarantees `32 · b + 32 <= 32 · nb` readable bytes; unaligned reads.
    let x = |j: usize| unsafe {
        _mm512_set1_epi32(xq.add(QK * b + 4 * j).cast::<i32>().read_unaligned())
    };
    let zero = _mm512_setzero_si512();
    // Two chains of four, for the latency of `vpdpbusd`.
    let mut p = _mm512_dpbusd_epi32(zero, w[0], x(0));
    let mut q = _mm512_dpbusd_epi32(zero, w[4], x(4));
    for j in 1..4 {
        p = _mm512_dpbusd_epi32(p, w[j], x(j));
        q = _mm512_dpbusd_epi32(q, w[4 + j], x(4 + j));
    }
    (p, q)
}

/// One repacked group and what its tokens need: the batch, Q8_0 / IQ4_NL / Q6_K's corrections, the
/// group's first row and the output.
struct Pass<'a> {
    g: &'a Group,
    m: &'a QMatrix,
    x: &'a Activations,
    corr: &'a [i32],
    r0: usize,
    out: OutPtr,
}

/// How a block's integer dot becomes its float step (the `MODE` of [`tokens`]): an offset
/// term (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K), weights stored plus 128 (Q8_0, IQ4_NL), or Q6_K's two
/// halves, each `q − 32` and scaled in integers.
const OFFSET: u8 = 0;
const SIGNED: u8 = 1;
const K6: u8 = 2;

/// Runs `$body` with `$t` = each of `0..$n` (at most 8; `$n` a constant), written out so that
/// every index into per-token arrays is a constant.
macro_rules! each_token {
    ($n:expr, |$t:ident| $body:block) => {{
        const { assert!($n <= 8) };
        each_token!(@ $n, $t, $body, 0 1 2 3 4 5 6 7)
    }};
    (@ $n:expr, $t:ident, $body:block, $($i:literal)*) => {
        {
            $(if $n > $i { let $t = $i; $body })*
        }
    };
}

/// Tokens `t0..t0 + N` of one repacked group: out rows `r0..r0 + 16`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni")]
fn tokens<const N: usize, const MODE: u8>(p: &Pass<'_>, fetch: &mut Fetch<'_>, t0: usize) {
    let Pass {
        g,
        m,
        x,
        corr,
        r0,
        out,
    } = *p;
    let nb = m.nb;
    let mut xq = [std::ptr::null(); N];
    let (mut xd, mut xs, mut xc) = ([&[][..]; N], [&[][..]; N], [&[][..]; N]);
    for t in 0..N {
        let q = x.q_row(t0 + t);
        assert_eq!(q.len(), QK * nb);
        xq[t] = q.as_ptr();
        xd[t] = &x.d_row(t0 + t)[..nb];
        xs[t] = &x.s_row(t0 + t)[..nb];
        match MODE {
            SIGNED => xc[t] = &corr[(t0 + t) * nb..(t0 + t + 1) * nb],
            K6 => xc[t] = &corr[(t0 + t) * 2 * nb..(t0 + t + 1) * 2 * nb],
            _ => {}
        }
    }
    let mut lanes = [[_mm512_setzero_ps(); 8]; N];
    // The rest of the next group's lines, an eighth at the start of each lane's blocks.
    fetch.plan(1, 8.min(nb));
    #[allow(clippy::needless_range_loop)]
    for k in 0..8.min(nb) {
        fetch.step();
        let mut acc = [_mm512_setzero_ps(); N];
        for b in (k..nb).step_by(8) {
            let w = &g.w[8 * b..8 * b + 8];
            let k6 = if MODE == K6 {
                [g.sc[2 * b], g.sc[2 * b + 1]]
            } else {
                [_mm512_setzero_si512(); 2]
            };
            let (mw, dw) = (g.mw[b], g.dw[b]);
            // Unrolled over the tokens, so that each accumulator stays in a register (as a
            // loop, they lived on the stack: a load and a store per token and block).
            each_token!(N, |t| {
                // SAFETY: `xq[t]` holds `32 · nb` activations (checked above) and `b < nb`.
                let l = unsafe { int_dot::<MODE>(w, xq[t], b, xc[t], k6) };
                if MODE == OFFSET {
                    acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[t][b]), acc[t]);
                }
                let sc = _mm512_mul_ps(dw, _mm512_set1_ps(xd[t][b]));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(l), sc, acc[t]);
            });
        }
        for t in 0..N {
            lanes[t][k] = acc[t];
        }
    }
    write_sums(&lanes, m.rows, r0, t0, out);
}

/// Adds each token's eight lane accumulators by `hsum`'s tree and writes the sums: `lanes[t]`
/// is token `t0 + t`'s, out rows `r0..r0 + 16` of a `rows`-row matrix.
#[target_feature(enable = "avx512f")]
fn write_sums(lanes: &[[__m512; 8]], rows: usize, r0: usize, t0: usize, out: OutPtr) {
    for (t, l) in lanes.iter().enumerate() {
        let v = _mm512_add_ps(
            _mm512_add_ps(_mm512_add_ps(l[0], l[1]), _mm512_add_ps(l[2], l[3])),
            _mm512_add_ps(_mm512_add_ps(l[4], l[5]), _mm512_add_ps(l[6], l[7])),
        );
        let mut o = [0f32; G];
        // SAFETY: room for 16 f32s; unaligned store.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), v) };
        out.write_n((t0 + t) * rows + r0, o);
    }
}

/// `k ·` the sum of each `n` consecutive quantized activations, per token.
fn sums(x: &Activations, n: usize, k: i32) -> Vec<i32> {
    (0..x.n_tokens)
        .flat_map(|t| {
            x.q_row(t)
                .chunks(n)
                .map(move |c| k * c.iter().map(|&v| v as i32).sum::<i32>())
        })
        .collect()
}

/// Computes `rows` (whole groups of 16) for every token of `x` (see [`fits`]).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(in crate::kernels) fn rows(m: &QMatrix, x: &Activations, out: OutPtr, rows: Range<usize>) {
    assert!(fits(m.ty) && rows.len().is_multiple_of(G));
    // Q8_0 / IQ4_NL weights are stored plus 128: per token and block, `128 · Σx` to subtract;
    // Q6_K's are `q − 32`: per token and 16-element half, `32 · Σx`.
    let signed = matches!(m.ty, WeightType::Q8_0 | WeightType::IQ4_NL);
    let (corr, mode): (Vec<i32>, u8) = match m.ty {
        _ if signed => (sums(x, QK, 128), SIGNED),
        WeightType::Q6_K => (sums(x, QK / 2, 32), K6),
        _ => (Vec::new(), OFFSET),
    };
    let few = x.n_tokens <= small::MAX;
    // Only the buffered path keeps the group's repacking.
    let mut g = Group::new(if few { 0 } else { m.nb }, mode == K6);
    for r0 in rows.step_by(G) {
        // The next group's rows.
        let next = (r0 + G) * m.row_bytes..((r0 + 2 * G).min(m.rows)) * m.row_bytes;
        let mut fetch = Fetch::new(m.packed_bytes().get(next).unwrap_or(&[]), m.row_bytes);
        if !few {
            g.fill(m, r0, &mut fetch);
        }
        let p = Pass {
            g: &g,
            m,
            x,
            corr: &corr,
            r0,
            out,
        };
        let f = &mut fetch;
        macro_rules! few {
            ($($n:literal)*) => {
                match (x.n_tokens, mode) {
                    $(
                        ($n, SIGNED) if few => small::tokens::<$n, SIGNED>(&p, f),
                        ($n, K6) if few => small::tokens::<$n, K6>(&p, f),
                        ($n, _) if few => small::tokens::<$n, OFFSET>(&p, f),
                    )*
                    (_, SIGNED) => batch::<SIGNED>(&p, f),
                    (_, K6) => batch::<K6>(&p, f),
                    _ => batch::<OFFSET>(&p, f),
                }
            };
        }
        const { assert!(small::MAX <= 8) };
        few!(1 2 3 4 5 6 7 8);
    }
}

/// Every token of `x` for one repacked group, several tokens at once (enough independent
/// `vpdpbusd` chains in flight).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vnni")]
fn batch<const MODE: u8>(p: &Pass<'_>, fetch: &mut Fetch<'_>) {
    let x = p.x;
    let mut t = 0;
    while t < x.n_tokens {
        t += match x.n_tokens - t {
            n if n >= T => {
                tokens::<T, MODE>(p, fetch, t);
                T
            }
            n if n >= 4 => {
                tokens::<4, MODE>(p, fetch, t);
                4
            }
            n if n >= 2 => {
                tokens::<2, MODE>(p, fetch, t);
                2
            }
            _ => {
                tokens::<1, MODE>(p, fetch, t);
                1
            }
        };
    }
}
