//! K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): ggml's super-block layout, its dequantization, and the scalar
//! definition of their dot products with quantized activations (the SIMD tiles in
//! `x86/kquant.rs` must match [`dot`] bit for bit).
//!
//! A row is kept exactly as ggml stores it: `cols / 256` super-blocks, each
//!
//! - Q4_K (144 bytes): `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]` — eight
//!   sub-blocks of 32 with 6-bit scale `sc_j` and minimum `m_j` packed in `scales`; element
//!   `64g + l` (`l < 32`) is the low nibble of `qs[32g + l]`, element `64g + 32 + l` the high one;
//!   value `(d·sc_j)·q − dmin·m_j`;
//! - Q5_K (176 bytes): `d, dmin, scales[12], qh: [u8; 32], qs: [u8; 128]` — as Q4_K with bit `j`
//!   of `qh[l]` as the fifth bit of element `32j + l`;
//! - Q6_K (210 bytes): `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16` — sixteen
//!   sub-blocks of 16 with an `i8` scale; value `(d·sc)·(q − 32)` with `q` 6-bit.
//!
//! - Q2_K (84 bytes): `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16` — sixteen
//!   sub-blocks of 16, scale the low nibble and minimum the high nibble of `scales[i]`; element
//!   `128n + 32s + l` is bits `2s..2s+2` of `qs[32n + l]`; value `(d·sc)·q − dmin·m`;
//! - Q3_K (110 bytes): `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16` — sixteen
//!   6-bit scales (`scales[i] & 15` or `scales[i − 8] >> 4` as the low bits, 2-bit fields of
//!   `scales[8..12]` as the high ones) minus 32; the low two bits of element `32j + l` as in
//!   Q2_K, bit `j` of `hmask[l]` set meaning `+0` and clear `−4`; value `(d·sc)·q`, `q` in −4..=3.
//!
//! # Dot semantics
//! Activations are the same per-32 Q8 blocks every other format uses (`Activations`: scale
//! `dx_b`, quants `x`, `s_b = dx_b·Σx`), so one quantization of a layer's input serves all the
//! tensor types of a mixed file. A super-block covers activation blocks `b0..b0 + 8`
//! (`b0 = 8·s`), i.e. exactly one chunk of eight f32 lanes `acc[0..8]`:
//!
//! - Q4_K / Q5_K: each 32-element sub-block `j` is a Q4_1 / Q5_1 block whose scale is
//!   `dw_j = d·sc_j` and whose offset weight is `mw_j = −(dmin·m_j)` (both exact in f32), and it
//!   gets the float operations of one (`scalar::dot_q4`): in lane `j`,
//!   `acc[j] = fma(mw_j, s_{b0+j}, acc[j])`, then with the whole sub-block's integer dot
//!   `L = Σ_{i<32} q_{32j+i}·x_{32j+i}`, `acc[j] = fma(L as f32, dw_j·dx_{b0+j}, acc[j])`. So
//!   the tiles of the 32-element formats (and the VNNI rows-in-lanes kernel) run them.
//! - Q6_K: for each 32-element block `j`, in lane `j`: with the whole block's integer dot
//!   `L = Σ_{i<32} sc_{2j + i/16}·(q_{32j+i} − 32)·x_{32j+i}` (the 16-element sub-blocks'
//!   scales applied in integers), `acc[j] = fma(L as f32, d·dx_{b0+j}, acc[j])`: one float FMA
//!   per block, as the 32-element formats.
//!
//! - Q2_K: for each 32-element block `j` and lane `k` (sub-block `i = 2j + k/4`):
//!   `L = sc_i · Σ q·x`, `M = m_i · Σ x` over the lane's four elements, then
//!   `acc[k] = fma(L as f32, d·dx_{b0+j}, acc[k])` and `acc[k] = fma(M as f32, −dmin·dx_{b0+j},
//!   acc[k])`.
//! - Q3_K: for each 32-element block `j` and lane `k`:
//!   `L = sc_{2j + k/4} · Σ_{i=4k}^{4k+3} q_{32j+i}·x_{32j+i}` (Q3_K's signed scales, `q` in
//!   −4..=3) and `acc[k] = fma(L as f32, d·dx_{b0+j}, acc[k])`.
//!
//! The result is `hsum(acc)` as for the other formats. Every `L` is below 2^24 in magnitude,
//! so `L as f32` is exact. For Q2_K, Q3_K and Q6_K the sub-block scales are applied in integers
//! (for free in the AVX2 `madd` step), leaving one float FMA per 32 elements as in Q4_0.

use half::f16;

use super::scalar::hsum;
use super::{WeightType, QK, QK_K};

fn f16_le(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The eight 6-bit scales and minimums packed in a Q4_K / Q5_K super-block's 12 scale bytes
/// (inlined: the tiles decode them per row and super-block).
#[inline(always)]
pub(super) fn scales_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// The scale `d·sc` and offset weight `−(dmin·m)` of one 32-element sub-block of a Q4_K / Q5_K
/// super-block: products of an f16 and a 6-bit integer, so both are exact in f32 (the
/// sub-block is a Q4_1 / Q5_1 block with these as its `d` and `m`).
#[inline(always)]
pub(super) fn k45_block_scales(d: f32, dmin: f32, sc: u8, m: u8) -> (f32, f32) {
    (d * sc as f32, -(dmin * m as f32))
}

/// Byte offset of the quants `qs` in a Q4_K / Q5_K super-block, and of Q5_K's `qh`.
pub(super) const K4_QS: usize = 16;
pub(super) const K5_QH: usize = 16;
pub(super) const K5_QS: usize = 48;
/// Byte offsets in a Q6_K super-block.
pub(super) const K6_QH: usize = 128;
pub(super) const K6_SC: usize = 192;
pub(super) const K6_D: usize = 208;

/// Byte offsets in Q2_K and Q3_K super-blocks.
pub(super) const K2_QS: usize = 16;
pub(super) const K2_D: usize = 80;
pub(super) const K3_QS: usize = 32;
pub(super) const K3_SC: usize = 96;
pub(super) const K3_D: usize = 108;

/// The sixteen signed 6-bit scales of a Q3_K super-block's 12 scale bytes.
#[inline(always)]
pub(super) fn scales_k3(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let lo = if k < 8 { s[k] & 15 } else { s[k - 8] >> 4 };
        let hi = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// The low two bits of element `e` (0..256) of a Q2_K / Q3_K super-block's `qs`.
fn bits2(qs: &[u8], e: usize) -> u8 {
    let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
    (qs[32 * n + l] >> (2 * s)) & 3
}

/// The signed quant of element `e` of a Q3_K super-block.
fn quant_k3(blk: &[u8], e: usize) -> i8 {
    let high = (blk[e % 32] >> (e / 32)) & 1;
    (bits2(&blk[K3_QS..], e) | (high << 2)) as i8 - 4
}

/// The unsigned quant of element `e` (0..256) of a Q4_K / Q5_K super-block.
fn quant_k45(ty: WeightType, blk: &[u8], e: usize) -> u8 {
    let (j, l) = (e / 32, e % 32);
    let qs_at = if ty == WeightType::Q5_K { K5_QS } else { K4_QS };
    let byte = blk[qs_at + 32 * (j / 2) + l];
    let lo = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
    if ty == WeightType::Q5_K {
        lo | (((blk[K5_QH + l] >> j) & 1) << 4)
    } else {
        lo
    }
}

/// The signed quant `q − 32` of element `e` (0..256) of a Q6_K super-block.
fn quant_k6(blk: &[u8], e: usize) -> i8 {
    let (n, g, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = blk[64 * n + l + 32 * (g % 2)];
    let lo = if g < 2 { ql & 15 } else { ql >> 4 };
    let hi = (blk[K6_QH + 32 * n + l] >> (2 * g)) & 3;
    (lo | (hi << 4)) as i8 - 32
}

/// Dequantizes one row of super-blocks (`out.len()` = 256 per super-block), with the float
/// operations of ggml's reference (and gguf-py's `dequantize`): `(d·sc)·q − dmin·m` and
/// `(d·sc)·(q − 32)`.
pub(super) fn dequantize_row(ty: WeightType, row: &[u8], out: &mut [f32]) {
    let bb = ty.block_bytes();
    for (blk, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(QK_K)) {
        match ty {
            WeightType::Q4_K | WeightType::Q5_K => {
                let (d, dmin) = (f16_le(blk, 0), f16_le(blk, 2));
                let (sc, m) = scales_k4(&blk[4..16]);
                for (e, o) in o.iter_mut().enumerate() {
                    let j = e / 32;
                    let q = quant_k45(ty, blk, e) as f32;
                    *o = (d * sc[j] as f32) * q - dmin * m[j] as f32;
                }
            }
            WeightType::Q2_K => {
                let (d, dmin) = (f16_le(blk, K2_D), f16_le(blk, K2_D + 2));
                for (e, o) in o.iter_mut().enumerate() {
                    let sm = blk[e / 16];
                    let q = bits2(&blk[K2_QS..], e) as f32;
                    *o = (d * (sm & 15) as f32) * q - dmin * (sm >> 4) as f32;
                }
            }
            WeightType::Q3_K => {
                let d = f16_le(blk, K3_D);
                let sc = scales_k3(&blk[K3_SC..K3_SC + 12]);
                for (e, o) in o.iter_mut().enumerate() {
                    *o = (d * sc[e / 16] as f32) * quant_k3(blk, e) as f32;
                }
            }
            WeightType::Q6_K => {
                let d = f16_le(blk, K6_D);
                for (e, o) in o.iter_mut().enumerate() {
                    let sc = blk[K6_SC + e / 16] as i8;
                    *o = (d * sc as f32) * quant_k6(blk, e) as f32;
                }
            }
            other => unreachable!("{other:?} is not a K-quant"),
        }
    }
}

/// One (row, token) dot product of a K-quant row with quantized activations (see the module
/// docs for the exact order of operations).
pub(super) fn dot(ty: WeightType, row: &[u8], xq: &[i8], xd: &[f32], xs: &[f32]) -> f32 {
    let bb = ty.block_bytes();
    let mut acc = [0f32; 8];
    for (s, blk) in row.chunks_exact(bb).enumerate() {
        let b0 = 8 * s;
        let x = &xq[b0 * QK..(b0 + 8) * QK];
        match ty {
            WeightType::Q4_K | WeightType::Q5_K => {
                let (d, dmin) = (f16_le(blk, 0), f16_le(blk, 2));
                let (sc, m) = scales_k4(&blk[4..16]);
                for (j, a) in acc.iter_mut().enumerate() {
                    let (dw, mw) = k45_block_scales(d, dmin, sc[j], m[j]);
                    *a = mw.mul_add(xs[b0 + j], *a);
                    let l: i32 = (32 * j..32 * j + 32)
                        .map(|e| quant_k45(ty, blk, e) as i32 * x[e] as i32)
                        .sum();
                    *a = (l as f32).mul_add(dw * xd[b0 + j], *a);
                }
            }
            WeightType::Q2_K => {
                let (d, dmin) = (f16_le(blk, K2_D), f16_le(blk, K2_D + 2));
                for j in 0..8 {
                    let (scale, mscale) = (d * xd[b0 + j], -dmin * xd[b0 + j]);
                    for (k, a) in acc.iter_mut().enumerate() {
                        let sm = blk[2 * j + k / 4] as i32;
                        let lane = 32 * j + 4 * k..32 * j + 4 * k + 4;
                        let l: i32 = lane
                            .clone()
                            .map(|e| bits2(&blk[K2_QS..], e) as i32 * x[e] as i32)
                            .sum();
                        let xs: i32 = lane.map(|e| x[e] as i32).sum();
                        *a = (((sm & 15) * l) as f32).mul_add(scale, *a);
                        *a = (((sm >> 4) * xs) as f32).mul_add(mscale, *a);
                    }
                }
            }
            WeightType::Q3_K => {
                let d = f16_le(blk, K3_D);
                let sc = scales_k3(&blk[K3_SC..K3_SC + 12]);
                for j in 0..8 {
                    let scale = d * xd[b0 + j];
                    for (k, a) in acc.iter_mut().enumerate() {
                        let l: i32 = (32 * j + 4 * k..32 * j + 4 * k + 4)
                            .map(|e| quant_k3(blk, e) as i32 * x[e] as i32)
                            .sum();
                        *a = ((sc[2 * j + k / 4] as i32 * l) as f32).mul_add(scale, *a);
                    }
                }
            }
            WeightType::Q6_K => {
                let d = f16_le(blk, K6_D);
                for (j, a) in acc.iter_mut().enumerate() {
                    let l: i32 = (32 * j..32 * j + 32)
                        .map(|e| {
                            let sc = blk[K6_SC + e / 16] as i8 as i32;
                            sc * quant_k6(blk, e) as i32 * x[e] as i32
                        })
                        .sum();
                    *a = (l as f32).mul_add(d * xd[b0 + j], *a);
                }
            }
            other => unreachable!("{other:?} is not a K-quant"),
        }
    }
    hsum(&acc)
}
