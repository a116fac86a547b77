//! The AVX2 tile kernel over an F32, F16 or Q8_0 KV cache with `head_dim = 8·CH` (CH a multiple
//! of 4): the same float operations (an f16 element widened exactly by F16C, as `half` widens
//! it; a Q8_0 element as `f32(q) · d`, one rounding, as `KvElem::chunk8` computes it), in the
//! same order, as the portable kernel (eight-lane `acc + q·k` partial sums reduced as `((a0 +
//! a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`, then `acc + w·v` per position in order), so
//! results are bit-identical. Only the code shape differs: a tile's F16 or Q8_0 rows are widened
//! to f32 once for every query row of the item, two query heads go through four positions at a
//! time (each key load feeds two heads, each query load four positions), and two heads'
//! running sums stay in registers, a quarter of a 128-wide row at a time, across a tile's
//! positions.

use std::arch::x86_64::*;

use std::ops::Range;

use super::tile::{self, TileKernel, TILE};
use super::{Attend, Item, KvElem, Part, Q8Block};

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
    /// Elements in one unit.
    const ELEMS: usize = 1;
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
    const ELEMS: usize = 32;
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

/// Into `ptrs`: where each of `rows`' key (`value == false`) or value rows can be read as
/// `8·CH` f32s — the cache's own rows for an F32 cache; else each row widened once into `wide`.
///
/// # Safety
/// Every offset of `rows` must leave `8·CH` elements readable in `mem`, and `rows` must be at
/// most [`TILE`] long. The pointers are valid until `wide` changes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f32_rows<T: Lanes, const CH: usize>(
    mem: &[T],
    rows: &[(usize, usize)],
    value: bool,
    wide: &mut Vec<f32>,
    ptrs: &mut [*const f32; TILE],
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
    if wide.len() < TILE * hd {
        wide.resize(TILE * hd, 0.0);
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

/// Asks for the key and value rows at the unit offsets `rows` of `mem` (`8·CH` elements each) to
/// be brought into L1: a hint, which never faults.
#[inline(always)]
pub(super) fn prefetch_rows<T: Lanes, const CH: usize>(mem: &[T], rows: &[(usize, usize)]) {
    let bytes = 8 * CH * std::mem::size_of::<T>() / T::ELEMS;
    for &(k, v) in rows {
        for at in [k, v] {
            let row = mem.as_ptr().wrapping_add(at).cast::<i8>();
            for line in (0..bytes).step_by(64) {
                // SAFETY: a prefetch is a hint and never faults; SSE is in the baseline.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(line)) };
            }
        }
    }
}

/// Runs `items` with the kernel for the head size of `a`, if it has one (32, 64, 128 or 256):
/// false when the caller must use the portable kernel.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run<T: Lanes>(a: &Attend<'_>, items: &[Item], part: &mut Part) -> bool {
    match a.layout.head_dim {
        32 => run_ch::<T, 4>(a, items, part),
        64 => run_ch::<T, 8>(a, items, part),
        128 => run_ch::<T, 16>(a, items, part),
        256 => run_ch::<T, 32>(a, items, part),
        _ => return false,
    }
    true
}

#[target_feature(enable = "avx2,fma,f16c")]
fn run_ch<T: Lanes, const CH: usize>(a: &Attend<'_>, items: &[Item], part: &mut Part) {
    let mut wide = std::mem::take(&mut part.wide);
    let mut kernel = Kernel::<T, CH> {
        mem: a.mem::<T>(),
        wide: &mut wide,
        ptrs: [std::ptr::null(); TILE],
    };
    a.each_item(items, part, |a, it, st, out| {
        tile::item::<T>(a, it.parts(), &mut kernel, st, out)
    });
    part.wide = wide;
}

/// The loaded tile: where each of its rows can be read as `8·CH` f32s.
struct Kernel<'a, T, const CH: usize> {
    mem: &'a [T],
    wide: &'a mut Vec<f32>,
    ptrs: [*const f32; TILE],
}

impl<T: Lanes, const CH: usize> TileKernel for Kernel<'_, T, CH> {
    #[inline(always)]
    fn prefetch(&self, rows: &[(usize, usize)]) {
        prefetch_rows::<T, CH>(self.mem, rows);
    }

    #[inline(always)]
    fn load(&mut self, rows: &[(usize, usize)], _base: usize, value: bool) {
        assert!(rows.len() <= TILE);
        // SAFETY: `kv_rows` checked every offset against the pool; the kernel runs only where
        // `run` found AVX2, FMA and F16C.
        unsafe { f32_rows::<T, CH>(self.mem, rows, value, self.wide, &mut self.ptrs) }
    }

    #[inline(always)]
    fn scores(&self, q: &[f32], js: Range<usize>, scale: f32, s: &mut [f32], base: usize) {
        let hd = 8 * CH;
        let heads = q.len() / hd;
        assert!(js.end <= TILE && s.len() >= heads * TILE && base + js.end <= TILE);
        let mut h = 0;
        while h < heads {
            let two = h + 1 < heads;
            let q0 = q[h * hd..].as_ptr();
            let q1 = if two { q[(h + 1) * hd..].as_ptr() } else { q0 };
            let s0 = s[h * TILE + base..].as_mut_ptr();
            let s1 = if two {
                s[(h + 1) * TILE + base..].as_mut_ptr()
            } else {
                s0
            };
            // SAFETY: `q0`/`q1` start `8·CH`-f32 rows of `q`, `s0`/`s1` rows with `js.end`
            // writable f32s (asserted); the loaded pointers read `8·CH` f32s (`load`); the CPU
            // features as in `load`. With one head left, `q1 = q0` and `s1 = s0`: the second
            // head's writes repeat the first's values.
            unsafe { scores2::<CH>(&self.ptrs, js.clone(), scale, [q0, q1], [s0, s1]) };
            h += 2;
        }
    }

    #[inline(always)]
    fn accumulate(&self, p: &[f32], base: usize, js: Range<usize>, acc: &mut [f32]) {
        let hd = 8 * CH;
        let heads = acc.len() / hd;
        assert!(js.end <= TILE && p.len() >= heads * TILE && base + js.end <= TILE);
        let mut h = 0;
        while h < heads {
            let w0 = &p[h * TILE + base..][..js.end];
            let a0 = acc[h * hd..].as_mut_ptr();
            if h + 1 < heads {
                let w1 = &p[(h + 1) * TILE + base..][..js.end];
                let a1 = acc[(h + 1) * hd..].as_mut_ptr();
                // SAFETY: `a0`/`a1` start distinct `8·CH`-f32 rows of `acc`; the loaded
                // pointers read `8·CH` f32s (`load`); the CPU features as in `load`.
                unsafe { accumulate2::<CH>(&self.ptrs, js.clone(), [w0, w1], [a0, a1]) };
            } else {
                // SAFETY: as above, for one row.
                unsafe { accumulate1::<CH>(&self.ptrs, js.clone(), w0, a0) };
            }
            h += 2;
        }
    }
}

/// The scores of two query heads (`q`, rows of `8·CH`) over the loaded key rows `js`, into
/// `s[r][j]`: four positions at a time, each key chunk loaded once for both heads.
///
/// # Safety
/// `q[r]` must point to `8·CH` readable f32s, `s[r]` to `js.end` writable ones, and `ptrs[j]`
/// for `j` in `js` to `8·CH` readable f32s; the CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn scores2<const CH: usize>(
    ptrs: &[*const f32; TILE],
    js: Range<usize>,
    scale: f32,
    q: [*const f32; 2],
    s: [*mut f32; 2],
) {
    let sc = _mm_set1_ps(scale);
    let mut j = js.start;
    // SAFETY (the whole body): guaranteed by the caller; unaligned loads and stores.
    unsafe {
        while j + 4 <= js.end {
            let mut acc = [[_mm256_setzero_ps(); 4]; 2];
            for c in 0..CH {
                let qv = [load(q[0].add(8 * c)), load(q[1].add(8 * c))];
                for (i, &k) in ptrs[j..j + 4].iter().enumerate() {
                    let k = load(k.add(8 * c));
                    acc[0][i] = _mm256_add_ps(acc[0][i], _mm256_mul_ps(qv[0], k));
                    acc[1][i] = _mm256_add_ps(acc[1][i], _mm256_mul_ps(qv[1], k));
                }
            }
            for (r, a) in acc.iter().enumerate() {
                let v = _mm_mul_ps(hsum4(a[0], a[1], a[2], a[3]), sc);
                _mm_storeu_ps(s[r].add(j), v);
            }
            j += 4;
        }
        while j < js.end {
            let mut acc = [_mm256_setzero_ps(); 2];
            for c in 0..CH {
                let k = load(ptrs[j].add(8 * c));
                acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(load(q[0].add(8 * c)), k));
                acc[1] = _mm256_add_ps(acc[1], _mm256_mul_ps(load(q[1].add(8 * c)), k));
            }
            let z = _mm256_setzero_ps();
            for (r, a) in acc.iter().enumerate() {
                *s[r].add(j) = _mm_cvtss_f32(hsum4(*a, z, z, z)) * scale;
            }
            j += 1;
        }
    }
}

/// `acc[r] += w[r][j] · v_j` for two heads over the loaded value rows `js` in order, four
/// chunks (32 elements) of both rows in registers at a time.
///
/// # Safety
/// `acc[r]` must point to `8·CH` writable f32s (distinct rows), and `ptrs[j]` for `j` in `js`
/// to `8·CH` readable f32s; `w[r]` must hold `js.end` weights; the CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn accumulate2<const CH: usize>(
    ptrs: &[*const f32; TILE],
    js: Range<usize>,
    w: [&[f32]; 2],
    acc: [*mut f32; 2],
) {
    // SAFETY (the whole body): guaranteed by the caller; unaligned loads and stores.
    unsafe {
        for c0 in (0..CH).step_by(4) {
            let mut a = [[_mm256_setzero_ps(); 4]; 2];
            for (r, a) in a.iter_mut().enumerate() {
                for (i, a) in a.iter_mut().enumerate() {
                    *a = load(acc[r].add(8 * (c0 + i)));
                }
            }
            for j in js.clone() {
                let (w0, w1) = (_mm256_set1_ps(w[0][j]), _mm256_set1_ps(w[1][j]));
                let [a0, a1] = &mut a;
                for (i, (a0, a1)) in a0.iter_mut().zip(a1.iter_mut()).enumerate() {
                    let v = load(ptrs[j].add(8 * (c0 + i)));
                    *a0 = _mm256_add_ps(*a0, _mm256_mul_ps(w0, v));
                    *a1 = _mm256_add_ps(*a1, _mm256_mul_ps(w1, v));
                }
            }
            for (r, a) in a.iter().enumerate() {
                for (i, a) in a.iter().enumerate() {
                    _mm256_storeu_ps(acc[r].add(8 * (c0 + i)), *a);
                }
            }
        }
    }
}

/// [`accumulate2`] for one head.
///
/// # Safety
/// As for [`accumulate2`], for one row.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn accumulate1<const CH: usize>(
    ptrs: &[*const f32; TILE],
    js: Range<usize>,
    w: &[f32],
    acc: *mut f32,
) {
    // SAFETY (the whole body): guaranteed by the caller; unaligned loads and stores.
    unsafe {
        for c0 in (0..CH).step_by(4) {
            let mut a = [_mm256_setzero_ps(); 4];
            for (i, a) in a.iter_mut().enumerate() {
                *a = load(acc.add(8 * (c0 + i)));
            }
            for j in js.clone() {
                let w = _mm256_set1_ps(w[j]);
                for (i, a) in a.iter_mut().enumerate() {
                    let v = load(ptrs[j].add(8 * (c0 + i)));
                    *a = _mm256_add_ps(*a, _mm256_mul_ps(w, v));
                }
            }
            for (i, a) in a.iter().enumerate() {
                _mm256_storeu_ps(acc.add(8 * (c0 + i)), *a);
            }
        }
    }
}
