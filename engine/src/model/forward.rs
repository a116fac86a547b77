//! The layer loop.

use crate::kernels::Activations;
use crate::kv::memory::KvCache;
use crate::kv::BlockId;
use cleave_types::collective::CollectiveError;

use super::attention::{attend, write_kv, AttnParams, AttnScratch, TokenSlot};
use super::config::{Activation, ModelConfig, RopeScaling};
use super::moe::MoeScratch;
use super::ops::{
    add_bias, add_inplace, geglu, matmul, rms_norm, rms_norm_inplace, softcap, swiglu, Rope,
};
use super::weights::Ffn;
use super::Model;

/// Which logits a chunk wants back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (a prefill chunk that does not reach the end of the known tokens).
    None,
    /// The last token's (to sample the next token).
    Last,
    /// Every token's (teacher-forced scoring).
    All,
}

/// A run of consecutive tokens of one sequence to compute in this step.
#[derive(Clone, Copy, Debug)]
pub struct SeqChunk<'a> {
    /// The tokens.
    pub tokens: &'a [u32],
    /// Position of `tokens[0]` in the sequence (tokens before it are already in the KV cache).
    pub start_pos: usize,
    /// The sequence's block table, covering at least `start_pos + tokens.len()` positions.
    pub blocks: &'a [BlockId],
    /// Which logits to return.
    pub logits: Logits,
}

/// Buffers reused across steps so the per-token loop does not allocate after warm-up.
#[derive(Default)]
pub struct Workspace {
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    acts: Activations,
    attn: AttnScratch,
    /// RoPE tables of the global layers and, when they differ, of the window layers.
    rope: Option<(Rope, Option<Rope>)>,
    row: Vec<f32>,
    local_logits: Vec<f32>,
    gathered: Vec<f32>,
    moe: MoeScratch,
    /// Logits of the requested tokens, `vocab` per row, in chunk order.
    pub logits: Vec<f32>,
}

impl Workspace {
    /// An empty workspace.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The RoPE tables: the global layers' (with the model's frequency scaling) and, when window
/// layers rotate with another base or scale, theirs.
fn ropes(cfg: &ModelConfig) -> (Rope, Option<Rope>) {
    let rope = |theta, scaling: &RopeScaling| {
        Rope::scaled(theta, cfg.rope_dim, cfg.head_dim, cfg.rope_style, scaling)
    };
    let global = rope(cfg.rope_theta, &cfg.rope_scaling);
    let local = cfg.options.sliding_window.as_ref().and_then(|w| {
        let scaling = RopeScaling {
            freq_scale: w.rope_freq_scale,
            factors: None,
            attn_factor: cfg.rope_scaling.attn_factor,
        };
        (w.rope_theta != cfg.rope_theta || scaling != cfg.rope_scaling)
            .then(|| rope(w.rope_theta, &scaling))
    });
    (global, local)
}

impl Model {
    /// Runs one step over `chunks`, writing their keys/values into `cache`; returns the number
    /// of logit rows written to `ws.logits` (one per requested token, in order). Fails only when
    /// a collective with other ranks fails (the group is then unusable).
    pub fn forward(
        &self,
        chunks: &[SeqChunk],
        cache: &mut KvCache,
        ws: &mut Workspace,
    ) -> Result<usize, CollectiveError> {
        let cfg = &self.config;
        let (hidden, hd) = (cfg.hidden, cfg.head_dim);
        let (nh, nkv) = (self.local_heads(), self.local_kv_heads());
        let th = &self.threads;
        let mut slots: Vec<TokenSlot> = Vec::new();
        let mut positions = Vec::new();
        let mut tokens = Vec::new();
        for c in chunks {
            for (i, &t) in c.tokens.iter().enumerate() {
                let pos = c.start_pos + i;
                slots.push(TokenSlot {
                    pos,
                    blocks: c.blocks,
                });
                positions.push(pos);
                tokens.push(t);
            }
        }
        let n = tokens.len();
        if n == 0 {
            return Ok(0);
        }
        let (rope, rope_swa) = ws.rope.get_or_insert_with(|| ropes(cfg));
        rope.prepare(&positions);
        if let Some(r) = rope_swa {
            r.prepare(&positions);
        }

        ws.x.resize(n * hidden, 0.0);
        for (t, &tok) in tokens.iter().enumerate() {
            let row = (tok as usize).min(cfg.vocab - 1);
            let x = &mut ws.x[t * hidden..(t + 1) * hidden];
            self.weights.tok_embd.dequantize_row(row, x);
            if let Some(scale) = cfg.options.embed_scale {
                x.iter_mut().for_each(|v| *v *= scale);
            }
        }
        ws.h.resize(n * hidden, 0.0);

        for (l, layer) in self.weights.layers.iter().enumerate() {
            rms_norm(&ws.x, &layer.attn_norm, cfg.rms_eps, &mut ws.h);
            ws.acts.set(&ws.h, n, hidden);
            for (m, b, out) in [
                (&layer.wq, &layer.bq, &mut ws.q),
                (&layer.wk, &layer.bk, &mut ws.k),
                (&layer.wv, &layer.bv, &mut ws.v),
            ] {
                out.resize(n * m.rows(), 0.0);
                m.matmul(&ws.acts, out, th);
                if let Some(b) = b {
                    add_bias(out, b);
                }
            }
            if let Some(w) = &layer.q_norm {
                rms_norm_inplace(&mut ws.q, w, cfg.rms_eps);
            }
            if let Some(w) = &layer.k_norm {
                rms_norm_inplace(&mut ws.k, w, cfg.rms_eps);
            }
            let window = cfg.window(l);
            let rope = match ws.rope.as_ref().expect("prepared above") {
                (_, Some(swa)) if window.is_some() => swa,
                (global, _) => global,
            };
            for t in 0..n {
                rope.apply(t, &mut ws.q[t * nh * hd..(t + 1) * nh * hd]);
                rope.apply(t, &mut ws.k[t * nkv * hd..(t + 1) * nkv * hd]);
            }
            write_kv(cache, l, &slots, &ws.k, &ws.v);
            ws.att.resize(n * nh * hd, 0.0);
            let params = AttnParams {
                scale: cfg.options.attn_scale,
                softcap: cfg.options.attn_softcap,
                window,
            };
            attend(
                cache,
                l,
                &slots,
                &ws.q,
                nh,
                &params,
                &mut ws.att,
                &mut ws.attn,
                th,
            );
            matmul(&layer.wo, &mut ws.acts, &ws.att, n, &mut ws.o, th);
            self.collective.all_reduce_sum(&mut ws.o)?;
            if let Some(w) = &layer.attn_post_norm {
                rms_norm_inplace(&mut ws.o, w, cfg.rms_eps);
            }
            add_inplace(&mut ws.x, &ws.o);

            rms_norm(&ws.x, &layer.ffn_norm, cfg.rms_eps, &mut ws.h);
            match &layer.ffn {
                Ffn::Dense(mlp) => {
                    ws.acts.set(&ws.h, n, hidden);
                    for (m, out) in [(&mlp.w_gate, &mut ws.gate), (&mlp.w_up, &mut ws.up)] {
                        out.resize(n * m.rows(), 0.0);
                        m.matmul(&ws.acts, out, th);
                    }
                    match cfg.options.act {
                        Activation::Silu => swiglu(&mut ws.gate, &ws.up),
                        Activation::GeluTanh => geglu(&mut ws.gate, &ws.up),
                    }
                    matmul(&mlp.w_down, &mut ws.acts, &ws.gate, n, &mut ws.o, th);
                    self.collective.all_reduce_sum(&mut ws.o)?;
                }
                Ffn::Moe(moe) => self.moe_ffn(l, moe, &ws.h, n, &mut ws.o, &mut ws.moe)?,
            }
            if let Some(w) = &layer.ffn_post_norm {
                rms_norm_inplace(&mut ws.o, w, cfg.rms_eps);
            }
            add_inplace(&mut ws.x, &ws.o);
        }

        // Final norm and LM head, only for the tokens whose logits were asked for.
        ws.row.clear();
        let mut t0 = 0;
        for c in chunks {
            let len = c.tokens.len();
            let wanted = match c.logits {
                Logits::None => 0..0,
                Logits::Last => len - 1..len,
                Logits::All => 0..len,
            };
            for t in wanted {
                ws.row
                    .extend_from_slice(&ws.x[(t0 + t) * hidden..(t0 + t + 1) * hidden]);
            }
            t0 += len;
        }
        let rows = ws.row.len() / hidden;
        if rows == 0 {
            ws.logits.clear();
            return Ok(0);
        }
        ws.h.resize(rows * hidden, 0.0);
        rms_norm(
            &ws.row,
            &self.weights.output_norm,
            cfg.rms_eps,
            &mut ws.h[..rows * hidden],
        );
        let head = &self.weights.output;
        let h = std::mem::take(&mut ws.h);
        matmul(
            head,
            &mut ws.acts,
            &h[..rows * hidden],
            rows,
            &mut ws.local_logits,
            th,
        );
        ws.h = h;
        self.gather_vocab(rows, ws)?;
        if let Some(cap) = cfg.options.final_softcap {
            softcap(&mut ws.logits, cap);
        }
        Ok(rows)
    }

    /// Puts the full-vocabulary logits into `ws.logits` (vocab-parallel head: gather and
    /// interleave each rank's slice per row).
    fn gather_vocab(&self, rows: usize, ws: &mut Workspace) -> Result<(), CollectiveError> {
        let world = self.collective.world();
        if world == 1 {
            std::mem::swap(&mut ws.logits, &mut ws.local_logits);
            return Ok(());
        }
        self.collective
            .all_gather(&ws.local_logits, &mut ws.gathered)?;
        let part = ws.local_logits.len() / rows;
        ws.logits.resize(rows * part * world, 0.0);
        for r in 0..world {
            for row in 0..rows {
                let src = &ws.gathered[(r * rows + row) * part..(r * rows + row + 1) * part];
                let dst = row * part * world + r * part;
                ws.logits[dst..dst + part].copy_from_slice(src);
            }
        }
        Ok(())
    }
}
