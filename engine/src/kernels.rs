//! Matrix × activations products for the GGUF weight formats the model uses (F32, Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0, IQ4_NL, and the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): every linear layer of the forward pass
//! goes through [`QMatrix::matmul`].
//!
//! # Data layout
//! [`QMatrix::from_raw`] takes ggml row-major bytes (rows of `cols / 32` blocks) and repacks each
//! row so its scales are contiguous: `[d: nb × f16][m: nb × f16 (Q4_1 / Q5_1)][qh: nb × u32
//! (Q5_0 / Q5_1)][quants]`, where the quants are the ggml `qs` bytes in block order (16 bytes per
//! Q4/Q5 block, 32 per Q8_0 block). A row takes exactly as many bytes as in ggml, and each row is
//! one sequential stream for the prefetcher. K-quant rows keep ggml's super-block layout (see
//! `kquant.rs`, which also defines their dot products). F32 matrices are kept as plain `f32`
//! rows. Q5 dot products are the Q4 ones with the 5-bit quant in place of the nibble and
//! `mw = −16·d` for Q5_0; IQ4_NL's are Q8_0's with `qw` the table value of the nibble.
//!
//! [`Activations`] holds the f32 activations of a batch of tokens plus their Q8 quantization,
//! per token and per block of 32 like llama.cpp's Q8_1: `d = f16(max|x| / 127)` (rounded to f16
//! as llama.cpp stores it), `q = round_ties_even(x · 127 / max|x|)`, and `s = d · Σq`.
//!
//! # Exact float semantics (batch invariance)
//! Every backend (scalar, AVX2, AVX512-VNNI) computes, for each (row, token) pair, *exactly* the
//! same float operations in the same order, whatever the batch size, tile shape, remainder or
//! thread count, so results are bit-identical across all of them (and across machines):
//!
//! - Quantized weights: eight f32 lanes `acc[0..8]` start at `+0.0`. Each block `b`, in order,
//!   goes to lane `k = b % 8`. For Q4 formats it first adds its offset term
//!   `acc[k] = fma(mw_b, s_b, acc[k])` with `mw = m` for Q4_1 and `mw = -8·d` for Q4_0 (so
//!   `value = d·q + mw` in both cases) and `s = dx · Σqx`. Then, with the whole block's integer
//!   dot `L = Σ_{i<32} qw[i]·qx[i]` (an exact `i32`; `qw` is the raw nibble `0..=15` for Q4 and
//!   the `i8` for Q8_0; element `i` of a Q4 block is the low nibble of `qs[i]` for `i < 16` and
//!   the high nibble of `qs[i - 16]` otherwise): `acc[k] = fma(L as f32, dw_b · dx_b, acc[k])`.
//!   The integer sums may be formed in any order and layout (they are exact), so a kernel is
//!   free to keep rows, tokens or blocks in its vector lanes; only the float work is fixed.
//! - F32 weights: `acc[i % 8] = fma(w[i], x[i], acc[i % 8])` for each column `i` in order.
//! - The result is `hsum(acc) = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))`.
//!
//! # Performance
//! Kernels loop over weight rows outermost, a chunk of rows (~24 KiB, kept in L1/L2) at a time,
//! and reuse it across all tokens. On AVX512-VNNI the 32-element block formats (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0, IQ4_NL) put 16 rows in the lanes of a register (`x86/zmm/lanes.rs`: each
//! group of 16 rows repacked once per matmul, then one instruction per float step for all 16
//! rows), for every batch size, and so do Q4_K and Q5_K (their sub-blocks are Q4_1 / Q5_1
//! blocks, see `kquant.rs`) and Q6_K, except that one token of Q4_K or Q6_K (batch-1 decode,
//! where nothing amortises the transposition) goes row by row with each super-block's quants
//! in the byte lanes (`x86/zmm/one.rs`), fast enough to be bound by DRAM bandwidth. Elsewhere (Q2_K, Q3_K, leftover rows, AVX2) an R-rows ×
//! T-tokens register micro-kernel: 4 × 1 for single tokens (decode) and, for token tiles, 2 × 16, 4 × 8
//! and 4 × 4 with 512-bit token-pair accumulators on VNNI (`x86/zmm.rs`, activations
//! interleaved in pairs once per batch by [`Activations`]) or 2 × 4 on AVX2; leftover tokens
//! use 4 × 1 and leftover rows 1 × T. The tiles add up eight blocks' per-lane integer sums per
//! chunk (exact) before the float work (Q2_K and Q3_K: one float step per block and lane).
//!
//! The backend is detected once at runtime; `CLEAVE_SIMD=scalar|avx2` caps it (for testing).
//! Activations whose width is not a multiple of 32 are not quantized and may only be used with
//! F32 matrices (a quantized matrix never has such a width, so `matmul`'s shape check rejects
//! the pair).

mod activations;
mod isa;
mod kquant;
mod scalar;
#[cfg(test)]
mod tests;
mod threads;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use activations::Activations;
pub use isa::simd_path;
use isa::{isa, Isa};
use threads::OutPtr;
pub use threads::Threads;

use std::ops::Range;

use half::f16;

/// This machine's int8 dot-product rate with `threads` threads running the backend's own dot
/// instructions at once, registers only (GMAC/s, summed over the threads), and which
/// instructions; `None` on the scalar backend. The ceiling prefill's matrix work is measured
/// against (`cleave bench engine`).
pub fn int8_peak_gmacs(threads: usize) -> Option<(f64, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        let min = std::time::Duration::from_millis(50);
        let each: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads.max(1))
                .map(|_| s.spawn(move || x86::peak::int8_peak(min)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().ok().flatten())
                .collect()
        });
        let what = each.first().copied().flatten()?.1;
        Some((each.iter().flatten().map(|p| p.0).sum(), what))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = threads;
        None
    }
}

/// Number of elements in a quantization block (and in a block of quantized activations).
pub const QK: usize = 32;
/// Number of elements in a K-quant super-block.
pub const QK_K: usize = 256;

/// Weight formats a [`QMatrix`] may hold (F16 GGUF tensors are converted to F32 by the caller).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightType {
    F32,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    /// 4-bit indices into a fixed non-linear table of 16 `i8` values, blocks of 32.
    IQ4_NL,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
}

impl WeightType {
    /// Whether the type is block-quantized (its column count must be a multiple of
    /// [`WeightType::block`]).
    pub fn is_quantized(self) -> bool {
        self != WeightType::F32
    }

    /// Whether the type is a K-quant: super-blocks of [`QK_K`] kept in ggml's own layout (see
    /// `kquant.rs`).
    pub fn is_k(self) -> bool {
        matches!(
            self,
            WeightType::Q2_K
                | WeightType::Q3_K
                | WeightType::Q4_K
                | WeightType::Q5_K
                | WeightType::Q6_K
        )
    }

    /// Elements per block: 1 for F32, [`QK`] for the 32-element formats, [`QK_K`] for K-quants.
    pub fn block(self) -> usize {
        match self {
            WeightType::F32 => 1,
            t if t.is_k() => QK_K,
            _ => QK,
        }
    }

    /// Bytes of one ggml block.
    fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::Q4_0 | WeightType::IQ4_NL => 18,
            WeightType::Q4_1 => 20,
            WeightType::Q5_0 => 22,
            WeightType::Q5_1 => 24,
            WeightType::Q8_0 => 34,
            WeightType::Q2_K => 84,
            WeightType::Q3_K => 110,
            WeightType::Q4_K => 144,
            WeightType::Q5_K => 176,
            WeightType::Q6_K => 210,
        }
    }

    /// Bytes of one ggml row of `cols` elements (`cols` a multiple of [`WeightType::block`]).
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block() * self.block_bytes()
    }

    /// Bytes of quants per block in the packed layout (32-element formats).
    fn qs_bytes(self) -> usize {
        match self {
            WeightType::Q8_0 => 32,
            _ => 16,
        }
    }

    /// Number of f16 scale arrays per packed row (d, and m for Q4_1 / Q5_1).
    fn n_scales(self) -> usize {
        match self {
            WeightType::Q4_1 | WeightType::Q5_1 => 2,
            _ => 1,
        }
    }

    /// Whether packed rows carry the fifth bits `qh` (Q5_0 / Q5_1).
    fn has_qh(self) -> bool {
        matches!(self, WeightType::Q5_0 | WeightType::Q5_1)
    }
}

/// Errors building or slicing a [`QMatrix`].
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{ty:?} matrix needs a column count that is a multiple of {}, got {cols}", ty.block())]
    ColsNotBlockAligned { ty: WeightType, cols: usize },
    #[error("{ty:?} matrix of {rows}x{cols} needs {expected} bytes, got {got}")]
    ByteLength {
        ty: WeightType,
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    #[error("matrix of {rows}x{cols} needs {expected} values, got {got}")]
    ValueCount {
        rows: usize,
        cols: usize,
        expected: usize,
        got: usize,
    },
    #[error("matrix of {rows}x{cols} is too large")]
    TooLarge { rows: usize, cols: usize },
    #[error("matrix of {rows}x{cols} is empty")]
    Empty { rows: usize, cols: usize },
    #[error("column range {start}..{end} is invalid for a {ty:?} matrix of {cols} columns")]
    BadColumnRange {
        ty: WeightType,
        cols: usize,
        start: usize,
        end: usize,
    },
}

#[derive(Clone)]
enum Storage {
    F32(Vec<f32>),
    Packed(Vec<u8>),
    /// K-quants in ggml's layout, borrowed from the memory-mapped model file.
    Shared(SharedBytes),
}

use cleave_text::gguf::SharedBytes;

/// A `[rows × cols]` weight matrix in one of the [`WeightType`] formats.
#[derive(Clone)]
pub struct QMatrix {
    ty: WeightType,
    rows: usize,
    cols: usize,
    /// Blocks per row (quantized types).
    nb: usize,
    /// Bytes per packed row (quantized types).
    row_bytes: usize,
    data: Storage,
}

impl std::fmt::Debug for QMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QMatrix")
            .field("ty", &self.ty)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

/// The outputs one backend call computes: rows `rows` × tokens `tokens` of a matmul.
#[derive(Clone, Debug)]
struct Cells {
    rows: Range<usize>,
    tokens: Range<usize>,
}

/// One packed row of a quantized matrix, split into its parts.
#[derive(Clone, Copy)]
struct PackedRow<'a> {
    /// `nb` little-endian f16 scales.
    d: &'a [u8],
    /// `nb` little-endian f16 offsets (Q4_1 / Q5_1 only).
    m: Option<&'a [u8]>,
    /// `nb` little-endian u32 masks of the fifth bits, bit `i` for element `i` (Q5_0 / Q5_1).
    qh: Option<&'a [u8]>,
    /// Quants, `qs_bytes` per block.
    qs: &'a [u8],
}

fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
}

/// Checks that `got` values fill a `rows × cols` matrix.
fn check_value_count(rows: usize, cols: usize, got: usize) -> Result<(), KernelError> {
    let expected = rows
        .checked_mul(cols)
        .ok_or(KernelError::TooLarge { rows, cols })?;
    if got != expected {
        return Err(KernelError::ValueCount {
            rows,
            cols,
            expected,
            got,
        });
    }
    Ok(())
}

impl QMatrix {
    /// `bytes` is the ggml row-major data of a `[rows × cols]` matrix (`cols` = ggml `dims[0]`).
    pub fn from_raw(
        ty: WeightType,
        rows: usize,
        cols: usize,
        bytes: &[u8],
    ) -> Result<QMatrix, KernelError> {
        Self::check_raw(ty, rows, cols, bytes.len())?;
        if ty == WeightType::F32 {
            let data = bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            return QMatrix::from_f32(rows, cols, data);
        }
        if ty.is_k() {
            // K-quants keep ggml's super-block layout: it already streams each super-block's
            // scales next to its quants.
            return Ok(Self::k_quant(
                ty,
                rows,
                cols,
                Storage::Packed(bytes.to_vec()),
            ));
        }
        Ok(Self::repack(ty, rows, cols, bytes))
    }

    /// As [`QMatrix::from_raw`], but a K-quant matrix, which keeps ggml's layout, borrows
    /// `bytes` (the mapped model file) instead of copying them; other types are repacked into
    /// memory of their own.
    pub fn from_shared(
        ty: WeightType,
        rows: usize,
        cols: usize,
        bytes: SharedBytes,
    ) -> Result<QMatrix, KernelError> {
        if !ty.is_k() {
            return Self::from_raw(ty, rows, cols, bytes.bytes());
        }
        Self::check_raw(ty, rows, cols, bytes.bytes().len())?;
        Ok(Self::k_quant(ty, rows, cols, Storage::Shared(bytes)))
    }

    fn k_quant(ty: WeightType, rows: usize, cols: usize, data: Storage) -> QMatrix {
        QMatrix {
            ty,
            rows,
            cols,
            nb: cols / QK,
            row_bytes: ty.row_bytes(cols),
            data,
        }
    }

    /// Checks that `len` bytes hold a `[rows × cols]` matrix of `ty`.
    fn check_raw(ty: WeightType, rows: usize, cols: usize, len: usize) -> Result<(), KernelError> {
        // A weight matrix with no rows or columns is a corrupt header (and has no blocks to
        // repack).
        if rows == 0 || cols == 0 {
            return Err(KernelError::Empty { rows, cols });
        }
        if !cols.is_multiple_of(ty.block()) {
            return Err(KernelError::ColsNotBlockAligned { ty, cols });
        }
        let expected = rows
            .checked_mul(ty.row_bytes(cols))
            .filter(|_| cols.checked_mul(4).is_some())
            .ok_or(KernelError::TooLarge { rows, cols })?;
        if len != expected {
            return Err(KernelError::ByteLength {
                ty,
                rows,
                cols,
                expected,
                got: len,
            });
        }
        Ok(())
    }

    /// A 32-element block format's rows repacked: each row's scales together, then its fifth
    /// bits, then its quants.
    fn repack(ty: WeightType, rows: usize, cols: usize, bytes: &[u8]) -> QMatrix {
        let nb = cols / QK;
        let expected = bytes.len();
        let (block, qsb, ns) = (ty.block_bytes(), ty.qs_bytes(), ty.n_scales());
        let nh = if ty.has_qh() { 4 } else { 0 };
        let mut data = vec![0u8; expected];
        for (src, dst) in bytes
            .chunks_exact(nb * block)
            .zip(data.chunks_exact_mut(nb * block))
        {
            let (scales, rest) = dst.split_at_mut(2 * ns * nb);
            let (qh, qs) = rest.split_at_mut(nh * nb);
            for (b, blk) in src.chunks_exact(block).enumerate() {
                for s in 0..ns {
                    scales[2 * (s * nb + b)..][..2].copy_from_slice(&blk[2 * s..2 * s + 2]);
                }
                qh[b * nh..(b + 1) * nh].copy_from_slice(&blk[2 * ns..2 * ns + nh]);
                qs[b * qsb..(b + 1) * qsb].copy_from_slice(&blk[2 * ns + nh..]);
            }
        }
        QMatrix {
            ty,
            rows,
            cols,
            nb,
            row_bytes: nb * block,
            data: Storage::Packed(data),
        }
    }

    /// A F32 matrix from row-major values.
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Result<QMatrix, KernelError> {
        check_value_count(rows, cols, data.len())?;
        Ok(QMatrix {
            ty: WeightType::F32,
            rows,
            cols,
            nb: 0,
            row_bytes: 0,
            data: Storage::F32(data),
        })
    }

    /// Quantizes row-major f32 values to Q8_0 (ggml's reference rounding), for tests and tiny
    /// random models.
    pub fn quantize_q8_0(rows: usize, cols: usize, data: &[f32]) -> Result<QMatrix, KernelError> {
        let ty = WeightType::Q8_0;
        if !cols.is_multiple_of(QK) {
            return Err(KernelError::ColsNotBlockAligned { ty, cols });
        }
        check_value_count(rows, cols, data.len())?;
        let mut raw = Vec::with_capacity(rows * ty.row_bytes(cols));
        for blk in data.chunks_exact(QK) {
            let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            raw.extend_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            raw.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
        }
        QMatrix::from_raw(ty, rows, cols, &raw)
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn ty(&self) -> WeightType {
        self.ty
    }

    #[inline]
    fn packed_row(&self, r: usize) -> PackedRow<'_> {
        let row = &self.packed_bytes()[r * self.row_bytes..(r + 1) * self.row_bytes];
        let (d, rest) = row.split_at(2 * self.nb);
        let (m, rest) = if self.ty.n_scales() == 2 {
            let (m, rest) = rest.split_at(2 * self.nb);
            (Some(m), rest)
        } else {
            (None, rest)
        };
        let (qh, qs) = if self.ty.has_qh() {
            let (qh, qs) = rest.split_at(4 * self.nb);
            (Some(qh), qs)
        } else {
            (None, rest)
        };
        PackedRow { d, m, qh, qs }
    }

    /// All rows' bytes of a packed (quantized) matrix.
    fn packed_bytes(&self) -> &[u8] {
        match &self.data {
            Storage::Packed(data) => data,
            Storage::Shared(data) => data.bytes(),
            Storage::F32(_) => unreachable!("packed_bytes on F32"),
        }
    }

    /// Row `r`'s bytes as stored (ggml's layout for K-quants, repacked for the others).
    #[inline(always)]
    fn raw_row(&self, r: usize) -> &[u8] {
        &self.packed_bytes()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    fn f32_row(&self, r: usize) -> &[f32] {
        let Storage::F32(data) = &self.data else {
            unreachable!("f32_row on quantized")
        };
        &data[r * self.cols..(r + 1) * self.cols]
    }

    /// Dequantizes row `r` into `out` (`out.len() == cols`), e.g. for an embedding lookup.
    /// Panics if `r >= rows` or `out` has the wrong length.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} out of range for {} rows", self.rows);
        assert_eq!(out.len(), self.cols, "dequantize_row output length");
        if self.ty == WeightType::F32 {
            out.copy_from_slice(self.f32_row(r));
            return;
        }
        if self.ty.is_k() {
            kquant::dequantize_row(self.ty, self.raw_row(r), out);
            return;
        }
        let row = self.packed_row(r);
        for (b, o) in out.chunks_exact_mut(QK).enumerate() {
            let d = f16_at(row.d, b);
            match self.ty {
                WeightType::Q8_0 => {
                    for (o, &q) in o.iter_mut().zip(&row.qs[b * 32..(b + 1) * 32]) {
                        *o = d * (q as i8) as f32;
                    }
                }
                WeightType::IQ4_NL => {
                    for (i, o) in o.iter_mut().enumerate() {
                        let q = scalar::nibble(&row.qs[b * 16..(b + 1) * 16], i);
                        *o = d * scalar::IQ4NL_VALUES[q as usize] as f32;
                    }
                }
                WeightType::Q5_0 | WeightType::Q5_1 => {
                    // As ggml (and gguf-py): `d · (q − 16)` for Q5_0, `d · q + m` for Q5_1.
                    for (i, o) in o.iter_mut().enumerate() {
                        let q = scalar::quant5(row, b, i) as f32;
                        *o = match row.m {
                            Some(m) => d * q + f16_at(m, b),
                            None => d * (q - 16.0),
                        };
                    }
                }
                _ => {
                    // As ggml: `d · (q − 8)` for Q4_0 (the same value as `d·q − 8d`, and the
                    // same sign of zero), `d · q + m` for Q4_1.
                    let v = |q: u8| match row.m {
                        Some(m) => d * q as f32 + f16_at(m, b),
                        None => d * (q as f32 - 8.0),
                    };
                    for (j, &q) in row.qs[b * 16..(b + 1) * 16].iter().enumerate() {
                        o[j] = v(q & 15);
                        o[j + 16] = v(q >> 4);
                    }
                }
            }
        }
    }

    /// Rows `[start, end)` (tensor-parallel split of the output dimension): a copy, or for a
    /// matrix borrowed from the model file, a narrower borrow.
    /// Panics if the range is out of bounds.
    pub fn slice_rows(&self, start: usize, end: usize) -> QMatrix {
        assert!(
            start <= end && end <= self.rows,
            "row range {start}..{end} of {}",
            self.rows
        );
        let data = match &self.data {
            Storage::F32(d) => Storage::F32(d[start * self.cols..end * self.cols].to_vec()),
            Storage::Packed(d) => {
                Storage::Packed(d[start * self.row_bytes..end * self.row_bytes].to_vec())
            }
            Storage::Shared(d) => {
                Storage::Shared(d.sub(start * self.row_bytes..end * self.row_bytes))
            }
        };
        QMatrix {
            rows: end - start,
            data,
            ..*self
        }
    }

    /// A copy of columns `[start, end)` (row-parallel split of the input dimension). Both ends
    /// must be multiples of the type's block ([`WeightType::block`]).
    pub fn slice_cols(&self, start: usize, end: usize) -> Result<QMatrix, KernelError> {
        let blk = self.ty.block();
        let bad = start > end
            || end > self.cols
            || !start.is_multiple_of(blk)
            || !end.is_multiple_of(blk);
        if bad {
            return Err(KernelError::BadColumnRange {
                ty: self.ty,
                cols: self.cols,
                start,
                end,
            });
        }
        let cols = end - start;
        if self.ty == WeightType::F32 {
            let mut data = Vec::with_capacity(self.rows * cols);
            for r in 0..self.rows {
                data.extend_from_slice(&self.f32_row(r)[start..end]);
            }
            return QMatrix::from_f32(self.rows, cols, data);
        }
        let (b0, b1) = (start / QK, end / QK);
        let qsb = self.ty.qs_bytes();
        let nb = b1 - b0;
        let row_bytes = self.ty.row_bytes(cols);
        let mut data = Vec::with_capacity(self.rows * row_bytes);
        for r in 0..self.rows {
            if self.ty.is_k() {
                let sb = self.ty.block_bytes();
                data.extend_from_slice(&self.raw_row(r)[start / blk * sb..end / blk * sb]);
                continue;
            }
            let row = self.packed_row(r);
            data.extend_from_slice(&row.d[2 * b0..2 * b1]);
            if let Some(m) = row.m {
                data.extend_from_slice(&m[2 * b0..2 * b1]);
            }
            if let Some(qh) = row.qh {
                data.extend_from_slice(&qh[4 * b0..4 * b1]);
            }
            data.extend_from_slice(&row.qs[qsb * b0..qsb * b1]);
        }
        Ok(QMatrix {
            ty: self.ty,
            rows: self.rows,
            cols,
            nb,
            row_bytes,
            data: Storage::Packed(data),
        })
    }

    /// `out[t * self.rows() + r] = Σ_c W[r,c]·x[t,c]` for every token `t` of `x`.
    ///
    /// Panics if `x.cols() != self.cols()` or `out.len() != x.n_tokens() * self.rows()` (a
    /// quantized matrix has `cols % 32 == 0`, so matching activations are always quantized).
    pub fn matmul(&self, x: &Activations, out: &mut [f32], threads: &Threads) {
        self.matmul_with(isa(), x, out, threads);
    }

    fn matmul_with(&self, isa: Isa, x: &Activations, out: &mut [f32], threads: &Threads) {
        assert_eq!(x.cols, self.cols, "matmul: activation width != matrix cols");
        assert_eq!(out.len(), x.n_tokens * self.rows, "matmul: output length");
        debug_assert!(!self.ty.is_quantized() || x.quantized);
        if x.n_tokens == 0 || self.rows == 0 {
            return;
        }
        let out = OutPtr {
            ptr: out.as_mut_ptr(),
            len: out.len(),
        };
        let work = self.rows * self.cols.max(1) * x.n_tokens;
        let n = match &threads.pool {
            Some(_) if work >= 1 << 16 => threads.n.min(self.rows.div_ceil(16)),
            _ => 1,
        };
        if n <= 1 {
            self.compute_rows(isa, x, out, 0..self.rows);
            return;
        }
        let per = self.rows.div_ceil(n).next_multiple_of(16);
        let pool = threads.pool.as_ref().expect("pool checked above");
        pool.scope(|s| {
            for start in (0..self.rows).step_by(per) {
                let end = (start + per).min(self.rows);
                s.spawn(move |_| self.compute_rows(isa, x, out, start..end));
            }
        });
    }

    /// Computes `rows` for all tokens, a chunk of rows (kept in L1/L2) at a time.
    fn compute_rows(&self, isa: Isa, x: &Activations, out: OutPtr, rows: Range<usize>) {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Vnni && x86::zmm::one::fits(self.ty, x.n_tokens) {
            // SAFETY: as below.
            unsafe { x86::zmm::one::rows(self, x, out, rows) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let rows = if isa == Isa::Vnni && x86::zmm::lanes::fits(self.ty) {
            // Whole groups of 16 rows in lanes, the rest by the tiles below.
            let whole = rows.start + rows.len() / 16 * 16;
            // SAFETY: `Isa::Vnni` is only produced after detecting avx2, fma, f16c, avx512f,
            // avx512bw, avx512vnni and avx512vl.
            unsafe { x86::zmm::lanes::rows(self, x, out, rows.start..whole) };
            whole..rows.end
        } else {
            rows
        };
        let row_bytes = if self.ty == WeightType::F32 {
            self.cols * 4
        } else {
            self.row_bytes
        };
        let chunk = (24 * 1024 / row_bytes.max(1)).clamp(4, 256);
        let mut start = rows.start;
        while start < rows.end {
            let end = (start + chunk).min(rows.end);
            let mut t = 0;
            while t < x.n_tokens {
                let left = x.n_tokens - t;
                let pairs = isa.pairs(self.ty);
                let nt = if left >= 16 && pairs {
                    16
                } else if left >= 8 && pairs {
                    8
                } else if left >= 4 {
                    4
                } else {
                    1
                };
                let tokens = t..t + nt;
                self.block(
                    isa,
                    x,
                    out,
                    Cells {
                        rows: start..end,
                        tokens,
                    },
                );
                t += nt;
            }
            start = end;
        }
    }

    /// Computes `c` (`c.tokens` is 1, 4, 8 or 16 long) with the given backend.
    fn block(&self, isa: Isa, x: &Activations, out: OutPtr, c: Cells) {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                // SAFETY: `Isa::Avx2` is only produced after detecting avx2, fma and f16c.
                unsafe { x86::avx2::block(self, x, out, c) }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Vnni if c.tokens.len() >= 4 && isa.pairs(self.ty) => {
                // SAFETY: `Isa::Vnni` is only produced after detecting avx2, fma, f16c,
                // avx512f, avx512bw, avx512vnni and avx512vl.
                unsafe { x86::zmm::block(self, x, out, c) }
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Vnni => {
                // SAFETY: as above.
                unsafe { x86::vnni::block(self, x, out, c) }
            }
            _ => scalar::block(self, x, out, c),
        }
    }
}
