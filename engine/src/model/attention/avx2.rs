//! AVX2 attention over an F32 KV cache with `head_dim = 8·CH`: the same float operations, in
//! the same order, as the portable `attend_typed` (eight-lane `acc + q·k` partial sums reduced as
//! `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`, then `acc + w·v` per position in order),
//! so results are bit-identical; only the code shape differs: a head's query and output rows stay
//! in registers across positions instead of being loaded and stored for every one, and four
//! positions' dot products are reduced together.

use std::arch::x86_64::*;

use super::{normalize, Attend, AttnScratch};

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

/// `Σ q·k` partial sums of one position, eight lanes (`q` preloaded).
///
/// # Safety
/// `k` must point to `8·CH` readable f32s.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn partial<const CH: usize>(q: &[__m256; CH], k: *const f32) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    for (c, q) in q.iter().enumerate() {
        // SAFETY: `8·c + 8 <= 8·CH`.
        acc = _mm256_add_ps(acc, _mm256_mul_ps(*q, unsafe { load(k.add(8 * c)) }));
    }
    acc
}

/// Causal attention of every batch token over its cached positions (see `attend`).
#[target_feature(enable = "avx2,fma")]
pub(super) fn attend_f32<const CH: usize>(
    a: &Attend<'_>,
    out: &mut [f32],
    scratch: &mut AttnScratch,
) {
    let hd = a.cache.layout().head_dim;
    assert_eq!(hd, 8 * CH);
    let group = a.n_heads / a.cache.layout().n_kv_heads;
    let (scale, softcap) = (a.params.scale, a.params.softcap);
    let mem = a.cache.elems::<f32>();
    a.each_group::<f32>(out, scratch, |gr, scratch| {
        // Positions attended to (the whole causal prefix, or the window).
        let ctx = gr.n;
        for h in 0..group {
            let qh = &gr.q[h * hd..(h + 1) * hd];
            let mut qv = [_mm256_setzero_ps(); CH];
            for (c, v) in qv.iter_mut().enumerate() {
                // SAFETY: `qh` holds `8·CH` f32s.
                *v = unsafe { load(qh.as_ptr().add(8 * c)) };
            }
            let qh = &qv;
            let row = &mut scratch.scores[h * ctx..(h + 1) * ctx];
            let mut j = 0;
            while j + 4 <= ctx {
                let r = &scratch.rows[j..j + 4];
                // SAFETY: every row offset was checked against `mem` above.
                let v = unsafe {
                    let p = |i: usize| partial::<CH>(qh, mem.as_ptr().add(r[i].0));
                    hsum4(p(0), p(1), p(2), p(3))
                };
                let v = _mm_mul_ps(v, _mm_set1_ps(scale));
                // SAFETY: `j + 4 <= ctx = row.len()`; unaligned store.
                unsafe { _mm_storeu_ps(row.as_mut_ptr().add(j), v) };
                j += 4;
            }
            while j < ctx {
                let k = mem.as_ptr().wrapping_add(scratch.rows[j].0);
                // SAFETY: as above.
                let p = unsafe { partial::<CH>(qh, k) };
                let z = _mm256_setzero_ps();
                row[j] = _mm_cvtss_f32(hsum4(p, z, z, z)) * scale;
                j += 1;
            }
            normalize(row, softcap);
        }
        for h in 0..group {
            let row = &scratch.scores[h * ctx..(h + 1) * ctx];
            let mut acc = [_mm256_setzero_ps(); CH];
            for (&w, &(_, v)) in row.iter().zip(&scratch.rows) {
                let w = _mm256_set1_ps(w);
                let v = mem.as_ptr().wrapping_add(v);
                for (c, a) in acc.iter_mut().enumerate() {
                    // SAFETY: the value row offset was checked against `mem` above.
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(w, unsafe { load(v.add(8 * c)) }));
                }
            }
            let o = &mut gr.out[h * hd..(h + 1) * hd];
            for (c, a) in acc.iter().enumerate() {
                // SAFETY: `o` holds `8·CH` f32s; unaligned store.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(8 * c), *a) };
            }
        }
    });
}
