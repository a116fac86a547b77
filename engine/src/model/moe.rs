//! Sparse mixture-of-experts feed-forward with expert parallelism.
//!
//! Every rank holds all tokens of the step (attention is tensor-parallel, and its all-reduce
//! leaves the same residual stream on every rank). Per MoE layer:
//! 1. every rank runs the router (replicated) and picks each token's top-k experts;
//! 2. each rank takes responsibility for a contiguous slice of the tokens and sends each of its
//!    (token, expert) pairs to the rank owning that expert (`all_to_all_v`, one message of
//!    `[expert id, hidden row]` per pair);
//! 3. each rank runs its experts over what it received, batched per expert, and sends the
//!    outputs back in the order they came (`all_to_all_v` again);
//! 4. the token's rank combines its top-k outputs in rank-independent order (k order); one
//!    all-reduce gives every rank the layer's full output (with a shared expert, of the routed
//!    part and the ranks' shared-expert parts side by side, added after the reduction, so a
//!    token's result does not depend on which rank owned it in this step's batch).

use std::sync::atomic::Ordering;

use crate::kernels::{Activations, QMatrix, Threads};
use cleave_types::collective::CollectiveError;

use super::ops::{matmul, swiglu};
use super::tensors::{Mlp, Shard};
use super::Model;

/// One MoE block's weights on this rank.
pub struct MoeLayer {
    /// Router `[n_experts x hidden]`, on every rank.
    pub router: QMatrix,
    /// The first expert this rank owns; it owns `first..first + experts.len()`.
    pub first: usize,
    /// This rank's experts, whole.
    pub experts: Vec<Mlp>,
    /// The shared expert (tensor-parallel like a dense FFN) and its gate.
    pub shared: Option<SharedExpert>,
}

/// Qwen2-MoE's always-on expert, scaled per token by `sigmoid(gate · x)`.
pub struct SharedExpert {
    /// This rank's rows/columns of the shared SwiGLU.
    pub mlp: Mlp,
    /// `shared_expert_gate` (one output), `hidden` values.
    pub gate: Vec<f32>,
}

/// Buffers reused across MoE layers and steps.
#[derive(Default)]
pub struct MoeScratch {
    logits: Vec<f32>,
    probs: Vec<f32>,
    order: Vec<usize>,
    /// Per token, `top_k` (expert, weight) pairs.
    choice: Vec<(usize, f32)>,
    send: Vec<Vec<f32>>,
    recv: Vec<Vec<f32>>,
    back: Vec<Vec<f32>>,
    results: Vec<Vec<f32>>,
    /// Per local expert, the (source rank, entry index) pairs it received.
    work: Vec<Vec<(usize, usize)>>,
    rows: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    out: Vec<f32>,
    acts: Activations,
}

/// Runs a SwiGLU over `n` rows of `x`, leaving the result in `s.out`.
fn run_mlp(
    m: &Mlp,
    x: &[f32],
    n: usize,
    acts: &mut Activations,
    (gate, up, out): (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>),
    th: &Threads,
) {
    acts.set(x, n, m.w_gate.cols());
    for (w, o) in [(&m.w_gate, &mut *gate), (&m.w_up, &mut *up)] {
        o.resize(n * w.rows(), 0.0);
        w.matmul(acts, o, th);
    }
    swiglu(gate, up);
    matmul(&m.w_down, acts, gate, n, out, th);
}

impl Model {
    /// The MoE feed-forward of layer `l` for the `n` normalised rows `h`; the full output
    /// (identical on every rank) is written to `out`.
    pub(super) fn moe_ffn(
        &self,
        l: usize,
        layer: &MoeLayer,
        h: &[f32],
        n: usize,
        out: &mut Vec<f32>,
        s: &mut MoeScratch,
    ) -> Result<(), CollectiveError> {
        let cfg = self.config.moe.as_ref().expect("MoE layer in a MoE model");
        let (hidden, ne, k) = (self.config.hidden, cfg.n_experts, cfg.top_k);
        let (world, rank) = (self.collective.world(), self.collective.rank());
        let th = &self.threads;

        // 1. Routing (replicated): softmax over all experts, top-k, optional renormalisation.
        matmul(&layer.router, &mut s.acts, h, n, &mut s.logits, th);
        s.choice.clear();
        for t in 0..n {
            let row = &s.logits[t * ne..(t + 1) * ne];
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            s.probs.clear();
            s.probs.extend(row.iter().map(|v| (v - max).exp()));
            let sum: f32 = s.probs.iter().sum();
            s.order.clear();
            s.order.extend(0..ne);
            let p = &s.probs;
            s.order
                .sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
            let top = &s.order[..k];
            let norm = if cfg.norm_topk {
                top.iter().map(|&e| p[e]).sum::<f32>()
            } else {
                sum
            };
            for &e in top {
                s.choice.push((e, p[e] / norm));
                self.expert_tokens[l * ne + e].fetch_add(1, Ordering::Relaxed);
            }
        }

        // 2. Dispatch this rank's tokens to the experts' owners.
        let owner = |e: usize| (0..world).find(|&r| Shard::uneven(ne, world, r).contains(&e));
        let mine = Shard::uneven(n, world, rank);
        s.send.resize_with(world, Vec::new);
        s.send.iter_mut().for_each(Vec::clear);
        for t in mine.clone() {
            for &(e, _) in &s.choice[t * k..(t + 1) * k] {
                let dest = owner(e).expect("every expert has an owner");
                s.send[dest].push(e as f32);
                s.send[dest].extend_from_slice(&h[t * hidden..(t + 1) * hidden]);
            }
        }
        self.collective.all_to_all_v(&s.send, &mut s.recv)?;

        // 3. Run this rank's experts, batched per expert, answering in arrival order.
        let local = layer.first..layer.first + layer.experts.len();
        s.work.resize_with(layer.experts.len(), Vec::new);
        s.work.iter_mut().for_each(Vec::clear);
        s.back.resize_with(world, Vec::new);
        for (src, msg) in s.recv.iter().enumerate() {
            if msg.len() % (hidden + 1) != 0 {
                return Err(CollectiveError::Invalid(format!(
                    "MoE dispatch from rank {src}: {} values is not a whole number of rows",
                    msg.len()
                )));
            }
            for (i, entry) in msg.chunks_exact(hidden + 1).enumerate() {
                let e = entry[0] as usize;
                if !local.contains(&e) {
                    return Err(CollectiveError::Invalid(format!(
                        "rank {src} sent a token for expert {e}, which rank {rank} does not own"
                    )));
                }
                s.work[e - layer.first].push((src, i));
            }
            s.back[src].clear();
            s.back[src].resize(msg.len() / (hidden + 1) * hidden, 0.0);
        }
        for (x, expert) in layer.experts.iter().enumerate() {
            let items = &s.work[x];
            if items.is_empty() {
                continue;
            }
            s.rows.clear();
            for &(src, i) in items {
                let at = i * (hidden + 1) + 1;
                s.rows.extend_from_slice(&s.recv[src][at..at + hidden]);
            }
            let bufs = (&mut s.gate, &mut s.up, &mut s.out);
            run_mlp(expert, &s.rows, items.len(), &mut s.acts, bufs, th);
            for (j, &(src, i)) in items.iter().enumerate() {
                s.back[src][i * hidden..(i + 1) * hidden]
                    .copy_from_slice(&s.out[j * hidden..(j + 1) * hidden]);
            }
        }
        self.collective.all_to_all_v(&s.back, &mut s.results)?;

        // 4. Combine in k order on the token's rank, add the shared expert, all-reduce.
        out.clear();
        out.resize(n * hidden, 0.0);
        let mut cursor = vec![0usize; world];
        for t in mine {
            let o = &mut out[t * hidden..(t + 1) * hidden];
            for &(e, w) in &s.choice[t * k..(t + 1) * k] {
                let src = owner(e).expect("every expert has an owner");
                let c = cursor[src];
                let r = s.results[src]
                    .get(c * hidden..(c + 1) * hidden)
                    .ok_or_else(|| {
                        CollectiveError::Invalid(format!("rank {src} returned too few MoE rows"))
                    })?;
                for (a, b) in o.iter_mut().zip(r) {
                    *a += w * b;
                }
                cursor[src] += 1;
            }
        }
        if let Some(sh) = &layer.shared {
            // The routed part and the shared part are reduced as the two halves of one buffer
            // and added afterwards. Adding the routed output into this rank's shared part
            // would put it at the owner's place in the all-reduce's rank order, and which rank
            // owns a token depends on how many tokens the step has: the sum would then change
            // with the batch. This way a token's output is `routed + Σ_r shared_r` (the
            // routed half sums one nonzero value with zeros, exactly), whatever the batch.
            let bufs = (&mut s.gate, &mut s.up, &mut s.out);
            run_mlp(&sh.mlp, h, n, &mut s.acts, bufs, th);
            let m = n * hidden;
            out.resize(2 * m, 0.0);
            for t in 0..n {
                let x = &h[t * hidden..(t + 1) * hidden];
                let g: f32 = x.iter().zip(&sh.gate).map(|(a, b)| a * b).sum();
                let g = 1.0 / (1.0 + (-g).exp());
                for (a, b) in out[m + t * hidden..m + (t + 1) * hidden]
                    .iter_mut()
                    .zip(&s.out[t * hidden..(t + 1) * hidden])
                {
                    *a = g * b;
                }
            }
            self.collective.all_reduce_sum(out)?;
            let (routed, shared) = out.split_at_mut(m);
            for (a, b) in routed.iter_mut().zip(shared.iter()) {
                *a += b;
            }
            out.truncate(m);
            return Ok(());
        }
        // Only the token's rank contributes a nonzero value: the sum is exact.
        self.collective.all_reduce_sum(out)
    }

    /// Tokens routed to each expert so far, `[layer][expert]` (empty rows for dense layers and
    /// dense models). Every rank runs the router over every token, so any one rank's counts
    /// cover all experts of the group; export them from one rank (the leader).
    pub fn expert_counts(&self) -> Vec<Vec<u64>> {
        let Some(cfg) = &self.config.moe else {
            return Vec::new();
        };
        (0..self.config.n_layers)
            .map(|l| {
                if !cfg.sparse_layers[l] {
                    return Vec::new();
                }
                self.expert_tokens[l * cfg.n_experts..(l + 1) * cfg.n_experts]
                    .iter()
                    .map(|c| c.load(Ordering::Relaxed))
                    .collect()
            })
            .collect()
    }
}
