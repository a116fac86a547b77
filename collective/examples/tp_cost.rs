//! What batch invariance costs a tensor-parallel group: prefill and decode tok/s of a TP group
//! whose ranks are threads of this process joined over loopback TCP (`NetGroup`, as between
//! worker processes), with the rank-order all-reduce (the default, batch invariant) and with
//! the ring (the earlier algorithm, whose order of additions depends on the message size),
//! alternating in one run so both see the same machine.
//!
//! ```sh
//! cargo run -p cleave-collective --example tp_cost -- [--world 3] [--rounds 3] [--model PATH]
//! ```
//!
//! Measured per round and mode: prefill of a 512-token prompt in chunks of 256 (all-reduces
//! of 590 KB at hidden 576), 64 decode steps of one sequence (2.3 KB, the direct path in both
//! modes) and 32 decode steps of 32 sequences (74 KB, above the 64 KiB direct threshold).

use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use cleave_collective::{AllReduceOrder, GroupConfig, NetGroup, Pending};
use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvCache, KvDtype};
use cleave_engine::kv::BlockId;
use cleave_engine::load::Loaded;
use cleave_engine::model::{Logits, Model, SeqChunk, Workspace};
use cleave_text::gguf::default_model_path;
use cleave_types::collective::Collective;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// A table row: its label, which time it reads, and the tokens that time covers.
type Row = (&'static str, fn(&Times) -> f64, usize);

const PROMPT: usize = 512;
const CHUNK: usize = 256;
const DECODE: usize = 64;
const BATCH: usize = 32;
const BATCH_STEPS: usize = 32;

/// Seconds for prefill, decode at batch 1 and decode at batch [`BATCH`] on one rank.
#[derive(Clone, Copy, Debug, Default)]
struct Times {
    prefill: f64,
    decode1: f64,
    decode_b: f64,
}

fn main() -> Result<(), Error> {
    let mut world = 3;
    let mut rounds = 3;
    let mut model = default_model_path();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--world" => world = value()?.parse()?,
            "--rounds" => rounds = value()?.parse()?,
            "--model" => model = PathBuf::from(value()?),
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    if world < 2 || rounds == 0 {
        return Err("--world must be at least 2 and --rounds at least 1".into());
    }
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../engine/tests/data/apache2_excerpt.txt"
    ))?;
    let l = Loaded::open(&model, Threads::single())?;
    let vocab = l.model.config.vocab as u32;
    let tokens: Vec<u32> = l
        .tokenizer
        .encode(&text, false)
        .into_iter()
        .map(|t| t % vocab)
        .cycle()
        .take(PROMPT + DECODE + BATCH * 16)
        .collect();
    drop(l);

    let modes = [AllReduceOrder::Ring, AllReduceOrder::RankOrder];
    let mut all: Vec<Vec<Times>> = vec![Vec::new(); modes.len()];
    for round in 0..rounds {
        for (i, &mode) in modes.iter().enumerate() {
            let t = run_group(&model, world, mode, &tokens)?;
            eprintln!(
                "round {round} {mode:?}: prefill {:.1} tok/s, decode b1 {:.1}, decode b{BATCH} {:.1}",
                PROMPT as f64 / t.prefill,
                DECODE as f64 / t.decode1,
                (BATCH * BATCH_STEPS) as f64 / t.decode_b
            );
            all[i].push(t);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let rate = |i: usize, f: fn(&Times) -> f64, n: usize| {
        let mut v: Vec<f64> = all[i].iter().map(|t| n as f64 / f(t)).collect();
        median(&mut v)
    };
    println!(
        "TP={world} {} ({rounds} rounds, median tok/s; ring = before, rank order = after)",
        model.display()
    );
    println!("| measure | ring | rank order | after / before |");
    println!("| --- | --- | --- | --- |");
    let rows: [Row; 3] = [
        ("prefill (512 tokens, chunks of 256)", |t| t.prefill, PROMPT),
        ("decode, batch 1", |t| t.decode1, DECODE),
        (
            "decode, batch 32 (aggregate)",
            |t| t.decode_b,
            BATCH * BATCH_STEPS,
        ),
    ];
    for (name, f, n) in rows {
        let (before, after) = (rate(0, f, n), rate(1, f, n));
        println!(
            "| {name} | {before:.1} | {after:.1} | {:.3} |",
            after / before
        );
    }
    Ok(())
}

/// Forms a group of `world` threads with `mode`, runs the measurements on every rank and
/// returns rank 0's times.
fn run_group(
    model: &std::path::Path,
    world: usize,
    mode: AllReduceOrder,
    tokens: &[u32],
) -> Result<Times, Error> {
    let tweak = |c: &mut GroupConfig| {
        c.bind_addr = Some("127.0.0.1:0".parse().expect("address"));
        c.all_reduce = mode;
        c.timeout = Duration::from_secs(120);
    };
    let mut cfg = GroupConfig::new(0, world, "127.0.0.1:0");
    tweak(&mut cfg);
    let pending = Pending::bind(cfg)?;
    let addr = pending.local_addr()?.to_string();
    let (tx, rx) = mpsc::channel();
    let mut pending = Some(pending);
    for rank in 0..world {
        let mut cfg = GroupConfig::new(rank, world, addr.clone());
        tweak(&mut cfg);
        let mine = if rank == 0 { pending.take() } else { None };
        let (tx, model, tokens) = (tx.clone(), model.to_path_buf(), tokens.to_vec());
        std::thread::spawn(move || {
            let run = || -> Result<Times, Error> {
                let group = match mine {
                    Some(p) => p.join()?,
                    None => NetGroup::connect(cfg)?,
                };
                let c: Arc<dyn Collective> = Arc::new(group);
                let l = Loaded::open_rank(&model, c.clone(), Threads::single())?;
                measure(&l.model, c.as_ref(), &tokens)
            };
            let _ = tx.send((rank, run().map_err(|e| e.to_string())));
        });
    }
    let mut rank0 = None;
    for _ in 0..world {
        let (rank, r) = rx.recv_timeout(Duration::from_secs(600))?;
        let t = r.map_err(|e| format!("rank {rank}: {e}"))?;
        if rank == 0 {
            rank0 = Some(t);
        }
    }
    rank0.ok_or_else(|| "rank 0 reported nothing".into())
}

fn measure(m: &Model, c: &dyn Collective, tokens: &[u32]) -> Result<Times, Error> {
    let bs = 16;
    let long_blocks = (PROMPT + DECODE).div_ceil(bs);
    let short_blocks = (16 + BATCH_STEPS).div_ceil(bs);
    let layout = m.kv_layout(bs, KvDtype::F32);
    let mut cache = KvCache::on_heap(layout, long_blocks + BATCH * short_blocks);
    let ids = |from: usize, n: usize| -> Vec<BlockId> {
        (from as u32..(from + n) as u32).map(BlockId).collect()
    };
    let long: Vec<BlockId> = ids(0, long_blocks);
    let short: Vec<Vec<BlockId>> = (0..BATCH)
        .map(|s| ids(long_blocks + s * short_blocks, short_blocks))
        .collect();
    let mut ws = Workspace::new();
    let mut t = Times::default();

    c.barrier()?;
    let start = Instant::now();
    for at in (0..PROMPT).step_by(CHUNK) {
        let toks = &tokens[at..at + CHUNK];
        m.forward(&[chunk(toks, at, &long)], &mut cache, &mut ws)?;
    }
    c.barrier()?;
    t.prefill = start.elapsed().as_secs_f64();

    let start = Instant::now();
    for i in 0..DECODE {
        let pos = PROMPT + i;
        m.forward(
            &[chunk(&tokens[pos..pos + 1], pos, &long)],
            &mut cache,
            &mut ws,
        )?;
    }
    c.barrier()?;
    t.decode1 = start.elapsed().as_secs_f64();

    // Batched decode: BATCH sequences of 16 prompt tokens (prefilled together, untimed).
    let base = PROMPT + DECODE;
    let prompts: Vec<SeqChunk> = (0..BATCH)
        .map(|s| chunk(&tokens[base + s * 16..base + s * 16 + 16], 0, &short[s]))
        .collect();
    m.forward(&prompts, &mut cache, &mut ws)?;
    c.barrier()?;
    let start = Instant::now();
    for i in 0..BATCH_STEPS {
        let step: Vec<SeqChunk> = (0..BATCH)
            .map(|s| {
                let at = base + s * 16 + (i % 16);
                chunk(&tokens[at..at + 1], 16 + i, &short[s])
            })
            .collect();
        m.forward(&step, &mut cache, &mut ws)?;
    }
    c.barrier()?;
    t.decode_b = start.elapsed().as_secs_f64();
    Ok(t)
}

/// A chunk of one sequence that wants its last token's logits.
fn chunk<'a>(tokens: &'a [u32], start_pos: usize, blocks: &'a [BlockId]) -> SeqChunk<'a> {
    SeqChunk {
        tokens,
        start_pos,
        blocks,
        logits: Logits::Last,
    }
}
