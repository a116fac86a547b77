//! One tensor of a GGUF file, read and checked (a weight matrix in its own format, a vector,
//! a shape), and how a rank's share of the weights is cut ([`Shard`]): what the dense weights,
//! the MoE experts and the configuration's tensors all read through.

use crate::kernels::{QMatrix, WeightType};
use cleave_text::gguf::{GgmlType, GgufFile};

use super::ModelError;

/// Which part of the weights this process holds: rank `rank` of a group of `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This process's index in the group.
    pub rank: usize,
    /// The group's size.
    pub world: usize,
}

impl Shard {
    /// The whole model in one process.
    pub const SINGLE: Shard = Shard { rank: 0, world: 1 };

    /// The contiguous part of `n` items this rank owns (requires `n % world == 0`).
    pub fn range(&self, n: usize) -> (usize, usize) {
        let per = n / self.world;
        (self.rank * per, (self.rank + 1) * per)
    }

    /// The contiguous part of `n` items rank `rank` owns when `n` need not divide evenly
    /// (experts, tokens): `rank * n / world .. (rank + 1) * n / world`.
    pub fn uneven(n: usize, world: usize, rank: usize) -> std::ops::Range<usize> {
        rank * n / world..(rank + 1) * n / world
    }
}

/// A gated feed-forward: `down(act(gate x) * up x)` (SwiGLU, or GeGLU for Gemma). In a dense layer gate/up are this rank's
/// rows and down its columns; a routed expert is whole on the rank that owns it.
pub struct Mlp {
    pub w_gate: QMatrix,
    pub w_up: QMatrix,
    pub w_down: QMatrix,
}

/// Reads a 2-D weight `[rows x cols]` (cols = GGUF dims[0]) in its own format.
pub(super) fn matrix(g: &GgufFile, name: &str) -> Result<QMatrix, ModelError> {
    let info = g.tensor(name)?;
    if info.dims.len() != 2 {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("expected 2 dimensions, found {:?}", info.dims),
        });
    }
    let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
    let ty = match info.ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            return Ok(QMatrix::from_f32(rows, cols, g.tensor_f32(name)?)?);
        }
        other => kernel_type(name, other)?,
    };
    // K-quant rows are used in the file's layout: they borrow the mapped file (no copy).
    Ok(QMatrix::from_shared(
        ty,
        rows,
        cols,
        g.tensor_shared(name)?,
    )?)
}

/// The kernel format of a quantized GGUF tensor; any type without kernels (IQ2/IQ3/IQ1
/// families, IQ4_XS, ternary TQ1_0/TQ2_0, MXFP4, …) is an error naming the tensor.
pub(super) fn kernel_type(name: &str, ty: GgmlType) -> Result<WeightType, ModelError> {
    Ok(match ty {
        GgmlType::Q4_0 => WeightType::Q4_0,
        GgmlType::Q4_1 => WeightType::Q4_1,
        GgmlType::Q5_0 => WeightType::Q5_0,
        GgmlType::Q5_1 => WeightType::Q5_1,
        GgmlType::Q8_0 => WeightType::Q8_0,
        GgmlType::IQ4_NL => WeightType::IQ4_NL,
        GgmlType::Q2_K => WeightType::Q2_K,
        GgmlType::Q3_K => WeightType::Q3_K,
        GgmlType::Q4_K => WeightType::Q4_K,
        GgmlType::Q5_K => WeightType::Q5_K,
        GgmlType::Q6_K => WeightType::Q6_K,
        other => {
            return Err(ModelError::UnsupportedTensorType {
                name: name.into(),
                ty: other.to_string(),
            })
        }
    })
}

/// A 1-D tensor of `len` values, as f32.
pub(super) fn vector(g: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let v = g.tensor_f32(name)?;
    if v.len() != len {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("expected {len} values, found {}", v.len()),
        });
    }
    Ok(v)
}

/// [`vector`] when the file has the tensor.
pub(super) fn optional_vector(
    g: &GgufFile,
    name: &str,
    len: usize,
) -> Result<Option<Vec<f32>>, ModelError> {
    if g.tensor(name).is_err() {
        return Ok(None);
    }
    vector(g, name, len).map(Some)
}

/// Checks that `m` is `rows × cols`.
pub(super) fn expect_shape(
    m: &QMatrix,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<(), ModelError> {
    if m.rows() != rows || m.cols() != cols {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("expected {rows}x{cols}, found {}x{}", m.rows(), m.cols()),
        });
    }
    Ok(())
}
