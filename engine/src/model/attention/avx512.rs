//! The AVX-512 tile kernel (AVX512F, VL and DQ) over an F32, F16 or Q8_0 KV cache with `head_dim =
//! 8·CH`: the float operations of the portable kernel in the same order (eight-lane `acc + q·k`
//! partial sums reduced as `((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`, then `acc +
//! w·v` per position in order), so results are bit-identical to it and to the AVX2 kernel.
//!
//! What differs is the shape. A 512-bit register holds the eight partial sums of two positions
//! (`j` and `j + 4` of a group of eight): the tile's key rows are widened into that interleaved
//! order once per item. Four query heads then go through eight positions at a time, so each key
//! load feeds four heads and each query load eight positions. The eight sums of a group are
//! reduced together, as two `hadd` rounds and one add of 128-bit lanes. Four heads' value sums
//! stay in registers, 64 elements at a time, across a tile.

use std::arch::x86_64::*;
use std::ops::Range;

use super::avx2::{prefetch_rows, Lanes};
use super::tile::{self, TileKernel, TILE};
use super::{Attend, Item, Part};

/// Runs `items` with the kernel for the head size of `a`, if it has one (32, 64, 128 or 256):
/// false when the caller must use another kernel.
///
/// # Safety
/// The CPU must have AVX512F, AVX512VL, AVX512DQ, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn run<T: Lanes>(a: &Attend<'_>, items: &[Item], part: &mut Part) -> bool {
    match a.layout.head_dim {
        32 => run_ch::<T, 4, 2>(a, items, part),
        64 => run_ch::<T, 8, 4>(a, items, part),
        128 => run_ch::<T, 16, 4>(a, items, part),
        256 => run_ch::<T, 32, 4>(a, items, part),
        _ => return false,
    }
    true
}

/// [`run`] for `head_dim = 8·CH`, value sums kept `NZ` registers (16·NZ elements) per head at
/// a time.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma,f16c")]
fn run_ch<T: Lanes, const CH: usize, const NZ: usize>(
    a: &Attend<'_>,
    items: &[Item],
    part: &mut Part,
) {
    let mut wide = std::mem::take(&mut part.wide);
    if wide.len() < TILE * 8 * CH {
        wide.resize(TILE * 8 * CH, 0.0);
    }
    let mut kernel = Kernel::<T, CH, NZ> {
        mem: a.mem::<T>(),
        wide: &mut wide,
        values: [std::ptr::null(); TILE],
    };
    a.each_item(items, part, |a, it, st, out| {
        tile::item::<T>(a, it.parts(), &mut kernel, st, out)
    });
    part.wide = wide;
}

/// The loaded tile, by position in the tile.
struct Kernel<'a, T, const CH: usize, const NZ: usize> {
    mem: &'a [T],
    /// `TILE · 8·CH` f32s: the key rows interleaved (group of eight positions `g`, pair `i` of
    /// positions `8g + i` and `8g + i + 4`, chunk `c`: 16 f32s), or the value rows one after
    /// another.
    wide: &'a mut Vec<f32>,
    /// Where each loaded value row can be read as `8·CH` f32s.
    values: [*const f32; TILE],
}

impl<T: Lanes, const CH: usize, const NZ: usize> TileKernel for Kernel<'_, T, CH, NZ> {
    #[inline(always)]
    fn prefetch(&self, rows: &[(usize, usize)]) {
        prefetch_rows::<T, CH>(self.mem, rows);
    }

    #[inline(always)]
    fn load(&mut self, rows: &[(usize, usize)], base: usize, value: bool) {
        assert!(base + rows.len() <= TILE && self.wide.len() >= TILE * 8 * CH);
        let wide = self.wide.as_mut_ptr();
        for (i, &(k, v)) in rows.iter().enumerate() {
            let t = base + i;
            let src = self.mem.as_ptr().wrapping_add(if value { v } else { k });
            if value && !T::WIDEN {
                // An F32 cache: `T` is f32.
                self.values[t] = src.cast();
                continue;
            }
            // Keys: pair `t % 4` of group `t / 8`, the second half for `t % 8 >= 4`; values:
            // row `t`.
            let (at, step) = if value {
                (t * 8 * CH, 8)
            } else {
                let (g, u) = (t / 8, t % 8);
                ((g * 4 + u % 4) * CH * 16 + u / 4 * 8, 16)
            };
            for c in 0..CH {
                // SAFETY: `kv_rows` checked the row's `8·CH` elements against the pool; `at +
                // step·c + 8 <= TILE · 8·CH` (asserted); the CPU features as in `run`.
                unsafe { _mm256_storeu_ps(wide.add(at + step * c), T::load8(src, c)) };
            }
            if value {
                self.values[t] = wide.wrapping_add(at);
            }
        }
    }

    #[inline(always)]
    fn scores(&self, q: &[f32], js: Range<usize>, scale: f32, s: &mut [f32], base: usize) {
        let hd = 8 * CH;
        let heads = q.len() / hd;
        assert!(q.len() == heads * hd && s.len() >= heads * TILE && base + js.end <= TILE);
        // Whole groups of eight tile positions around `js` (the extra scores are overwritten
        // by the softmax, which takes only the row's own positions).
        let groups = (base + js.start) / 8..(base + js.end).div_ceil(8);
        let keys = self.wide.as_ptr();
        for h0 in (0..heads).step_by(4) {
            let q = |r: usize| q[(h0 + r).min(heads - 1) * hd..].as_ptr();
            let s = s[h0 * TILE..].as_mut_ptr();
            let g = groups.clone();
            // SAFETY: `q(r)` starts a row of `8·CH` f32s; `s` has `TILE` f32s per head for
            // the heads written (`heads - h0` of them); the keys span `TILE · 8·CH` f32s; the
            // CPU features as in `run`.
            unsafe {
                match heads - h0 {
                    1 => scores_r::<CH, 1>(keys, g, scale, [q(0)], s),
                    2 => scores_r::<CH, 2>(keys, g, scale, [q(0), q(1)], s),
                    3 => scores_r::<CH, 3>(keys, g, scale, [q(0), q(1), q(2)], s),
                    _ => scores_r::<CH, 4>(keys, g, scale, [q(0), q(1), q(2), q(3)], s),
                }
            }
        }
    }

    #[inline(always)]
    fn accumulate(&self, p: &[f32], base: usize, js: Range<usize>, acc: &mut [f32]) {
        let hd = 8 * CH;
        let heads = acc.len() / hd;
        assert!(acc.len() == heads * hd && p.len() >= heads * TILE && base + js.end <= TILE);
        let ts = base + js.start..base + js.end;
        for h0 in (0..heads).step_by(4) {
            let w = p[h0 * TILE..].as_ptr();
            let a = acc[h0 * hd..].as_mut_ptr();
            let t = ts.clone();
            let v = &self.values;
            // SAFETY: `w` has `TILE` weights and `a` a row of `8·CH` f32s per head for the
            // heads used; `values[t]` reads `8·CH` f32s for each `t` loaded (`load`); the CPU
            // features as in `run`.
            unsafe {
                match heads - h0 {
                    1 => accumulate_r::<CH, NZ, 1>(v, t, w, a),
                    2 => accumulate_r::<CH, NZ, 2>(v, t, w, a),
                    3 => accumulate_r::<CH, NZ, 3>(v, t, w, a),
                    _ => accumulate_r::<CH, NZ, 4>(v, t, w, a),
                }
            }
        }
    }
}

/// Per 128-bit lane, `[a0 + a1, a2 + a3, b0 + b1, b2 + b3]` (AVX's `hadd` on 512 bits).
#[target_feature(enable = "avx512f")]
#[inline]
fn hadd(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(
        _mm512_shuffle_ps::<0b10_00_10_00>(a, b),
        _mm512_shuffle_ps::<0b11_01_11_01>(a, b),
    )
}

/// The scores of `R` query heads (`q`, rows of `8·CH`) at the eight positions of each group in
/// `groups`, into `s[r·TILE + 8g ..][..8]`.
///
/// # Safety
/// `q[r]` must point to `8·CH` readable f32s, `s` to `R · TILE` writable ones, and `keys` to a
/// tile of interleaved key rows (`TILE · 8·CH` f32s) with `groups` inside the tile; the CPU must
/// have AVX512F, AVX512VL, AVX512DQ and AVX2.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma")]
#[inline]
unsafe fn scores_r<const CH: usize, const R: usize>(
    keys: *const f32,
    groups: Range<usize>,
    scale: f32,
    q: [*const f32; R],
    s: *mut f32,
) {
    let sc = _mm256_set1_ps(scale);
    // SAFETY (the whole body): guaranteed by the caller; unaligned loads and stores.
    unsafe {
        for g in groups {
            let kb = keys.add(g * 4 * CH * 16);
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for c in 0..CH {
                let k: [__m512; 4] =
                    std::array::from_fn(|i| _mm512_loadu_ps(kb.add((i * CH + c) * 16)));
                for (r, acc) in acc.iter_mut().enumerate() {
                    let qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[r].add(8 * c)));
                    for (a, k) in acc.iter_mut().zip(&k) {
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(qv, *k));
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                // Pair i holds positions i and i + 4: after two `hadd` rounds, 128-bit lanes 0
                // and 1 hold positions 0–3's lower and upper partial sums, lanes 2 and 3 those
                // of positions 4–7.
                let x = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));
                let lo = _mm512_shuffle_f32x4::<0b10_00_10_00>(x, x);
                let hi = _mm512_shuffle_f32x4::<0b11_01_11_01>(x, x);
                let sum = _mm512_castps512_ps256(_mm512_add_ps(lo, hi));
                _mm256_storeu_ps(s.add(r * TILE + 8 * g), _mm256_mul_ps(sum, sc));
            }
        }
    }
}

/// `acc[r] += w[r·TILE + t] · v_t` for `R` heads over the loaded value rows at tile positions
/// `ts` in order, `NZ` registers (16·NZ elements) of every head at a time.
///
/// # Safety
/// `acc` must point to `R` rows of `8·CH` writable f32s, `w` to `R · TILE` readable weights, and
/// `values[t]` for `t` in `ts` to `8·CH` readable f32s; the CPU must have AVX512F.
#[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma")]
#[inline]
unsafe fn accumulate_r<const CH: usize, const NZ: usize, const R: usize>(
    values: &[*const f32; TILE],
    ts: Range<usize>,
    w: *const f32,
    acc: *mut f32,
) {
    let hd = 8 * CH;
    // SAFETY (the whole body): guaranteed by the caller; unaligned loads and stores.
    unsafe {
        for c0 in (0..hd).step_by(16 * NZ) {
            let mut a = [[_mm512_setzero_ps(); NZ]; R];
            for (r, a) in a.iter_mut().enumerate() {
                for (i, a) in a.iter_mut().enumerate() {
                    *a = _mm512_loadu_ps(acc.add(r * hd + c0 + 16 * i));
                }
            }
            for t in ts.clone() {
                let v: [__m512; NZ] =
                    std::array::from_fn(|i| _mm512_loadu_ps(values[t].add(c0 + 16 * i)));
                for (r, a) in a.iter_mut().enumerate() {
                    let wv = _mm512_set1_ps(*w.add(r * TILE + t));
                    for (a, v) in a.iter_mut().zip(&v) {
                        *a = _mm512_add_ps(*a, _mm512_mul_ps(wv, *v));
                    }
                }
            }
            for (r, a) in a.iter().enumerate() {
                for (i, a) in a.iter().enumerate() {
                    _mm512_storeu_ps(acc.add(r * hd + c0 + 16 * i), *a);
                }
            }
        }
    }
}
