//! Paged attention: keys and values are written into, and read from, block slots of the KV
//! region directly, following each sequence's block table.

use crate::kernels::Threads;
use crate::kv::memory::{KvCache, KvDtype, KvElem, KvLayout, Q8Block};
use crate::kv::BlockId;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod tile;

/// Where one batch token's keys and values go and what it may attend to.
#[derive(Clone, Copy, Debug)]
pub struct TokenSlot<'a> {
    /// Position of the token in its sequence.
    pub pos: usize,
    /// The sequence's block table (covers positions `0..=pos`).
    pub blocks: &'a [BlockId],
}

/// Stores token `k`/`v` rows (`n_kv_heads * head_dim` each) of `layer` into their slots.
pub fn write_kv(cache: &mut KvCache, layer: usize, slots: &[TokenSlot], k: &[f32], v: &[f32]) {
    match cache.layout().dtype {
        KvDtype::F32 => write_typed::<f32>(cache, layer, slots, k, v),
        KvDtype::F16 => write_typed::<half::f16>(cache, layer, slots, k, v),
        KvDtype::Q8_0 => write_typed::<Q8Block>(cache, layer, slots, k, v),
    }
}

fn write_typed<T: KvElem>(
    cache: &mut KvCache,
    layer: usize,
    slots: &[TokenSlot],
    k: &[f32],
    v: &[f32],
) {
    let layout = *cache.layout();
    let (n, units) = (layout.token_elems(), layout.token_units());
    let mem = cache.elems_mut::<T>();
    for (t, s) in slots.iter().enumerate() {
        let block = s.blocks[s.pos / layout.block_size].0 as usize;
        let slot = s.pos % layout.block_size;
        for (value, src) in [(false, k), (true, v)] {
            let off = layout.offset(block, layer, value, slot);
            T::store_row(&src[t * n..(t + 1) * n], &mut mem[off..off + units]);
        }
    }
}

/// How one layer attends: the query scale, optional score soft-capping and an optional
/// sliding window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Multiplies every `q·k` (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// `cap * tanh(score / cap)` before the softmax (Gemma 2).
    pub softcap: Option<f32>,
    /// A token at `p` sees positions `p - window + 1 ..= p` only.
    pub window: Option<usize>,
}

impl AttnParams {
    /// Plain causal attention over heads of `head_dim`.
    pub fn plain(head_dim: usize) -> Self {
        AttnParams {
            scale: 1.0 / (head_dim as f32).sqrt(),
            softcap: None,
            window: None,
        }
    }

    /// The first position a token at `pos` attends to.
    #[inline(always)]
    fn first(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Scratch space reused across calls: one part per thread that attention is split over.
#[derive(Default)]
pub struct AttnScratch {
    parts: Vec<Part>,
    /// Each query row's max score, then its sum of weights, while segments are merged.
    ml: Vec<f32>,
}

/// One thread's scratch space.
#[derive(Default)]
struct Part {
    state: tile::State,
    /// The loaded tile's rows widened to f32 (the SIMD kernels over an F16 or Q8_0 cache).
    wide: Vec<f32>,
    /// The outputs of this part's items, in item order.
    out: Vec<f32>,
}

/// Fewer (position × query head) pairs than this in a whole call run on the calling thread: a
/// decode step at a short context costs less than waking the pool.
const THREADED_PAIRS: usize = 1 << 14;

/// One work item: consecutive batch tokens of one sequence (at consecutive positions) through
/// one kv head, over the positions of one segment.
#[derive(Clone, Debug, PartialEq)]
struct Item {
    tokens: std::ops::Range<usize>,
    kv_head: usize,
    segment: std::ops::Range<usize>,
}

/// Causal attention of every batch token over its sequence's cached positions `0..=pos` (the
/// last `window` of them for a window layer). `q` holds `n_heads * head_dim` per token; `out`
/// receives the same shape.
///
/// The work is a list of items (up to 32 consecutive tokens of one sequence through one kv
/// head, over one segment of 1,024 positions), split into contiguous runs of about equal cost
/// over `threads`; the segments' partial results are merged in order. Positions go by in tiles
/// of 32 with a running softmax. A query row's result depends on nothing but its query, its
/// positions and the cache, so it is bit-identical for any thread count, batch and chunking.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    cache: &KvCache,
    layer: usize,
    slots: &[TokenSlot],
    q: &[f32],
    n_heads: usize,
    params: &AttnParams,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    threads: &Threads,
) {
    let layout = *cache.layout();
    let a = Attend {
        layout,
        region: &cache.region()[..cache.num_blocks() * layout.block_bytes()],
        layer,
        slots,
        q,
        n_heads,
        params,
    };
    let items = a.items();
    let runs = a.split(&items, threads.count());
    scratch.parts.resize_with(runs.len(), Part::default);
    let jobs: Vec<_> = runs
        .iter()
        .map(|r| &items[r.clone()])
        .zip(scratch.parts.iter_mut())
        .collect();
    let a = &a;
    threads.run(jobs, |(items, part)| a.run(items, part));
    let parts = runs.iter().map(|r| &items[r.clone()]);
    let parts = parts.zip(scratch.parts.iter().map(|p| &p.out[..]));
    a.finish(parts, out, &mut scratch.ml);
}

/// The inputs of one [`attend`] call.
#[derive(Clone, Copy)]
struct Attend<'a> {
    layout: KvLayout,
    /// The pool's blocks, as bytes (aligned for the element type: checked by `KvCache::new`).
    region: &'a [u8],
    layer: usize,
    slots: &'a [TokenSlot<'a>],
    q: &'a [f32],
    n_heads: usize,
    params: &'a AttnParams,
}

impl Item {
    /// Its tokens, kv head and segment, as [`tile::item`] takes them.
    fn parts(&self) -> (std::ops::Range<usize>, usize, std::ops::Range<usize>) {
        (self.tokens.clone(), self.kv_head, self.segment.clone())
    }
}

impl Attend<'_> {
    /// The pool as units of `T`.
    #[inline(always)]
    fn mem<T: KvElem>(&self) -> &[T] {
        bytemuck::cast_slice(self.region)
    }

    /// Positions batch token `t` attends to.
    fn positions(&self, t: usize) -> std::ops::Range<usize> {
        let s = &self.slots[t];
        self.params.first(s.pos)..s.pos + 1
    }

    /// The work items, in batch order: runs of at most [`tile::TOKENS`] tokens that follow each
    /// other in one sequence (the same block table, the next position), each through every kv
    /// head, over each [`tile::SEGMENT`] of positions the run attends to (in order).
    fn items(&self) -> Vec<Item> {
        // One sequence's tokens share its block table (each token's may end sooner).
        let follows = |a: &TokenSlot, b: &TokenSlot| {
            std::ptr::eq(a.blocks.as_ptr(), b.blocks.as_ptr()) && a.pos + 1 == b.pos
        };
        let mut items = Vec::new();
        let mut start = 0;
        for t in 1..=self.slots.len() {
            let split = t == self.slots.len()
                || t - start == tile::TOKENS
                || !follows(&self.slots[t - 1], &self.slots[t]);
            if split {
                let lo = self.positions(start).start;
                let hi = self.positions(t - 1).end;
                let seg = tile::SEGMENT;
                for kv_head in 0..self.layout.n_kv_heads {
                    items.extend((lo / seg..hi.div_ceil(seg)).map(|s| Item {
                        tokens: start..t,
                        kv_head,
                        segment: (s * seg).max(lo)..((s + 1) * seg).min(hi),
                    }));
                }
                start = t;
            }
        }
        items
    }

    /// Contiguous runs of items of about equal cost (positions attended, plus a fixed cost per
    /// token), at most `n` of them; one run when the call is too small to share.
    fn split(&self, items: &[Item], n: usize) -> Vec<std::ops::Range<usize>> {
        let cost = |it: &Item| -> usize {
            let seg = &it.segment;
            (it.tokens.clone())
                .map(|t| {
                    let r = self.positions(t);
                    r.end.min(seg.end).saturating_sub(r.start.max(seg.start)) + 8
                })
                .sum()
        };
        let total: usize = items.iter().map(cost).sum();
        let group = self.n_heads / self.layout.n_kv_heads;
        if n <= 1 || items.len() < 2 || total * group < THREADED_PAIRS {
            return std::iter::once(0..items.len()).collect();
        }
        let mut runs = Vec::with_capacity(n);
        let (mut start, mut acc) = (0, 0);
        for (i, it) in items.iter().enumerate() {
            acc += cost(it);
            if acc * n >= total * (runs.len() + 1) && runs.len() + 1 < n {
                runs.push(start..i + 1);
                start = i + 1;
            }
        }
        if start < items.len() {
            runs.push(start..items.len());
        }
        runs
    }

    /// Every item's partial rows (`(items, rows)` of each run, in order, as [`Attend::run`]
    /// leaves them) merged into their query rows in item (and so segment) order, then divided
    /// by their sums of weights, into `out`; `ml` is scratch space.
    fn finish<'r>(
        &self,
        runs: impl IntoIterator<Item = (&'r [Item], &'r [f32])>,
        out: &mut [f32],
        ml: &mut Vec<f32>,
    ) {
        let rows = self.slots.len() * self.n_heads;
        ml.clear();
        ml.resize(2 * rows, 0.0);
        let (m, l) = ml.split_at_mut(rows);
        m.fill(f32::NEG_INFINITY);
        out.fill(0.0);
        for (items, partial) in runs {
            self.merge(items, partial, out, (m, l));
        }
        for (o, l) in out.chunks_exact_mut(self.layout.head_dim).zip(l.iter()) {
            let inv = 1.0 / l;
            for o in o {
                *o *= inv;
            }
        }
    }

    /// Merges the partial rows of `items` (each token's `group` rows of `head_dim + 2`, item by
    /// item, as [`Attend::run`] leaves them) into their query rows' weighted sums in `out` and
    /// maxima and sums of weights in `m` and `l` (see [`tile::merge`]).
    fn merge(
        &self,
        items: &[Item],
        rows: &[f32],
        out: &mut [f32],
        (m, l): (&mut [f32], &mut [f32]),
    ) {
        let (hd, group) = (self.layout.head_dim, self.n_heads / self.layout.n_kv_heads);
        let mut src = rows.chunks_exact(hd + 2);
        for it in items {
            for t in it.tokens.clone() {
                for h in 0..group {
                    let r = t * self.n_heads + it.kv_head * group + h;
                    let part = src.next().expect("one row per query row");
                    tile::merge(&mut out[r * hd..][..hd], (&mut m[r], &mut l[r]), part);
                }
            }
        }
    }

    /// Computes `items` into `part.out` (each token's `group` partial rows of `head_dim + 2`,
    /// item by item).
    fn run(&self, items: &[Item], part: &mut Part) {
        #[cfg(target_arch = "x86_64")]
        for simd in [Simd::Avx512, Simd::Avx2] {
            if simd.available() && self.run_simd(simd, items, part) {
                return;
            }
        }
        self.run_portable(items, part);
    }

    /// [`Attend::run`] with the `simd` kernel (which the CPU must have): false when it has no
    /// kernel for this head size.
    #[cfg(target_arch = "x86_64")]
    fn run_simd(&self, simd: Simd, items: &[Item], part: &mut Part) -> bool {
        assert!(simd.available());
        // SAFETY: the CPU has the kernel's features (asserted just above).
        unsafe {
            match (simd, self.layout.dtype) {
                (Simd::Avx512, KvDtype::F32) => avx512::run::<f32>(self, items, part),
                (Simd::Avx512, KvDtype::F16) => avx512::run::<half::f16>(self, items, part),
                (Simd::Avx512, KvDtype::Q8_0) => avx512::run::<Q8Block>(self, items, part),
                (Simd::Avx2, KvDtype::F32) => avx2::run::<f32>(self, items, part),
                (Simd::Avx2, KvDtype::F16) => avx2::run::<half::f16>(self, items, part),
                (Simd::Avx2, KvDtype::Q8_0) => avx2::run::<Q8Block>(self, items, part),
            }
        }
    }

    /// [`Attend::run`] with the portable kernel.
    fn run_portable(&self, items: &[Item], part: &mut Part) {
        match self.layout.dtype {
            KvDtype::F32 => self.portable::<f32>(items, part),
            KvDtype::F16 => self.portable::<half::f16>(items, part),
            KvDtype::Q8_0 => self.portable::<Q8Block>(items, part),
        }
    }

    /// [`Attend::run_portable`] for a cache of `T`.
    fn portable<T: KvElem>(&self, items: &[Item], part: &mut Part) {
        let mut kernel = tile::Portable {
            mem: self.mem::<T>(),
            head_dim: self.layout.head_dim,
            head_units: self.layout.head_units(),
            rows: Vec::new(),
        };
        self.each_item(items, part, |a, it, st, out| {
            tile::item::<T>(a, it.parts(), &mut kernel, st, out)
        });
    }

    /// Calls `f` for each item with its state and its slice of `part.out` (sized here: each
    /// token's `group` partial rows of `head_dim + 2`, item by item).
    #[inline(always)]
    fn each_item(
        &self,
        items: &[Item],
        part: &mut Part,
        mut f: impl FnMut(&Self, &Item, &mut tile::State, &mut [f32]),
    ) {
        let w = self.n_heads / self.layout.n_kv_heads * (self.layout.head_dim + 2);
        let rows: usize = items.iter().map(|it| it.tokens.len()).sum();
        part.out.resize(rows * w, 0.0);
        let mut rest = &mut part.out[..];
        for it in items {
            let (mine, tail) = std::mem::take(&mut rest).split_at_mut(it.tokens.len() * w);
            rest = tail;
            f(self, it, &mut part.state, mine);
        }
    }
}

/// Into `rows`: the unit offsets of the key and value rows of kv head `g` at `positions` of
/// sequence `s` in `layer`, each checked to lie in a pool of `pool_len` units (the SIMD
/// kernels load them unchecked).
#[inline(always)]
fn kv_rows(
    layout: &KvLayout,
    s: &TokenSlot,
    layer: usize,
    g: usize,
    positions: std::ops::Range<usize>,
    pool_len: usize,
    rows: &mut Vec<(usize, usize)>,
) {
    let (hd, bs) = (layout.head_units(), layout.block_size);
    rows.clear();
    for p in positions {
        let (block, slot) = (s.blocks[p / bs].0 as usize, p % bs);
        let k = layout.offset(block, layer, false, slot) + g * hd;
        let v = layout.offset(block, layer, true, slot) + g * hd;
        assert!(
            k + hd <= pool_len && v + hd <= pool_len,
            "KV row outside the pool"
        );
        rows.push((k, v));
    }
}

/// The SIMD kernels, fastest first.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug)]
enum Simd {
    /// AVX512F, VL and DQ (with AVX2, FMA and F16C).
    Avx512,
    /// AVX2, FMA and F16C.
    Avx2,
}

#[cfg(target_arch = "x86_64")]
impl Simd {
    /// Whether this CPU has the kernel's features.
    fn available(self) -> bool {
        match self {
            Simd::Avx512 => has_avx512(),
            Simd::Avx2 => has_avx2(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    static AVX512: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX512.get_or_init(|| {
        has_avx2()
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
    })
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// `e^x` for `x <= 0` (a score minus its row's max), within 2 ulp of the exact value; 0 below
/// −87, where `e^x` leaves the normal floats (a weight under 2⁻¹²⁵ of the largest one); NaN stays
/// NaN. Cody–Waite reduction `x = n·ln 2 + r`, `|r| <= ln 2 / 2`, and Cephes' degree-7
/// polynomial for `e^r`; `2^n` is built in the exponent bits. Only IEEE operations without
/// fusion, and branch-free, so it vectorises and gives the same bits on every machine.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    // ln 2 split so that n·LN2_HI is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 2^23 + 127: adding it leaves n + 127 in a float's low mantissa bits.
    const BIAS: f32 = 8_388_735.0;
    // `clamp` keeps NaN.
    let xc = x.clamp(-87.0, 0.0);
    let n = (xc * std::f32::consts::LOG2_E + 0.5).floor();
    let r = xc - n * LN2_HI;
    let r = r - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = p * r + c;
    }
    let e = p * (r * r) + r + 1.0;
    // n + 127 is in 1..=127: shifted into the exponent field, it is 2^n.
    let two_n = f32::from_bits((n + BIAS).to_bits() << 23);
    if x < -87.0 {
        0.0
    } else {
        e * two_n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The softmax's `e^x` is within 2 ulp of the exact value over its whole domain (every
    /// 97th float from 0 down to −87, and the ends), is 0 below it, and keeps NaN.
    #[test]
    fn exp_is_within_two_ulp_over_the_softmax_domain() {
        let ulps = |x: f32| {
            let (got, want) = (exp_nonpositive(x) as f64, (x as f64).exp());
            let ulp = f32::EPSILON as f64 * 2f64.powi(want.log2().floor() as i32);
            (got - want).abs() / ulp
        };
        let mut worst = (0.0f64, 0.0f32);
        // Negative floats' bits grow with their magnitude.
        let (mut bits, end) = ((-0.0f32).to_bits(), (-87.0f32).to_bits());
        while bits <= end {
            let x = f32::from_bits(bits);
            let u = ulps(x);
            if u > worst.0 {
                worst = (u, x);
            }
            bits += 97;
        }
        for x in [0.0, -1e-30, -0.5, -86.999_99, -87.0] {
            if ulps(x) > worst.0 {
                worst = (ulps(x), x);
            }
        }
        assert!(worst.0 <= 2.0, "{} ulp at {}", worst.0, worst.1);
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-87.1), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(f32::NAN).is_nan());
    }

    /// Writes positions `0..len` of a sequence in `blocks` of `layer`: element `i` of position
    /// `p`'s key row is `k(p, i)`, of its value row `v(p, i)`.
    fn fill(
        cache: &mut KvCache,
        layer: usize,
        blocks: &[BlockId],
        len: usize,
        k: impl Fn(usize, usize) -> f32,
        v: impl Fn(usize, usize) -> f32,
    ) {
        let n = cache.layout().token_elems();
        for p in 0..len {
            let kr: Vec<f32> = (0..n).map(|i| k(p, i)).collect();
            let vr: Vec<f32> = (0..n).map(|i| v(p, i)).collect();
            let slot = [TokenSlot { pos: p, blocks }];
            write_kv(cache, layer, &slot, &kr, &vr);
        }
    }

    /// One batch token at each of `positions` of the sequence in `blocks`.
    fn slots_at<'a>(positions: &[usize], blocks: &'a [BlockId]) -> Vec<TokenSlot<'a>> {
        positions
            .iter()
            .map(|&pos| TokenSlot { pos, blocks })
            .collect()
    }

    fn layout(dtype: KvDtype, head_dim: usize) -> KvLayout {
        KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim,
            block_size: 4,
            dtype,
        }
    }

    /// Dense reference: attention over contiguous K/V rows (all of them: the caller passes the
    /// window), scores scaled by `scale` and soft-capped by `cap`.
    fn reference(
        q: &[f32],
        (ks, vs): (&[Vec<f32>], &[Vec<f32>]),
        n_heads: usize,
        (hd, kvh): (usize, usize),
        (scale, cap): (f64, Option<f64>),
    ) -> Vec<f32> {
        let group = n_heads / kvh;
        let mut out = vec![0.0; n_heads * hd];
        for h in 0..n_heads {
            let g = h / group;
            let qh = &q[h * hd..(h + 1) * hd];
            let scores: Vec<f64> = ks
                .iter()
                .map(|k| {
                    let s = qh
                        .iter()
                        .zip(&k[g * hd..(g + 1) * hd])
                        .map(|(a, b)| (a * b) as f64)
                        .sum::<f64>()
                        * scale;
                    cap.map_or(s, |c| c * (s / c).tanh())
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (j, v) in vs.iter().enumerate() {
                for d in 0..hd {
                    out[h * hd + d] += (e[j] / z * v[g * hd + d] as f64) as f32;
                }
            }
        }
        out
    }

    #[test]
    fn paged_attention_matches_dense_over_scattered_blocks() {
        // Q8_0 stores blocks of 32 elements: its heads are 32 wide.
        for (dtype, hd) in [(KvDtype::F32, 8), (KvDtype::F16, 8), (KvDtype::Q8_0, 32)] {
            let lay = layout(dtype, hd);
            let mut cache = KvCache::on_heap(lay, 8);
            // A sequence of 10 tokens in non-contiguous blocks 5, 1, 6.
            let blocks = [BlockId(5), BlockId(1), BlockId(6)];
            let n = lay.token_elems();
            let val = |p: usize, i: usize, s: f32| ((p * 31 + i * 7) % 13) as f32 * s - 0.5;
            let ks: Vec<Vec<f32>> = (0..10)
                .map(|p| (0..n).map(|i| val(p, i, 0.1)).collect())
                .collect();
            let vs: Vec<Vec<f32>> = (0..10)
                .map(|p| (0..n).map(|i| val(p, i + 3, 0.2)).collect())
                .collect();
            for p in 0..10 {
                let slot = [TokenSlot {
                    pos: p,
                    blocks: &blocks,
                }];
                write_kv(&mut cache, 1, &slot, &ks[p], &vs[p]);
            }
            let n_heads = 4;
            let q: Vec<f32> = (0..n_heads * hd)
                .map(|i| (i % 5) as f32 * 0.3 - 0.6)
                .collect();
            let slot = [TokenSlot {
                pos: 9,
                blocks: &blocks,
            }];
            // Q8_0's step is 1/127 of a block's largest element (0.7 here).
            let tol = match dtype {
                KvDtype::F32 => 1e-5,
                KvDtype::F16 => 5e-3,
                KvDtype::Q8_0 => 2e-2,
            };
            // Plain causal attention, then a window of 6 (positions 4..=9, across blocks 1
            // and 6) with soft-capped scores at a scale of its own.
            let windowed = AttnParams {
                scale: 0.9,
                softcap: Some(0.5),
                window: Some(6),
            };
            for (params, lo, cap) in [(AttnParams::plain(hd), 0, None), (windowed, 4, Some(0.5))] {
                let mut out = vec![0.0; n_heads * hd];
                attend(
                    &cache,
                    1,
                    &slot,
                    &q,
                    n_heads,
                    &params,
                    &mut out,
                    &mut AttnScratch::default(),
                    &Threads::single(),
                );
                let want = reference(
                    &q,
                    (&ks[lo..], &vs[lo..]),
                    n_heads,
                    (hd, 2),
                    (params.scale as f64, cap),
                );
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < tol, "{dtype:?} {params:?}: {a} vs {b}");
                }
            }
        }
    }

    /// Each SIMD kernel this CPU has (AVX-512, AVX2) gives the portable kernel's bits: F32, F16
    /// and Q8_0 caches, head_dim 32/64/128/256, 3 and 5 query heads per kv head, plain and
    /// windowed soft-capped attention, at positions that start, end and cross tiles (partial
    /// groups of 4 and 8 positions).
    #[test]
    fn simd_attention_is_bit_identical_to_portable() {
        let cases = [32, 64, 128, 256].map(|hd| KvDtype::ALL.map(|d| (hd, d)));
        // Groups of 3 and 5 query heads per kv head: every remainder of the kernels' head
        // blocks.
        let cases = cases.into_iter().flatten().flat_map(|c| [(c, 9), (c, 15)]);
        for ((hd, dtype), n_heads) in cases {
            let lay = KvLayout {
                n_layers: 2,
                n_kv_heads: 3,
                head_dim: hd,
                block_size: 16,
                dtype,
            };
            // Ten blocks: 150 positions cross the L1 spans of the SIMD path at every head size.
            let mut cache = KvCache::on_heap(lay, 12);
            let blocks = [6, 2, 7, 0, 11, 3, 9, 1, 10, 4].map(BlockId);
            let val = |p: usize, i: usize, s: f32| (((p * 131 + i * 71) % 97) as f32 - 48.0) * s;
            let (k, v) = (|p, i| val(p, i, 0.013), |p, i| val(p, i + 5, 0.021));
            fill(&mut cache, 1, &blocks, 150, k, v);
            let positions = [
                0, 1, 2, 3, 4, 5, 15, 16, 17, 31, 38, 52, 64, 65, 100, 129, 149,
            ];
            let slots = slots_at(&positions, &blocks);
            let q: Vec<f32> = (0..slots.len() * n_heads * hd)
                .map(|i| ((i * 37 % 29) as f32 - 14.0) * 0.05)
                .collect();
            let windowed = AttnParams {
                scale: 0.3,
                softcap: Some(2.0),
                window: Some(19),
            };
            for params in [AttnParams::plain(hd), windowed] {
                let a = Attend {
                    layout: lay,
                    region: cache.region(),
                    layer: 1,
                    slots: &slots,
                    q: &q,
                    n_heads,
                    params: &params,
                };
                let portable = run_with(&a, |a, items, part| {
                    a.run_portable(items, part);
                    true
                });
                #[cfg(target_arch = "x86_64")]
                for simd in [Simd::Avx512, Simd::Avx2] {
                    if !simd.available() {
                        eprintln!("SKIPPED: this CPU has no {simd:?}; its kernel is not compared");
                        continue;
                    }
                    let fast = run_with(&a, |a, items, part| a.run_simd(simd, items, part));
                    for (i, (a, b)) in fast.iter().zip(&portable).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{simd:?} hd {hd} {dtype:?} {n_heads} heads {params:?} element {i}: \
                             {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    /// The output of [`attend`] for `a`, with `kernel` running its items on one thread (it
    /// must have a kernel for the head size).
    fn run_with(
        a: &Attend<'_>,
        kernel: impl Fn(&Attend<'_>, &[Item], &mut Part) -> bool,
    ) -> Vec<f32> {
        let hd = a.layout.head_dim;
        let items = a.items();
        let mut part = Part::default();
        assert!(kernel(a, &items, &mut part), "no kernel for head size {hd}");
        let mut out = vec![0.0; a.slots.len() * a.n_heads * hd];
        a.finish([(&items[..], &part.out[..])], &mut out, &mut Vec::new());
        out
    }

    /// A token's output does not depend on which tokens share its call: 40 consecutive tokens of
    /// one sequence (work items of several tokens, tiles cut at different places for each) give
    /// the bits of each token attended alone, with plain and windowed, soft-capped attention.
    #[test]
    fn attention_is_bit_identical_for_any_batch() {
        for dtype in KvDtype::ALL {
            let lay = KvLayout {
                n_layers: 1,
                n_kv_heads: 2,
                head_dim: 64,
                block_size: 16,
                dtype,
            };
            let blocks: Vec<BlockId> = (0..12).map(|b| BlockId((b * 5) % 12)).collect();
            let mut cache = KvCache::on_heap(lay, 12);
            let val = |p: usize, i: usize| (((p * 29 + i * 17) % 53) as f32 - 26.0) * 0.02;
            fill(&mut cache, 0, &blocks, 180, val, |p, i| val(p, i + 7));
            let n_heads = 6;
            let positions: Vec<usize> = (137..177).collect();
            let slots = slots_at(&positions, &blocks);
            let q: Vec<f32> = (0..slots.len() * n_heads * 64)
                .map(|i| ((i * 11 % 31) as f32 - 15.0) * 0.06)
                .collect();
            let windowed = AttnParams {
                scale: 0.2,
                softcap: Some(3.0),
                window: Some(45),
            };
            for params in [AttnParams::plain(64), windowed] {
                let run = |slots: &[TokenSlot], q: &[f32]| {
                    let mut out = vec![0.0; q.len()];
                    let mut scratch = AttnScratch::default();
                    let one = Threads::single();
                    attend(
                        &cache,
                        0,
                        slots,
                        q,
                        n_heads,
                        &params,
                        &mut out,
                        &mut scratch,
                        &one,
                    );
                    out
                };
                let together = run(&slots, &q);
                let w = n_heads * 64;
                for (t, slot) in slots.iter().enumerate() {
                    let alone = run(std::slice::from_ref(slot), &q[t * w..(t + 1) * w]);
                    let same = alone
                        .iter()
                        .zip(&together[t * w..(t + 1) * w])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype:?} {params:?}: token at {}", slot.pos);
                }
            }
        }
    }

    /// Attention split over threads gives the bits of one thread, for a prefill-like batch (one
    /// sequence's 40 consecutive tokens) and a decode-like batch of one token through one kv
    /// head (split by segments of positions only), at a context of three segments, on every cache
    /// type; the last token agrees with dense attention over all its positions.
    #[test]
    fn threaded_attention_is_bit_identical_to_one_thread() {
        for dtype in KvDtype::ALL {
            let lay = KvLayout {
                n_layers: 1,
                n_kv_heads: 1,
                head_dim: 64,
                block_size: 16,
                dtype,
            };
            let blocks: Vec<BlockId> = (0..160).map(|b| BlockId((b * 7) % 160)).collect();
            let mut cache = KvCache::on_heap(lay, 160);
            let val = |p: usize, i: usize| (((p * 53 + i * 29) % 61) as f32 - 30.0) * 0.01;
            let len = 2500;
            // Keys grow along the sequence: each segment's largest score differs.
            let key = |p: usize, i: usize| val(p, i) * (1.0 + p as f32 / 500.0);
            fill(&mut cache, 0, &blocks, len, key, |p, i| val(p, i + 11));
            let n_heads = 8;
            for positions in [(len - 40..len).collect::<Vec<_>>(), vec![len - 1]] {
                let slots = slots_at(&positions, &blocks);
                let q: Vec<f32> = (0..slots.len() * n_heads * 64)
                    .map(|i| ((i * 13 % 23) as f32 - 11.0) * 0.07)
                    .collect();
                let params = AttnParams::plain(64);
                let run = |threads: &Threads| {
                    let mut out = vec![0.0; q.len()];
                    let mut scratch = AttnScratch::default();
                    attend(
                        &cache,
                        0,
                        &slots,
                        &q,
                        n_heads,
                        &params,
                        &mut out,
                        &mut scratch,
                        threads,
                    );
                    (out, scratch.parts.len())
                };
                let (one, _) = run(&Threads::single());
                if dtype == KvDtype::F32 {
                    // Segments merged: still attention over all 2,500 positions.
                    let t = slots.len() - 1;
                    let rows = |f: &dyn Fn(usize, usize) -> f32| -> Vec<Vec<f32>> {
                        (0..len)
                            .map(|p| (0..64).map(|i| f(p, i)).collect())
                            .collect()
                    };
                    let (ks, vs) = (rows(&key), rows(&|p, i| val(p, i + 11)));
                    let w = n_heads * 64;
                    let want = reference(
                        &q[t * w..(t + 1) * w],
                        (&ks, &vs),
                        n_heads,
                        (64, 1),
                        (params.scale as f64, None),
                    );
                    for (a, b) in one[t * w..(t + 1) * w].iter().zip(&want) {
                        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
                    }
                }
                for t in [2, 3] {
                    let (many, parts) = run(&Threads::new(t));
                    assert!(parts > 1, "{dtype:?}: {} tokens ran unsplit", slots.len());
                    let same = one
                        .iter()
                        .zip(&many)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{dtype:?}, {t} threads, {} tokens", slots.len());
                }
            }
        }
    }
}
