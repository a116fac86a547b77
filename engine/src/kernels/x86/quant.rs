//! AVX2 activation quantization: bit-identical to `scalar::quantize_block` for every input
//! (NaN, infinities and subnormal blocks included), eight values per instruction instead of
//! one.
//!
//! Per value the scalar code computes `((v · id + M) − M) as i8` with `M = 1.5·2^23`; the same
//! float ops run here lane by lane, and `as i8`'s saturation (and NaN → 0) is reproduced by
//! clamping to `[-128, 127]` and zeroing NaN lanes before the (then exact) conversion. `amax` is
//! a maximum, so the order of the lanes does not matter, and NaNs are skipped as `f32::max`
//! skips them; `Σq` is an exact integer sum.

use std::arch::x86_64::*;

use super::super::{Activations, QK};

/// As `scalar::quantize_block` for a block of [`QK`] values.
///
/// # Panics
/// If `x` or `q` does not hold exactly [`QK`] values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernels) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    assert!(x.len() == QK && q.len() == QK);
    let mut v = [_mm256_setzero_ps(); 4];
    for (i, v) in v.iter_mut().enumerate() {
        // SAFETY: `x` holds 32 f32s; unaligned load.
        *v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) };
    }
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // `max(|v|, acc)` returns `acc` when `|v|` is NaN, as `acc.max(|v|)` does.
    let mut m = _mm256_setzero_ps();
    for v in &v {
        m = _mm256_max_ps(_mm256_and_ps(*v, abs), m);
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = half::f16::from_f32(amax / 127.0).to_f32();
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let (idv, magic) = (_mm256_set1_ps(id), _mm256_set1_ps(12_582_912.0));
    let (lo, hi) = (_mm256_set1_ps(-128.0), _mm256_set1_ps(127.0));
    let mut n = [_mm256_setzero_si256(); 4];
    for (n, v) in n.iter_mut().zip(&v) {
        let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(*v, idv), magic), magic);
        // NaN stays NaN through both (the second operand is returned), then becomes 0.
        let c = _mm256_min_ps(hi, _mm256_max_ps(lo, r));
        let ord = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
        *n = _mm256_and_si256(_mm256_cvttps_epi32(c), ord);
    }
    // i32 → i8 (all in range, so the saturating packs are exact), then undo the 128-bit lane
    // interleaving of the packs.
    let w = _mm256_packs_epi16(
        _mm256_packs_epi32(n[0], n[1]),
        _mm256_packs_epi32(n[2], n[3]),
    );
    let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: `q` holds 32 i8s; unaligned store.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), w) };
    // Σq: Σ(q + 128) over unsigned bytes, minus 32·128.
    let s = _mm256_sad_epu8(
        _mm256_xor_si256(w, _mm256_set1_epi8(-128)),
        _mm256_setzero_si256(),
    );
    let s = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi64(s, _mm_unpackhi_epi64(s, s));
    (d, _mm_cvtsi128_si32(s) - 32 * 128)
}

/// Quantizes every block of `x` into `a` as `Activations::set` does.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kernels) fn quantize_rows(a: &mut Activations, x: &[f32]) {
    a.quantize_rows(x, |x, q| quantize_block(x, q));
}

#[cfg(test)]
mod tests {
    use super::super::super::scalar;
    use super::*;

    /// Bit-identical to the scalar quantization on ordinary, tied, tiny, huge and non-finite
    /// blocks.
    #[test]
    fn matches_scalar_quantize_block() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return;
        }
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let specials = [
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1e-40,
            -1e-45,
            f32::MAX,
            -f32::MAX,
            0.5,
            -2.5,
        ];
        for case in 0..4000 {
            let x: Vec<f32> = (0..QK)
                .map(|i| {
                    let r = next();
                    match case % 4 {
                        // Plain values, spanning many magnitudes.
                        0 => ((r >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * (case as f32 + 1.0),
                        // Values landing on .5 after scaling (round-to-even ties).
                        1 => ((r % 255) as f32 - 127.0) * 0.5,
                        // Arbitrary bit patterns (NaN, infinities, subnormals included).
                        2 => f32::from_bits(r as u32),
                        _ => specials[(r as usize + i) % specials.len()],
                    }
                })
                .collect();
            let (mut qa, mut qb) = ([0i8; QK], [0i8; QK]);
            let a = scalar::quantize_block(&x, &mut qa);
            // SAFETY: the features were detected above.
            let b = unsafe { quantize_block(&x, &mut qb) };
            assert_eq!((a.0.to_bits(), a.1, qa), (b.0.to_bits(), b.1, qb), "{x:?}");
        }
    }
}
