//! `cleave bench tp-deviation`: how far a tensor-parallel group's numbers are from one
//! process's, on prompts of 300-700 tokens cut from a text file (it prints a table):
//!
//! ```sh
//! cleave bench tp-deviation --file engine/tests/data/apache2_excerpt.txt
//! ```
//!
//! Teacher-forced over each prompt: next-token argmax agreement of TP=3 (by default) with TP=1, and the
//! distribution of |Δ logprob| of the actual next token, by position (short context < 128,
//! 128-299, 300+), plus the positions where TP=1 had a clear top choice (margin > 0.1 nat)
//! that TP=3 did not pick (`--tp` sets the group's size). It also checks, for both sizes, that
//! prefilling the prompt in
//! chunks of 256 gives the same logits bit for bit as one chunk (batch invariance), so the
//! difference it measures is the group layout's alone. TP=2 cannot run the default model
//! (3 KV heads).
//!
//! The ranks are threads over `LocalGroup`, whose all-reduce adds in the same rank order as
//! the network groups (`cleave-collective`), so the numbers are those of a group of processes.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{ensure, Context};
use clap::Args;

use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvCache, KvDtype};
use cleave_engine::kv::BlockId;
use cleave_engine::model::{Logits, Model, SeqChunk, Workspace};
use cleave_text::gguf::GgufFile;
use cleave_text::ModelText;
use cleave_types::collective::{Collective, LocalGroup, SingleRank};

const LENGTHS: [usize; 5] = [300, 400, 500, 600, 700];

/// Per position of one prompt: argmax, logprob of the next prompt token, logprob of a given
/// token (TP=1's argmax), top-2 margin; and a hash of every logit row's bits.
#[derive(Clone, Default)]
struct Pass {
    argmax: Vec<u32>,
    lp_next: Vec<f32>,
    lp_given: Vec<f32>,
    margin: Vec<f32>,
    hashes: Vec<u64>,
}

fn row_hash(row: &[f32]) -> u64 {
    row.iter().fold(0xcbf2_9ce4_8422_2325, |h, v| {
        (h ^ v.to_bits() as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Runs `tokens` through the model in chunks of `chunk` with every position's logits.
fn pass(m: &Model, tokens: &[u32], chunk: usize, given: Option<&[u32]>, stats: bool) -> Pass {
    let bs = 16;
    let layout = m.kv_layout(bs, KvDtype::F32);
    let nb = tokens.len().div_ceil(bs);
    let mut cache = KvCache::on_heap(layout, nb);
    let blocks: Vec<BlockId> = (0..nb as u32).map(BlockId).collect();
    let mut ws = Workspace::new();
    let vocab = m.config.vocab;
    let mut p = Pass::default();
    for at in (0..tokens.len()).step_by(chunk) {
        let end = (at + chunk).min(tokens.len());
        let c = SeqChunk {
            tokens: &tokens[at..end],
            start_pos: at,
            blocks: &blocks,
            logits: Logits::All,
        };
        m.forward(&[c], &mut cache, &mut ws)
            .expect("in-process collectives");
        for (i, row) in ws.logits.chunks_exact(vocab).enumerate() {
            let pos = at + i;
            p.hashes.push(row_hash(row));
            if !stats || pos + 1 >= tokens.len() {
                continue;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f32>().ln();
            // Top two, ties to the lower id (as the sampler's argmax).
            let (mut a, mut b) = (0usize, usize::MAX);
            for (j, &v) in row.iter().enumerate().skip(1) {
                if v > row[a] {
                    (a, b) = (j, a);
                } else if b == usize::MAX || v > row[b] {
                    b = j;
                }
            }
            let (a, b) = (a as u32, b as u32);
            p.argmax.push(a);
            p.margin.push(row[a as usize] - row[b as usize]);
            p.lp_next.push(row[tokens[pos + 1] as usize] - lse);
            let g = given.map_or(a, |g| g[pos]);
            p.lp_given.push(row[g as usize] - lse);
        }
    }
    p
}

/// Both passes (one chunk with statistics, chunks of 256 for the hashes) over every prompt.
fn run(m: &Model, prompts: &[Vec<u32>], given: &[Vec<u32>]) -> Vec<(Pass, Vec<u64>)> {
    prompts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let one = pass(m, t, t.len(), given.get(i).map(|g| g.as_slice()), true);
            let chunked = pass(m, t, 256, None, false);
            (one, chunked.hashes)
        })
        .collect()
}

fn quantile(v: &mut [f32], q: f64) -> f32 {
    if v.is_empty() {
        return f32::NAN;
    }
    v.sort_by(f32::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Flags of `cleave bench tp-deviation`.
#[derive(Debug, Args)]
pub struct TpDeviationArgs {
    /// A GGUF file; default: the cached default model (fetched on first use).
    #[arg(long, env = "CLEAVE_MODEL")]
    pub model: Option<PathBuf>,
    /// The text the prompts are cut from (windows starting at different places, wrapping).
    #[arg(long)]
    pub file: PathBuf,
    /// The tensor-parallel size compared with one process (it must divide the model's KV
    /// heads).
    #[arg(long, default_value_t = 3)]
    pub tp: usize,
}

pub fn tp_deviation(args: TpDeviationArgs) -> anyhow::Result<()> {
    let path = match args.model {
        Some(p) => p,
        None => crate::fetch::fetch_default_model(false)?,
    };
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let tokenizer = ModelText::open(&path)?.tokenizer;
    let ids = tokenizer.encode(&text, false);
    ensure!(!ids.is_empty(), "{} has no tokens", args.file.display());
    let tp = args.tp;
    let n = ids.len();
    // Windows starting at different places of the text (wrapping around).
    let prompts: Vec<Vec<u32>> = LENGTHS
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|j| ids[(i * 157 + j) % n])
                .collect::<Vec<u32>>()
        })
        .collect();

    let g = Arc::new(GgufFile::open(&path)?);
    let one = Model::load(&g, Arc::new(SingleRank), Threads::single())?;
    let tp1 = run(&one, &prompts, &[]);
    drop(one);
    let given: Vec<Vec<u32>> = tp1.iter().map(|(p, _)| p.argmax.clone()).collect();
    let tp3: Vec<(Pass, Vec<u64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = LocalGroup::new(tp)
            .into_iter()
            .map(|c| {
                let (g, prompts, given) = (g.clone(), &prompts, &given);
                s.spawn(move || {
                    let c: Arc<dyn Collective> = Arc::new(c);
                    let m = Model::load(&g, c, Threads::single())?;
                    anyhow::Ok(run(&m, prompts, given))
                })
            })
            .collect();
        let mut all = Vec::new();
        for h in handles {
            all.push(h.join().expect("a rank thread panicked")?);
        }
        anyhow::Ok(all.swap_remove(0))
    })?;

    for (name, runs) in [("TP=1".to_string(), &tp1), (format!("TP={tp}"), &tp3)] {
        for (i, (p, chunked)) in runs.iter().enumerate() {
            ensure!(
                &p.hashes == chunked,
                "{name}: prompt {i}: chunks of 256 changed the logits"
            );
        }
    }
    println!(
        "chunks of 256 vs one chunk: bit-identical logits at TP=1 and TP={tp} on every prompt"
    );

    let buckets: [(&str, std::ops::Range<usize>); 4] = [
        ("positions 0-127", 0..128),
        ("positions 128-299", 128..300),
        ("positions 300-699", 300..700),
        ("all positions", 0..700),
    ];
    println!(
        "TP={tp} vs TP=1, teacher-forced, {} prompts of {LENGTHS:?} tokens ({})",
        prompts.len(),
        path.display()
    );
    println!("| positions | n | argmax agree | mean abs dlogprob(next) | p50 | p90 | p99 | max | clear TP=1 choices changed |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (label, range) in buckets {
        let (mut agree, mut total, mut clear_changed, mut clear) = (0, 0, 0, 0);
        let mut d = Vec::new();
        for ((a, _), (b, _)) in tp1.iter().zip(&tp3) {
            for pos in range.clone().take_while(|&p| p < a.argmax.len()) {
                total += 1;
                agree += usize::from(a.argmax[pos] == b.argmax[pos]);
                d.push((a.lp_next[pos] - b.lp_next[pos]).abs());
                if a.margin[pos] > 0.1 {
                    clear += 1;
                    clear_changed += usize::from(a.argmax[pos] != b.argmax[pos]);
                }
            }
        }
        let mean = d.iter().map(|&v| v as f64).sum::<f64>() / d.len().max(1) as f64;
        println!(
            "| {label} | {total} | {:.1}% | {mean:.4} | {:.4} | {:.4} | {:.4} | {:.4} | {clear_changed} of {clear} |",
            100.0 * agree as f64 / total.max(1) as f64,
            quantile(&mut d, 0.5),
            quantile(&mut d, 0.9),
            quantile(&mut d, 0.99),
            quantile(&mut d, 1.0),
        );
    }
    // How far the group moves TP=1's own choice (its logprob under each).
    let mut dg: Vec<f32> = tp1
        .iter()
        .zip(&tp3)
        .flat_map(|((a, _), (b, _))| {
            a.lp_given
                .iter()
                .zip(&b.lp_given)
                .map(|(x, y)| (x - y).abs())
                .collect::<Vec<_>>()
        })
        .collect();
    println!(
        "|dlogprob| of TP=1's argmax token: p50 {:.4}, p90 {:.4}, p99 {:.4}, max {:.4}",
        quantile(&mut dg, 0.5),
        quantile(&mut dg, 0.9),
        quantile(&mut dg, 0.99),
        quantile(&mut dg, 1.0)
    );
    Ok(())
}
