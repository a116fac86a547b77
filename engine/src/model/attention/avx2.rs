//! AVX2 attention over an F32, F16 or Q8_0 KV cache with `head_dim = 8·CH`: the same float
//! operations (an f16 element widened exactly by F16C, as `half` widens it; a Q8_0 element as
//! `f32(q) · d`, one rounding, as `KvElem::chunk8` computes it), in
//! the same order, as the portable `attend_typed` (eight-lane `acc + q·k` partial sums reduced as
//! `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`, then `acc + w·v` per position in order),
//! so results are bit-identical; only the code shape differs: a head's query and output rows stay
//! in registers across a span of positions instead of being loaded and stored for every one,
//! four positions' dot products are reduced together, and the positions are taken in spans whose
//! key and value rows fit in L1, so that the query heads sharing a kv head read them from
//! memory once, not once per head — and an F16 or Q8_0 span is widened to f32 once, into a
//! scratch row block the heads then read.

use std::arch::x86_64::*;

use super::{normalize, Attend, KvElem, Part, Q8Block};

/// `[hsum(a), hsum(b), hsum(c), hsum(d)]`, each `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 +
/// v7))`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let q = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps::<1>(q))
}

/// Loads 8 f32s at `p`.
///
/// # Safety
/// `p` must point to 8 readable f32s.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn load(p: *const f32) -> __m256 {
    // SAFETY: guaranteed by the caller; unaligned load.
    unsafe { _mm256_loadu_ps(p) }
}

/// A KV unit type whose rows the kernel reads eight elements at a time as f32s.
pub(super) trait Lanes: KvElem {
    /// Whether rows must be widened to be read as f32s (all but an f32 cache).
    const WIDEN: bool = true;
    /// Elements `8c .. 8c + 8` of the row at `row`, widened to f32 as [`KvElem::chunk8`] does.
    ///
    /// # Safety
    /// The row at `row` must hold `8c + 8` readable elements, and the CPU must have AVX2 and
    /// F16C (the function is inlined into the kernel, whose features these are).
    unsafe fn load8(row: *const Self, c: usize) -> __m256;
}

impl Lanes for f32 {
    const WIDEN: bool = false;
    #[inline(always)]
    unsafe fn load8(row: *const f32, c: usize) -> __m256 {
        // SAFETY: guaranteed by the caller.
        unsafe { load(row.add(8 * c)) }
    }
}

impl Lanes for half::f16 {
    #[inline(always)]
    unsafe fn load8(row: *const half::f16, c: usize) -> __m256 {
        // SAFETY: 16 readable bytes and F16C, guaranteed by the caller; unaligned load.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(row.add(8 * c).cast())) }
    }
}

impl Lanes for Q8Block {
    #[inline(always)]
    unsafe fn load8(row: *const Q8Block, c: usize) -> __m256 {
        // SAFETY: block `c / 4` is readable (guaranteed by the caller); its 8 quants at
        // `8·(c % 4)` lie inside it; unaligned loads; F16C guaranteed by the caller.
        unsafe {
            let b = row.add(c / 4);
            let d = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(u16::from_le_bytes((*b).d))));
            let q = _mm_loadl_epi64((*b).qs.as_ptr().add(8 * (c % 4)).cast());
            let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            _mm256_mul_ps(q, _mm256_broadcastss_ps(d))
        }
    }
}

/// `Σ q·k` partial sums of one position, eight lanes (`q` preloaded).
///
/// # Safety
/// `k` must point to `8·CH` readable elements.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn partial<T: Lanes, const CH: usize>(q: &[__m256; CH], k: *const T) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    for (c, q) in q.iter().enumerate() {
        // SAFETY: `8·c + 8 <= 8·CH`.
        acc = _mm256_add_ps(acc, _mm256_mul_ps(*q, unsafe { T::load8(k, c) }));
    }
    acc
}

/// Into `ptrs`: where the key (`value == false`) or value rows at `rows` can be read as `8·CH`
/// f32s — the cache's own rows for an F32 cache; else each row widened once into `wide`, so
/// that the query heads of a group do not widen it once each.
///
/// # Safety
/// Every offset of `rows` must leave `8·CH` elements readable in `mem`; `ptrs` must be at least
/// `rows.len()` long. The pointers are valid until `wide` changes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f32_rows<T: Lanes, const CH: usize>(
    mem: &[T],
    rows: &[(usize, usize)],
    value: bool,
    wide: &mut Vec<f32>,
    ptrs: &mut [*const f32],
) {
    let at = |r: &(usize, usize)| mem.as_ptr().wrapping_add(if value { r.1 } else { r.0 });
    if !T::WIDEN {
        for (p, r) in ptrs.iter_mut().zip(rows) {
            // An F32 cache: `T` is f32.
            *p = at(r).cast();
        }
        return;
    }
    let hd = 8 * CH;
    if wide.len() < rows.len() * hd {
        wide.resize(rows.len() * hd, 0.0);
    }
    for (i, r) in rows.iter().enumerate() {
        let dst = wide[i * hd..(i + 1) * hd].as_mut_ptr();
        for c in 0..CH {
            // SAFETY: the row holds `8·CH` elements (the caller's promise); `dst` holds `8·CH`
            // f32s; unaligned store.
            unsafe { _mm256_storeu_ps(dst.add(8 * c), T::load8(at(r), c)) };
        }
    }
    for (i, p) in ptrs.iter_mut().take(rows.len()).enumerate() {
        *p = wide.as_ptr().wrapping_add(i * hd);
    }
}

/// The span kernel for the head size of `a`, if it has one (32, 64 or 128): false when the
/// caller must use the portable code.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn attend<T: Lanes>(
    a: &Attend<'_>,
    items: std::ops::Range<usize>,
    out: &mut [f32],
    part: &mut Part,
) -> bool {
    match a.layout.head_dim {
        32 => attend_kv::<T, 4>(a, items, out, part),
        64 => attend_kv::<T, 8>(a, items, out, part),
        128 => attend_kv::<T, 16>(a, items, out, part),
        _ => return false,
    }
    true
}

/// Causal attention of every batch token over its cached positions (see `attend`).
#[target_feature(enable = "avx2,fma,f16c")]
fn attend_kv<T: Lanes, const CH: usize>(
    a: &Attend<'_>,
    items: std::ops::Range<usize>,
    out: &mut [f32],
    part: &mut Part,
) {
    let hd = a.layout.head_dim;
    assert_eq!(hd, 8 * CH);
    let group = a.n_heads / a.layout.n_kv_heads;
    let (scale, softcap) = (a.params.scale, a.params.softcap);
    let mem = a.mem::<T>();
    // Positions per span: the span's key (or value) rows take 16 KiB as f32s, so they stay in
    // L1 while every query head of the group goes over them (one pass from L2/L3, and one
    // widening of an F16 or Q8_0 row, instead of `group`).
    let span = (512 / CH).max(4);
    // Where each position of the span's rows can be read as f32s.
    let mut ptrs = [std::ptr::null::<f32>(); 128];
    assert!(span <= ptrs.len());
    a.each_group::<T>(items, out, part, |gr, scratch| {
        // Positions attended to (the whole causal prefix, or the window).
        let ctx = gr.n;
        for s0 in (0..ctx).step_by(span) {
            let end = (s0 + span).min(ctx);
            // SAFETY: every row offset was checked against `mem` (`each_group`).
            unsafe {
                f32_rows::<T, CH>(
                    mem,
                    &scratch.rows[s0..end],
                    false,
                    &mut scratch.wide,
                    &mut ptrs,
                )
            };
            for h in 0..group {
                let qh = &gr.q[h * hd..(h + 1) * hd];
                let mut qv = [_mm256_setzero_ps(); CH];
                for (c, v) in qv.iter_mut().enumerate() {
                    // SAFETY: `qh` holds `8·CH` f32s.
                    *v = unsafe { load(qh.as_ptr().add(8 * c)) };
                }
                let qh = &qv;
                let row = &mut scratch.scores[h * ctx..(h + 1) * ctx];
                let mut j = s0;
                while j + 4 <= end {
                    let r = &ptrs[j - s0..j - s0 + 4];
                    // SAFETY: each pointer reads `8·CH` f32s (`f32_rows`).
                    let v = unsafe {
                        let p = |i: usize| partial::<f32, CH>(qh, r[i]);
                        hsum4(p(0), p(1), p(2), p(3))
                    };
                    let v = _mm_mul_ps(v, _mm_set1_ps(scale));
                    // SAFETY: `j + 4 <= end <= ctx = row.len()`; unaligned store.
                    unsafe { _mm_storeu_ps(row.as_mut_ptr().add(j), v) };
                    j += 4;
                }
                while j < end {
                    // SAFETY: as above.
                    let p = unsafe { partial::<f32, CH>(qh, ptrs[j - s0]) };
                    let z = _mm256_setzero_ps();
                    row[j] = _mm_cvtss_f32(hsum4(p, z, z, z)) * scale;
                    j += 1;
                }
            }
        }
        for h in 0..group {
            normalize(&mut scratch.scores[h * ctx..(h + 1) * ctx], softcap);
        }
        // Each head's running sums go to memory between spans: the same additions in the same
        // order as keeping them in registers throughout.
        scratch.acc.clear();
        scratch.acc.resize(group * hd, 0.0);
        for s0 in (0..ctx).step_by(span) {
            let end = (s0 + span).min(ctx);
            // SAFETY: as above.
            unsafe {
                f32_rows::<T, CH>(
                    mem,
                    &scratch.rows[s0..end],
                    true,
                    &mut scratch.wide,
                    &mut ptrs,
                )
            };
            for h in 0..group {
                let row = &scratch.scores[h * ctx + s0..h * ctx + end];
                let sums = &mut scratch.acc[h * hd..(h + 1) * hd];
                let mut acc = [_mm256_setzero_ps(); CH];
                for (c, a) in acc.iter_mut().enumerate() {
                    // SAFETY: `sums` holds `8·CH` f32s.
                    *a = unsafe { load(sums.as_ptr().add(8 * c)) };
                }
                for (&w, &v) in row.iter().zip(&ptrs[..end - s0]) {
                    let w = _mm256_set1_ps(w);
                    for (c, a) in acc.iter_mut().enumerate() {
                        // SAFETY: each pointer reads `8·CH` f32s (`f32_rows`).
                        let x = unsafe { load(v.add(8 * c)) };
                        *a = _mm256_add_ps(*a, _mm256_mul_ps(w, x));
                    }
                }
                for (c, a) in acc.iter().enumerate() {
                    // SAFETY: `sums` holds `8·CH` f32s; unaligned store.
                    unsafe { _mm256_storeu_ps(sums.as_mut_ptr().add(8 * c), *a) };
                }
            }
        }
        gr.out.copy_from_slice(&scratch.acc);
    });
}
