//! llama.cpp's GGUF layout of MoE layers: the router `ffn_gate_inp` `[hidden -> experts]`, the
//! experts stacked in 3-D tensors `ffn_{gate,up,down}_exps` (dims `[cols, rows, experts]`, one
//! expert's matrix contiguous), and for Qwen2-MoE the shared expert `ffn_*_shexp` with its gate
//! vector `ffn_gate_inp_shexp`. Each rank reads only its experts' bytes.

use crate::kernels::QMatrix;
use cleave_text::gguf::{GgmlType, GgufFile};

use super::config::ModelConfig;
use super::moe::{MoeLayer, SharedExpert};
use super::tensors::{expect_shape, kernel_type, matrix, vector, Mlp, Shard};
use super::ModelError;

/// Experts `first..first + n` of the stacked tensor `name`, each `[rows x cols]`.
fn experts(
    g: &GgufFile,
    name: &str,
    (rows, cols, count): (usize, usize, usize),
    mine: std::ops::Range<usize>,
) -> Result<Vec<QMatrix>, ModelError> {
    let info = g.tensor(name)?;
    let want = [cols as u64, rows as u64, count as u64];
    if info.dims != want {
        return Err(ModelError::BadTensor {
            name: name.into(),
            why: format!("expected dims {want:?}, found {:?}", info.dims),
        });
    }
    let ty = match info.ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            let all = g.tensor_f32(name)?;
            let per = rows * cols;
            return mine
                .map(|e| {
                    Ok(QMatrix::from_f32(
                        rows,
                        cols,
                        all[e * per..(e + 1) * per].to_vec(),
                    )?)
                })
                .collect();
        }
        other => kernel_type(name, other)?,
    };
    let data = g.tensor_data(name)?;
    let per = data.len() / count;
    mine.map(|e| {
        Ok(QMatrix::from_raw(
            ty,
            rows,
            cols,
            &data[e * per..(e + 1) * per],
        )?)
    })
    .collect()
}

/// Layer `i`'s MoE block for this rank.
pub fn layer(
    g: &GgufFile,
    cfg: &ModelConfig,
    i: usize,
    shard: Shard,
) -> Result<MoeLayer, ModelError> {
    let m = cfg.moe.as_ref().expect("sparse layer of a MoE model");
    let (h, f, ne) = (cfg.hidden, m.expert_ffn, m.n_experts);
    let n = |s: &str| format!("blk.{i}.{s}");
    let router = matrix(g, &n("ffn_gate_inp.weight"))?;
    expect_shape(&router, &n("ffn_gate_inp.weight"), ne, h)?;
    let mine = Shard::uneven(ne, shard.world, shard.rank);
    let gate = experts(g, &n("ffn_gate_exps.weight"), (f, h, ne), mine.clone())?;
    let up = experts(g, &n("ffn_up_exps.weight"), (f, h, ne), mine.clone())?;
    let down = experts(g, &n("ffn_down_exps.weight"), (h, f, ne), mine.clone())?;
    let local = gate
        .into_iter()
        .zip(up)
        .zip(down)
        .map(|((w_gate, w_up), w_down)| Mlp {
            w_gate,
            w_up,
            w_down,
        })
        .collect();
    let shared = match m.shared_ffn {
        Some(sf) => {
            if sf % shard.world != 0 {
                return Err(ModelError::BadConfig(format!(
                    "group size {} must divide the shared expert width {sf}",
                    shard.world
                )));
            }
            let (f0, f1) = shard.range(sf);
            let load = |s: &str, r: usize, c: usize| -> Result<QMatrix, ModelError> {
                let w = matrix(g, &n(s))?;
                expect_shape(&w, &n(s), r, c)?;
                Ok(w)
            };
            let split = shard.world > 1;
            let rows = |w: QMatrix| if split { w.slice_rows(f0, f1) } else { w };
            let w_down = load("ffn_down_shexp.weight", h, sf)?;
            Some(SharedExpert {
                mlp: Mlp {
                    w_gate: rows(load("ffn_gate_shexp.weight", sf, h)?),
                    w_up: rows(load("ffn_up_shexp.weight", sf, h)?),
                    w_down: if split {
                        w_down.slice_cols(f0, f1)?
                    } else {
                        w_down
                    },
                },
                gate: vector(g, &n("ffn_gate_inp_shexp.weight"), h)?,
            })
        }
        None => None,
    };
    Ok(MoeLayer {
        router,
        first: mine.start,
        experts: local,
        shared,
    })
}
