//! Paged attention: keys and values are written into, and read from, block slots of the KV
//! region directly, following each sequence's block table.

use crate::kernels::Threads;
use crate::kv::memory::{KvCache, KvDtype, KvElem, KvLayout, Q8Block};
use crate::kv::BlockId;

#[cfg(target_arch = "x86_64")]
mod avx2;

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
}

/// One thread's scratch space.
#[derive(Default)]
struct Part {
    scores: Vec<f32>,
    acc: Vec<f32>,
    /// (key, value) unit offsets of the positions a kv head attends to.
    rows: Vec<(usize, usize)>,
    /// One span's key (or value) rows widened to f32, for the heads of a group to share (the
    /// AVX2 kernel over an F16 or Q8_0 cache).
    wide: Vec<f32>,
}

/// Fewer (position × query head) pairs than this in a whole call run on the calling thread: a
/// decode step at a short context costs less than waking the pool.
const THREADED_PAIRS: usize = 1 << 14;

/// Causal attention of every batch token over its sequence's cached positions `0..=pos` (the
/// last `window` of them for a window layer). `q` holds `n_heads * head_dim` per token; `out`
/// receives the same shape.
///
/// The work is a list of items, one per (batch token, kv head), split into contiguous runs of
/// about equal cost over `threads`; each item is computed start to end by one thread with the
/// same operations whatever the split, so the result is bit-identical for any thread count.
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
    let runs = a.split(threads.count());
    scratch.parts.resize_with(runs.len(), Part::default);
    let gw = n_heads / layout.n_kv_heads * layout.head_dim;
    let mut jobs = Vec::with_capacity(runs.len());
    let mut rest = out;
    for (items, part) in runs.into_iter().zip(scratch.parts.iter_mut()) {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(items.len() * gw);
        rest = tail;
        jobs.push((items, mine, part));
    }
    let a = &a;
    threads.run(jobs, |(items, out, part)| a.items(items, out, part));
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

/// One token's attention through one kv head: its `group` query heads and their output rows
/// (`group · head_dim` each), over `n` positions.
struct Group<'a> {
    n: usize,
    q: &'a [f32],
    out: &'a mut [f32],
}

impl Attend<'_> {
    /// The pool as units of `T`.
    #[inline(always)]
    fn mem<T: KvElem>(&self) -> &[T] {
        bytemuck::cast_slice(self.region)
    }

    /// Positions item `i` (token `i / n_kv_heads`) attends to.
    fn positions(&self, i: usize) -> std::ops::Range<usize> {
        let s = &self.slots[i / self.layout.n_kv_heads];
        self.params.first(s.pos)..s.pos + 1
    }

    /// Contiguous runs of items of about equal cost (positions attended, plus a fixed cost per
    /// item), at most `n` of them; one run when the call is too small to share.
    fn split(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        let items = self.slots.len() * self.layout.n_kv_heads;
        let cost = |i: usize| self.positions(i).len() + 8;
        let total: usize = (0..items).map(cost).sum();
        if n <= 1 || items < 2 || total * self.n_heads / self.layout.n_kv_heads < THREADED_PAIRS {
            return std::iter::once(0..items).collect();
        }
        let mut runs = Vec::with_capacity(n);
        let (mut start, mut acc) = (0, 0);
        for i in 0..items {
            acc += cost(i);
            if acc * n >= total * (runs.len() + 1) && runs.len() + 1 < n {
                runs.push(start..i + 1);
                start = i + 1;
            }
        }
        if start < items {
            runs.push(start..items);
        }
        runs
    }

    /// Computes `items` into `out` (their `group · head_dim` rows, in item order).
    fn items(&self, items: std::ops::Range<usize>, out: &mut [f32], part: &mut Part) {
        #[cfg(target_arch = "x86_64")]
        if has_avx2() {
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked at run time just above).
            let done = unsafe {
                match self.layout.dtype {
                    KvDtype::F32 => avx2::attend::<f32>(self, items.clone(), out, part),
                    KvDtype::F16 => avx2::attend::<half::f16>(self, items.clone(), out, part),
                    KvDtype::Q8_0 => avx2::attend::<Q8Block>(self, items.clone(), out, part),
                }
            };
            if !done {
                // SAFETY: as above.
                unsafe { attend_avx2(self, items, out, part) };
            }
            return;
        }
        attend_any(self, items, out, part);
    }

    /// Calls `f` for each item (batch token and kv head) of `items`, with the row offsets of the
    /// positions it attends to in `part.rows` (checked against the pool of `T`s) and
    /// `part.scores` zeroed to `group · n`.
    #[inline(always)]
    fn each_group<T: KvElem>(
        &self,
        items: std::ops::Range<usize>,
        out: &mut [f32],
        part: &mut Part,
        mut f: impl FnMut(Group<'_>, &mut Part),
    ) {
        let layout = self.layout;
        // Query heads per kv head, and the width of their rows.
        let group = self.n_heads / layout.n_kv_heads;
        let gw = group * layout.head_dim;
        let pool_len = self.mem::<T>().len();
        for (i, out) in items.zip(out.chunks_exact_mut(gw)) {
            let (t, g) = (i / layout.n_kv_heads, i % layout.n_kv_heads);
            let positions = self.positions(i);
            let n = positions.len();
            kv_rows(
                &layout,
                &self.slots[t],
                self.layer,
                g,
                positions,
                pool_len,
                &mut part.rows,
            );
            part.scores.clear();
            part.scores.resize(group * n, 0.0);
            let q = &self.q[i * gw..(i + 1) * gw];
            f(Group { n, q, out }, part);
        }
    }
}

/// Into `rows`: the unit offsets of the key and value rows of kv head `g` at `positions` of
/// sequence `s` in `layer`, each checked to lie in a pool of `pool_len` units (the AVX2
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

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// The same code compiled for 256-bit vectors. Per lane the float operations are the same as
/// the portable build's, so results are identical on every machine.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2(a: &Attend<'_>, items: std::ops::Range<usize>, out: &mut [f32], part: &mut Part) {
    attend_any(a, items, out, part);
}

#[inline(always)]
fn attend_any(a: &Attend<'_>, items: std::ops::Range<usize>, out: &mut [f32], part: &mut Part) {
    match a.layout.dtype {
        KvDtype::F32 => attend_typed::<f32>(a, items, out, part),
        KvDtype::F16 => attend_typed::<half::f16>(a, items, out, part),
        KvDtype::Q8_0 => attend_typed::<Q8Block>(a, items, out, part),
    }
}

/// `Σ a·b` over a row of `a.len()` elements.
#[inline(always)]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    // Eight independent partial sums over exact chunks: vectorises, and the order is fixed.
    let mut acc = [0.0f32; 8];
    let whole = a.len() / 8;
    for (c, x) in a.chunks_exact(8).enumerate() {
        let y = T::chunk8(b, c);
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (i, x) in a.iter().enumerate().skip(8 * whole) {
        s += x * T::get(b, i);
    }
    s
}

/// `acc += w * v` over a row of `acc.len()` elements.
#[inline(always)]
fn axpy<T: KvElem>(acc: &mut [f32], w: f32, v: &[T]) {
    let whole = acc.len() / 8;
    for (c, a) in acc.chunks_exact_mut(8).enumerate() {
        let x = T::chunk8(v, c);
        for l in 0..8 {
            a[l] += w * x[l];
        }
    }
    for (i, a) in acc.iter_mut().enumerate().skip(8 * whole) {
        *a += w * T::get(v, i);
    }
}

#[inline(always)]
fn attend_typed<T: KvElem>(
    a: &Attend<'_>,
    items: std::ops::Range<usize>,
    out: &mut [f32],
    part: &mut Part,
) {
    let (hd, hu) = (a.layout.head_dim, a.layout.head_units());
    let group = a.n_heads / a.layout.n_kv_heads;
    let (scale, softcap) = (a.params.scale, a.params.softcap);
    let mem = a.mem::<T>();
    a.each_group::<T>(items, out, part, |gr, scratch| {
        let n = gr.n;
        // scores[h * n + j] for the `group` query heads sharing the kv head.
        for (j, &(k, _)) in scratch.rows.iter().enumerate() {
            let k = &mem[k..k + hu];
            for h in 0..group {
                scratch.scores[h * n + j] = dot(&gr.q[h * hd..(h + 1) * hd], k) * scale;
            }
        }
        for h in 0..group {
            normalize(&mut scratch.scores[h * n..(h + 1) * n], softcap);
        }
        scratch.acc.clear();
        scratch.acc.resize(group * hd, 0.0);
        for (j, &(_, v)) in scratch.rows.iter().enumerate() {
            let v = &mem[v..v + hu];
            for h in 0..group {
                let w = scratch.scores[h * n + j];
                axpy(&mut scratch.acc[h * hd..(h + 1) * hd], w, v);
            }
        }
        gr.out.copy_from_slice(&scratch.acc);
    });
}

/// Soft-caps (when asked) and softmaxes one score row: shared by every attention path, so they
/// agree bit for bit.
#[inline(always)]
fn normalize(row: &mut [f32], softcap: Option<f32>) {
    if let Some(cap) = softcap {
        super::ops::softcap(row, cap);
    }
    softmax(row);
}

/// In-place softmax of one score row (shared by every attention path, so they agree bit for
/// bit). Every pass is written so the compiler vectorises it: a polynomial `e^x` instead of the
/// C library's call per score (2 million calls per decode step of the Llama-3.2-1B shape at
/// 4,096 tokens of context), and the max and the sum over eight lanes reduced in one fixed order.
#[inline(always)]
fn softmax(row: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            m[l] = m[l].max(c[l]);
        }
    }
    let max = chunks.remainder().iter().fold(
        ((m[0].max(m[1])).max(m[2].max(m[3]))).max((m[4].max(m[5])).max(m[6].max(m[7]))),
        |a, &b| a.max(b),
    );
    for v in row.iter_mut() {
        *v = exp_nonpositive(*v - max);
    }
    let mut acc = [0.0f32; 8];
    let mut chunks = row.chunks_exact(8);
    for c in &mut chunks {
        for l in 0..8 {
            acc[l] += c[l];
        }
    }
    let mut sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for v in chunks.remainder() {
        sum += v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
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

    /// The SIMD path (F32, F16 and Q8_0 caches, head_dim 32/64/128 on AVX2 machines) gives the same
    /// bits as the portable code, for several context lengths (partial blocks, tails of < 4
    /// positions).
    #[test]
    fn simd_attention_is_bit_identical_to_portable() {
        let cases = [32, 64, 128].map(|hd| KvDtype::ALL.map(|d| (hd, d)));
        for (hd, dtype) in cases.into_iter().flatten() {
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
            let n_heads = 9;
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
                let mut fast = vec![0.0; q.len()];
                let mut slow = vec![0.0; q.len()];
                attend(
                    &cache,
                    1,
                    &slots,
                    &q,
                    n_heads,
                    &params,
                    &mut fast,
                    &mut AttnScratch::default(),
                    &Threads::single(),
                );
                let a = Attend {
                    layout: lay,
                    region: cache.region(),
                    layer: 1,
                    slots: &slots,
                    q: &q,
                    n_heads,
                    params: &params,
                };
                let items = 0..slots.len() * lay.n_kv_heads;
                attend_any(&a, items, &mut slow, &mut Part::default());
                for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "hd {hd} {dtype:?} {params:?} element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    /// Attention split over threads gives the bits of one thread, for a prefill-like batch (one
    /// sequence's 40 consecutive tokens) and a decode-like batch of one token at a context long
    /// enough to be split, on every cache type.
    #[test]
    fn threaded_attention_is_bit_identical_to_one_thread() {
        for dtype in KvDtype::ALL {
            let lay = KvLayout {
                n_layers: 1,
                n_kv_heads: 2,
                head_dim: 64,
                block_size: 16,
                dtype,
            };
            let blocks: Vec<BlockId> = (0..80).map(|b| BlockId((b * 7) % 80)).collect();
            let mut cache = KvCache::on_heap(lay, 80);
            let val = |p: usize, i: usize| (((p * 53 + i * 29) % 61) as f32 - 30.0) * 0.01;
            let len = 1200;
            fill(&mut cache, 0, &blocks, len, val, |p, i| val(p, i + 11));
            let n_heads = 16;
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
