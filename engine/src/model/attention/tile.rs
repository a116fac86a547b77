//! One work item of attention — up to [`TOKENS`] consecutive tokens of one sequence through one
//! kv head, over one segment of [`SEGMENT`] positions — over the paged cache, [`TILE`]
//! positions at a time with a running (online) softmax, as flash attention does: no row of scores as long as the context is ever held, and
//! each tile's key and value rows are read (and widened) once for every query row of the item.
//!
//! The result of a query row depends only on its query, its positions and the cache, never on
//! which tokens share its item or which thread runs it: tiles start at multiples of [`TILE`] in
//! the sequence, a row takes exactly the positions it attends to, and every sum runs in one
//! fixed order (eight lanes by position in the tile, reduced as a tree). So prefill in chunks,
//! batching and threads give the same bits as one token at a time.

use std::ops::Range;

use super::{exp_nonpositive, kv_rows, Attend, KvElem};

/// Positions per tile: tiles start at multiples of this in the sequence.
pub(super) const TILE: usize = 32;

/// Positions per segment: a query row's positions are cut into segments at multiples of this,
/// each computed on its own (possibly on different threads, so that one long sequence spreads
/// over every thread) and merged in order ([`merge`]).
pub(super) const SEGMENT: usize = 1024;

/// At most this many consecutive tokens of one sequence share a work item, and so one reading
/// of each tile.
pub(super) const TOKENS: usize = 32;

/// What a kernel does with one tile's rows. The portable kernel and the SIMD ones do the same
/// float operations in the same order (see [`dot`] and [`axpy`]), so their results agree bit
/// for bit.
pub(super) trait TileKernel {
    /// Asks for the key and value rows at `rows` to be brought towards the core (a hint; the
    /// portable kernel ignores it).
    fn prefetch(&self, _rows: &[(usize, usize)]) {}
    /// Makes the key (`value == false`) or value rows at the unit offsets `rows` (checked against
    /// the pool), which start at position `base` of the tile, the tile that the next calls read.
    fn load(&mut self, rows: &[(usize, usize)], base: usize, value: bool);
    /// `s[h·TILE + base + j] = (q_h · k_j) · scale` for each head `h` of `q` (rows of
    /// `head_dim`) and each loaded key row `j` of `js`.
    fn scores(&self, q: &[f32], js: Range<usize>, scale: f32, s: &mut [f32], base: usize);
    /// `acc_h += p[h·TILE + base + j] · v_j` for each head `h` of `acc` and each loaded value
    /// row `j` of `js`, in order.
    fn accumulate(&self, p: &[f32], base: usize, js: Range<usize>, acc: &mut [f32]);
}

/// The running state of one work item's query rows, reused across items.
#[derive(Default)]
pub(super) struct State {
    /// Unit offsets of the (key, value) rows of the tile's positions.
    rows: Vec<(usize, usize)>,
    /// The same for the next tile.
    next: Vec<(usize, usize)>,
    /// Each token's positions in the item's segment.
    spans: Vec<Range<usize>>,
    /// Per query row: the tile's scores, then its weights (`TILE` each).
    p: Vec<f32>,
    /// Per query row: the largest score so far.
    m: Vec<f32>,
    /// Per query row: the sum of weights so far, relative to `m`.
    l: Vec<f32>,
    /// Per query row: the weighted sum of value rows so far, relative to `m` (`head_dim` each).
    acc: Vec<f32>,
}

/// Computes the item of `tokens` (consecutive batch tokens of one sequence, at consecutive
/// positions) through kv head `g` over the positions in `seg` into `out`: for each token's
/// `group` query rows in order, a partial row of `head_dim + 2` (what [`merge`] folds) — the weighted sum of value
/// rows, then the max score and the sum of weights it is relative to (−∞ and 0 for a row with
/// no position in `seg`).
pub(super) fn item<T: KvElem>(
    a: &Attend<'_>,
    (tokens, g, seg): (Range<usize>, usize, Range<usize>),
    kernel: &mut impl TileKernel,
    st: &mut State,
    out: &mut [f32],
) {
    let (hd, n_kv) = (a.layout.head_dim, a.layout.n_kv_heads);
    let group = a.n_heads / n_kv;
    let gw = group * hd;
    let rows = tokens.len() * group;
    st.p.resize(rows * TILE, 0.0);
    st.m.clear();
    st.m.resize(rows, f32::NEG_INFINITY);
    st.l.clear();
    st.l.resize(rows, 0.0);
    st.acc.clear();
    st.acc.resize(rows * hd, 0.0);
    // Each token's positions in the segment.
    st.spans.clear();
    st.spans.extend(tokens.clone().map(|t| {
        let r = a.positions(t);
        let start = r.start.max(seg.start);
        start..r.end.min(seg.end).max(start)
    }));
    let spans = &st.spans;
    let lo = spans
        .iter()
        .filter(|r| !r.is_empty())
        .map(|r| r.start)
        .min();
    let hi = spans.iter().map(|r| r.end).max().unwrap_or(0);
    let lo = lo.unwrap_or(hi);
    let pool_len = a.mem::<T>().len();
    // The last token's table covers every position of the item.
    let slot = &a.slots[tokens.end - 1];
    let tile_at = |start: usize| start.max(lo)..(start + TILE).min(hi);
    let first = lo / TILE * TILE;
    kv_rows(
        &a.layout,
        slot,
        a.layer,
        g,
        tile_at(first),
        pool_len,
        &mut st.next,
    );
    for start in (first..hi).step_by(TILE) {
        let tile = tile_at(start);
        let base = tile.start - start;
        std::mem::swap(&mut st.rows, &mut st.next);
        // The next tile's rows are on their way from memory while this one is computed.
        let next = tile_at(start + TILE);
        kv_rows(&a.layout, slot, a.layer, g, next, pool_len, &mut st.next);
        kernel.prefetch(&st.next);
        // The loaded rows each token attends to in this tile (possibly none).
        let js = |k: usize| {
            let (s, e) = (spans[k].start.max(tile.start), spans[k].end.min(tile.end));
            (s - tile.start)..e.max(s) - tile.start
        };
        kernel.load(&st.rows, base, false);
        for (k, t) in tokens.clone().enumerate() {
            let js = js(k);
            if js.is_empty() {
                continue;
            }
            let q = &a.q[(t * n_kv + g) * gw..][..gw];
            let p = &mut st.p[k * group * TILE..][..group * TILE];
            kernel.scores(q, js.clone(), a.params.scale, p, base);
            for h in 0..group {
                let r = k * group + h;
                update(
                    (&mut p[h * TILE..][..TILE]).try_into().unwrap(),
                    base + js.start..base + js.end,
                    a.params.softcap,
                    (&mut st.m[r], &mut st.l[r]),
                    &mut st.acc[r * hd..][..hd],
                );
            }
        }
        kernel.load(&st.rows, base, true);
        for k in 0..tokens.len() {
            let js = js(k);
            if !js.is_empty() {
                let p = &st.p[k * group * TILE..][..group * TILE];
                kernel.accumulate(p, base, js, &mut st.acc[k * gw..][..gw]);
            }
        }
    }
    for (r, (o, acc)) in out
        .chunks_exact_mut(hd + 2)
        .zip(st.acc.chunks_exact(hd))
        .enumerate()
    {
        o[..hd].copy_from_slice(acc);
        o[hd] = st.m[r];
        o[hd + 1] = st.l[r];
    }
}

/// Folds a query row's partial result over one segment of positions (`head_dim` weighted
/// sums, the max score and the sum of weights, as [`item`] writes them) into the row's result
/// so far (`acc`, `m`, `l`, starting from 0, −∞ and 0), segment after segment in order. With
/// one segment, the result is that segment's exactly (scaled by `e^0 = 1`, added to 0).
#[inline(always)]
pub(super) fn merge(acc: &mut [f32], (m, l): (&mut f32, &mut f32), part: &[f32]) {
    let hd = acc.len();
    let (pm, pl) = (part[hd], part[hd + 1]);
    if pm == f32::NEG_INFINITY {
        return;
    }
    let max = m.max(pm);
    let (f, pf) = (exp_nonpositive(*m - max), exp_nonpositive(pm - max));
    *l = *l * f + pl * pf;
    for (a, p) in acc.iter_mut().zip(&part[..hd]) {
        *a = *a * f + p * pf;
    }
    *m = max;
}

/// Folds one tile of one query row into its running softmax: soft-caps (when asked) the scores
/// at `valid` (positions in the tile), raises the row's max if the tile exceeds it (rescaling
/// the sums so far), and turns the row into weights — `e^(s - max)` at `valid`, 0 elsewhere —
/// whose sum (eight lanes by position in the tile, reduced as a tree) joins the row's.
#[inline(always)]
fn update(
    row: &mut [f32; TILE],
    valid: Range<usize>,
    softcap: Option<f32>,
    (m, l): (&mut f32, &mut f32),
    acc: &mut [f32],
) {
    if let Some(cap) = softcap {
        super::super::ops::softcap(&mut row[valid.clone()], cap);
    }
    // Positions outside `valid` hold no score of this row: −∞ weighs 0 (`e^−∞`).
    row[..valid.start].fill(f32::NEG_INFINITY);
    row[valid.end..].fill(f32::NEG_INFINITY);
    let mut tops = [f32::NEG_INFINITY; 8];
    for c in row.chunks_exact(8) {
        for i in 0..8 {
            tops[i] = tops[i].max(c[i]);
        }
    }
    let top = tops.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let max = m.max(top);
    for v in row.iter_mut() {
        *v = exp_nonpositive(*v - max);
    }
    let mut lanes = [0.0f32; 8];
    for c in row.chunks_exact(8) {
        for i in 0..8 {
            lanes[i] += c[i];
        }
    }
    let sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3]))
        + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    if max != *m {
        // Exactly 0 for the first tile (`m` is −∞), when `l` and `acc` are 0 too.
        let f = exp_nonpositive(*m - max);
        *l *= f;
        for a in acc.iter_mut() {
            *a *= f;
        }
        *m = max;
    }
    *l += sum;
}

/// The portable kernel: reads the cache's rows of `T` in place.
pub(super) struct Portable<'a, T> {
    pub(super) mem: &'a [T],
    pub(super) head_dim: usize,
    pub(super) head_units: usize,
    /// Unit offsets of the loaded rows.
    pub(super) rows: Vec<usize>,
}

impl<T: KvElem> TileKernel for Portable<'_, T> {
    #[inline(always)]
    fn load(&mut self, rows: &[(usize, usize)], _base: usize, value: bool) {
        self.rows.clear();
        self.rows
            .extend(rows.iter().map(|&(k, v)| if value { v } else { k }));
    }

    #[inline(always)]
    fn scores(&self, q: &[f32], js: Range<usize>, scale: f32, s: &mut [f32], base: usize) {
        let hd = self.head_dim;
        for (h, q) in q.chunks_exact(hd).enumerate() {
            for j in js.clone() {
                let k = &self.mem[self.rows[j]..][..self.head_units];
                s[h * TILE + base + j] = dot(q, k) * scale;
            }
        }
    }

    #[inline(always)]
    fn accumulate(&self, p: &[f32], base: usize, js: Range<usize>, acc: &mut [f32]) {
        for (h, acc) in acc.chunks_exact_mut(self.head_dim).enumerate() {
            for j in js.clone() {
                let v = &self.mem[self.rows[j]..][..self.head_units];
                axpy(acc, p[h * TILE + base + j], v);
            }
        }
    }
}

/// `Σ a·b` over a row of `a.len()` elements: eight partial sums `acc + a·b` (one lane per
/// element index mod 8, in order), reduced as `((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 +
/// s7))`, then the tail in order.
#[inline(always)]
fn dot<T: KvElem>(a: &[f32], b: &[T]) -> f32 {
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

/// `acc += w · v` over a row of `acc.len()` elements (`acc + w·v`, one rounding each).
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
