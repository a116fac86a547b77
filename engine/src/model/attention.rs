//! Paged attention: keys and values are written into, and read from, block slots of the KV
//! region directly, following each sequence's block table.

use crate::kv::memory::{KvCache, KvDtype, KvElem, KvLayout};
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
    let n = layout.token_elems();
    let mem = cache.elems_mut::<T>();
    for (t, s) in slots.iter().enumerate() {
        let block = s.blocks[s.pos / layout.block_size].0 as usize;
        let slot = s.pos % layout.block_size;
        for (value, src) in [(false, k), (true, v)] {
            let off = layout.offset(block, layer, value, slot);
            for (d, x) in mem[off..off + n].iter_mut().zip(&src[t * n..(t + 1) * n]) {
                *d = T::store(*x);
            }
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

/// Scratch space reused across calls.
#[derive(Default)]
pub struct AttnScratch {
    scores: Vec<f32>,
    acc: Vec<f32>,
    /// (key, value) element offsets of the positions a kv head attends to.
    rows: Vec<(usize, usize)>,
}

/// Causal attention of every batch token over its sequence's cached positions `0..=pos` (the
/// last `window` of them for a window layer). `q` holds `n_heads * head_dim` per token; `out`
/// receives the same shape.
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
) {
    let a = Attend {
        cache,
        layer,
        slots,
        q,
        n_heads,
        params,
    };
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && cache.layout().dtype == KvDtype::F32 {
        // SAFETY (all arms): the CPU supports AVX2 and FMA (checked at run time just above).
        match cache.layout().head_dim {
            32 => return unsafe { avx2::attend_f32::<4>(&a, out, scratch) },
            64 => return unsafe { avx2::attend_f32::<8>(&a, out, scratch) },
            128 => return unsafe { avx2::attend_f32::<16>(&a, out, scratch) },
            _ => {}
        }
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
        unsafe { attend_avx2(&a, out, scratch) };
        return;
    }
    attend_any(&a, out, scratch);
}

/// The inputs of one [`attend`] call.
#[derive(Clone, Copy)]
struct Attend<'a> {
    cache: &'a KvCache,
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
    /// Calls `f` for each batch token and kv head, with the row offsets of the positions it
    /// attends to in `scratch.rows` (checked against the pool of `T`s) and `scratch.scores`
    /// zeroed to `group · n`.
    #[inline(always)]
    fn each_group<T: KvElem>(
        &self,
        out: &mut [f32],
        scratch: &mut AttnScratch,
        mut f: impl FnMut(Group<'_>, &mut AttnScratch),
    ) {
        let layout: KvLayout = *self.cache.layout();
        // Query heads per kv head, and the width of their rows.
        let group = self.n_heads / layout.n_kv_heads;
        let gw = group * layout.head_dim;
        let pool_len = self.cache.elems::<T>().len();
        let qw = self.n_heads * layout.head_dim;
        for (t, s) in self.slots.iter().enumerate() {
            let (lo, end) = (self.params.first(s.pos), s.pos + 1);
            let q_t = &self.q[t * qw..(t + 1) * qw];
            let out_t = &mut out[t * qw..(t + 1) * qw];
            for g in 0..layout.n_kv_heads {
                kv_rows(
                    &layout,
                    s,
                    self.layer,
                    g,
                    lo..end,
                    pool_len,
                    &mut scratch.rows,
                );
                scratch.scores.clear();
                scratch.scores.resize(group * (end - lo), 0.0);
                let heads = Group {
                    n: end - lo,
                    q: &q_t[g * gw..(g + 1) * gw],
                    out: &mut out_t[g * gw..(g + 1) * gw],
                };
                f(heads, scratch);
            }
        }
    }
}

/// Into `rows`: the element offsets of the key and value rows of kv head `g` at `positions` of
/// sequence `s` in `layer`, each checked to lie in a pool of `pool_len` elements (the AVX2
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
    let (hd, bs) = (layout.head_dim, layout.block_size);
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
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

/// The same code compiled for 256-bit vectors. Per lane the float operations are the same as
/// the portable build's, so results are identical on every machine.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn attend_avx2(a: &Attend<'_>, out: &mut [f32], scratch: &mut AttnScratch) {
    attend_any(a, out, scratch);
}

#[inline(always)]
fn attend_any(a: &Attend<'_>, out: &mut [f32], scratch: &mut AttnScratch) {
    match a.cache.layout().dtype {
        KvDtype::F32 => attend_typed::<f32>(a, out, scratch),
        KvDtype::F16 => attend_typed::<half::f16>(a, out, scratch),
    }
}

#[inline(always)]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
    // Eight independent partial sums over exact chunks: vectorises, and the order is fixed.
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l].load();
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y.load();
    }
    s
}

/// `acc += w * v`.
#[inline(always)]
fn axpy<T: KvElem>(acc: &mut [f32], w: f32, v: &[T]) {
    for (a, x) in acc.iter_mut().zip(v) {
        *a += w * x.load();
    }
}

#[inline(always)]
fn attend_typed<T: KvElem>(a: &Attend<'_>, out: &mut [f32], scratch: &mut AttnScratch) {
    let hd = a.cache.layout().head_dim;
    let group = a.n_heads / a.cache.layout().n_kv_heads;
    let (scale, softcap) = (a.params.scale, a.params.softcap);
    let mem = a.cache.elems::<T>();
    a.each_group::<T>(out, scratch, |gr, scratch| {
        let n = gr.n;
        // scores[h * n + j] for the `group` query heads sharing the kv head.
        for (j, &(k, _)) in scratch.rows.iter().enumerate() {
            let k = &mem[k..k + hd];
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
            let v = &mem[v..v + hd];
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
/// bit).
#[inline(always)]
fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(dtype: KvDtype) -> KvLayout {
        KvLayout {
            n_layers: 2,
            n_kv_heads: 2,
            head_dim: 8,
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
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let lay = layout(dtype);
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
            let q: Vec<f32> = (0..n_heads * 8)
                .map(|i| (i % 5) as f32 * 0.3 - 0.6)
                .collect();
            let slot = [TokenSlot {
                pos: 9,
                blocks: &blocks,
            }];
            let tol = if dtype == KvDtype::F32 { 1e-5 } else { 5e-3 };
            // Plain causal attention, then a window of 6 (positions 4..=9, across blocks 1
            // and 6) with soft-capped scores at a scale of its own.
            let windowed = AttnParams {
                scale: 0.9,
                softcap: Some(0.5),
                window: Some(6),
            };
            for (params, lo, cap) in [(AttnParams::plain(8), 0, None), (windowed, 4, Some(0.5))] {
                let mut out = vec![0.0; n_heads * 8];
                attend(
                    &cache,
                    1,
                    &slot,
                    &q,
                    n_heads,
                    &params,
                    &mut out,
                    &mut AttnScratch::default(),
                );
                let want = reference(
                    &q,
                    (&ks[lo..], &vs[lo..]),
                    n_heads,
                    (8, 2),
                    (params.scale as f64, cap),
                );
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < tol, "{dtype:?} {params:?}: {a} vs {b}");
                }
            }
        }
    }

    /// The SIMD path (F32 cache, head_dim 32/64/128 on AVX2 machines) gives the same bits as
    /// the portable code, for several context lengths (partial blocks, tails of < 4 positions).
    #[test]
    fn simd_attention_is_bit_identical_to_portable() {
        for hd in [32, 64, 128] {
            let lay = KvLayout {
                n_layers: 2,
                n_kv_heads: 3,
                head_dim: hd,
                block_size: 16,
                dtype: KvDtype::F32,
            };
            let mut cache = KvCache::on_heap(lay, 8);
            let blocks = [BlockId(6), BlockId(2), BlockId(7), BlockId(0)];
            let n = lay.token_elems();
            let val = |p: usize, i: usize, s: f32| (((p * 131 + i * 71) % 97) as f32 - 48.0) * s;
            for p in 0..53 {
                let k: Vec<f32> = (0..n).map(|i| val(p, i, 0.013)).collect();
                let v: Vec<f32> = (0..n).map(|i| val(p, i + 5, 0.021)).collect();
                let slot = [TokenSlot {
                    pos: p,
                    blocks: &blocks,
                }];
                write_kv(&mut cache, 1, &slot, &k, &v);
            }
            let n_heads = 9;
            let positions = [0, 1, 2, 3, 4, 5, 15, 16, 17, 31, 38, 52];
            let slots: Vec<TokenSlot> = positions
                .iter()
                .map(|&pos| TokenSlot {
                    pos,
                    blocks: &blocks,
                })
                .collect();
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
                let mut scratch = AttnScratch::default();
                attend(
                    &cache,
                    1,
                    &slots,
                    &q,
                    n_heads,
                    &params,
                    &mut fast,
                    &mut scratch,
                );
                let a = Attend {
                    cache: &cache,
                    layer: 1,
                    slots: &slots,
                    q: &q,
                    n_heads,
                    params: &params,
                };
                attend_any(&a, &mut slow, &mut scratch);
                for (i, (a, b)) in fast.iter().zip(&slow).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "hd {hd} {params:?} element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
