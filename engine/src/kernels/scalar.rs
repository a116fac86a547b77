//! Portable backend and the canonical definition of every kernel's float semantics (see the
//! parent module's docs): the SIMD backends must match these functions bit for bit.

use super::{f16_at, kquant, Activations, Cells, OutPtr, PackedRow, QMatrix, WeightType, QK};

/// Quantizes one block of 32 activations into `q`, returning the (f16-rounded) scale and `Σq`.
pub(super) fn quantize_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = half::f16::from_f32(amax / 127.0).to_f32();
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // |v · id| <= 127 (up to rounding of id), and `as` saturates anyway. Adding and removing
        // 1.5·2^23 rounds to the nearest integer, ties to even, exactly like `round_ties_even`
        // for |x| < 2^22 — but inline, where `round_ties_even` is a libm call without SSE4.1.
        const MAGIC: f32 = 12_582_912.0;
        let v = ((v * id + MAGIC) - MAGIC) as i8;
        *q = v;
        sum += v as i32;
    }
    (d, sum)
}

/// `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`, the order of the SIMD reduction.
pub(super) fn hsum(v: &[f32; 8]) -> f32 {
    ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))
}

/// IQ4_NL's table: nibble `q` stands for `d · IQ4NL_VALUES[q]` (ggml's `kvalues_iq4nl`).
pub(super) const IQ4NL_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Nibble `i` (0..32) of a Q4 block's 16 `qs` bytes.
pub(super) fn nibble(qs: &[u8], i: usize) -> u8 {
    if i < 16 {
        qs[i] & 15
    } else {
        qs[i - 16] >> 4
    }
}

/// The 5-bit quant `i` (0..32) of block `b` of a Q5_0 / Q5_1 row: the nibble plus bit `i` of
/// the block's `qh` mask as the fifth bit.
pub(super) fn quant5(row: PackedRow<'_>, b: usize, i: usize) -> u8 {
    let qh = row.qh.expect("a Q5 row has fifth bits");
    let mask = u32::from_le_bytes([qh[4 * b], qh[4 * b + 1], qh[4 * b + 2], qh[4 * b + 3]]);
    nibble(&row.qs[b * 16..(b + 1) * 16], i) | ((((mask >> i) & 1) as u8) << 4)
}

/// One (row, token) dot product of a Q4_0 / Q4_1 / Q5_0 / Q5_1 row with quantized activations:
/// block `b` goes to lane `b % 8`, first its offset term `mw · s`, then its whole integer dot
/// `L = Σ q·x` times `dw · dx`. Q5 rows use the 5-bit quant in place of the nibble and
/// `mw = -16·d` for Q5_0.
pub(super) fn dot_q4(row: PackedRow<'_>, xq: &[i8], xd: &[f32], xs: &[f32], nb: usize) -> f32 {
    let (zero, q5) = match row.qh {
        Some(_) => (-16.0, true),
        None => (-8.0, false),
    };
    let offset = |b: usize| match row.m {
        Some(m) => f16_at(m, b),
        None => zero * f16_at(row.d, b),
    };
    let quant = |b: usize, i: usize| {
        let q = if q5 {
            quant5(row, b, i)
        } else {
            nibble(&row.qs[b * 16..(b + 1) * 16], i)
        };
        q as i32
    };
    block_dots(row, xq, xd, nb, Some((&offset, xs)), quant)
}

/// A format's offset term: `mw(b)` and the activations' `s = dx · Σq` per block.
type Offset<'a> = Option<(&'a dyn Fn(usize) -> f32, &'a [f32])>;

/// The lane order every 32-element block format shares (see the module docs of `kernels`):
/// for each block `b` in order, lane `b % 8` adds the offset term `mw(b) · xs[b]` (formats
/// that have one), then `L_b · (d_b · xd[b])`, with `d_b` the row's block scale and the exact
/// `L_b = Σ_i qw(b, i) · xq[32b + i]`.
fn block_dots(
    row: PackedRow<'_>,
    xq: &[i8],
    xd: &[f32],
    nb: usize,
    offset: Offset<'_>,
    qw: impl Fn(usize, usize) -> i32,
) -> f32 {
    let mut acc = [0f32; 8];
    for b in 0..nb {
        let a = &mut acc[b % 8];
        if let Some((mw, xs)) = &offset {
            *a = mw(b).mul_add(xs[b], *a);
        }
        let xb = &xq[b * QK..(b + 1) * QK];
        let l: i32 = (0..QK).map(|i| qw(b, i) * xb[i] as i32).sum();
        *a = (l as f32).mul_add(f16_at(row.d, b) * xd[b], *a);
    }
    hsum(&acc)
}

/// One (row, token) dot product of a Q8_0 row with quantized activations.
pub(super) fn dot_q8(row: PackedRow<'_>, xq: &[i8], xd: &[f32], nb: usize) -> f32 {
    let q = |b: usize, i: usize| (row.qs[b * 32 + i] as i8) as i32;
    block_dots(row, xq, xd, nb, None, q)
}

/// One (row, token) dot product of an IQ4_NL row with quantized activations: as Q8_0, with the
/// table value of each nibble as the weight quant.
pub(super) fn dot_iq4nl(row: PackedRow<'_>, xq: &[i8], xd: &[f32], nb: usize) -> f32 {
    let q =
        |b: usize, i: usize| IQ4NL_VALUES[nibble(&row.qs[b * 16..(b + 1) * 16], i) as usize] as i32;
    block_dots(row, xq, xd, nb, None, q)
}

/// One (row, token) dot product of f32 rows.
pub(super) fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (i, (&w, &x)) in w.iter().zip(x).enumerate() {
        acc[i % 8] = w.mul_add(x, acc[i % 8]);
    }
    hsum(&acc)
}

/// Computes `c` one (row, token) pair at a time.
pub(super) fn block(m: &QMatrix, x: &Activations, out: OutPtr, c: Cells) {
    for r in c.rows {
        for t in c.tokens.clone() {
            let v = match m.ty {
                WeightType::F32 => dot_f32(m.f32_row(r), x.x_row(t)),
                WeightType::Q8_0 => dot_q8(m.packed_row(r), x.q_row(t), x.d_row(t), m.nb),
                WeightType::IQ4_NL => dot_iq4nl(m.packed_row(r), x.q_row(t), x.d_row(t), m.nb),
                WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q5_0 | WeightType::Q5_1 => {
                    dot_q4(m.packed_row(r), x.q_row(t), x.d_row(t), x.s_row(t), m.nb)
                }
                WeightType::Q2_K
                | WeightType::Q3_K
                | WeightType::Q4_K
                | WeightType::Q5_K
                | WeightType::Q6_K => {
                    kquant::dot(m.ty, m.raw_row(r), x.q_row(t), x.d_row(t), x.s_row(t))
                }
            };
            out.write(t * m.rows + r, v);
        }
    }
}
