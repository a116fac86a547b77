//! `--target gguf`: mutated GGUF files through the parser, `model inspect`, the tokenizer and
//! chat-template readers and the model loader; a file that loads also runs one forward pass.
//!
//! Seeds: the engine's tiny mixed-quantization llama (every tensor type cleave loads, built
//! into this binary) and, when `scripts/llama-vocab` fetched them, two of llama.cpp's
//! vocabulary-only GGUFs (SentencePiece and BPE). Most edits land in the header (metadata and
//! tensor infos: lengths, counts, types, offsets), where the parser makes its decisions.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_engine::kernels::Threads;
use cleave_engine::kv::memory::{KvCache, KvDtype};
use cleave_engine::kv::BlockId;
use cleave_engine::model::{Logits, Model, SeqChunk, Workspace};
use cleave_text::chat::ChatTemplate;
use cleave_text::gguf::{GgufError, GgufFile};
use cleave_text::tokenizer::Tokenizer;
use cleave_types::collective::SingleRank;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

use super::{mutate, Cases, Tally};

/// The engine's test file mixing every supported tensor type (246 KB).
const MIXED: &[u8] = include_bytes!("../../../engine/tests/data/mixed_quant.gguf");
/// A case slower than this counts as a hang.
const SLOW: Duration = Duration::from_secs(10);

/// A file the mutations start from.
pub struct Seed {
    /// What it is, for failure messages.
    pub name: &'static str,
    /// Its bytes.
    pub bytes: Vec<u8>,
    /// About how many leading bytes are header (metadata and tensor infos, in front of the
    /// aligned tensor data), where most edits go.
    pub header: usize,
}

impl Seed {
    fn new(name: &'static str, bytes: Vec<u8>) -> Self {
        let header = GgufFile::from_bytes(bytes.clone())
            .map(|g| g.tensors.len() * 64 + g.metadata.len() * 64 + 4096)
            .unwrap_or(4096)
            .min(bytes.len());
        Seed {
            name,
            bytes,
            header,
        }
    }
}

/// The files the mutations start from.
pub fn seeds() -> Vec<Seed> {
    let mut out = vec![Seed::new("mixed_quant", MIXED.to_vec())];
    let dir = super::llama_vocab_dir();
    for (name, file) in [
        ("llama-spm", "ggml-vocab-llama-spm.gguf"),
        ("phi-3", "ggml-vocab-phi-3.gguf"),
    ] {
        if let Ok(bytes) = std::fs::read(dir.join(file)) {
            out.push(Seed::new(name, bytes));
        }
    }
    out
}

/// The error's kind, for the tally.
fn kind(e: &GgufError) -> String {
    let text = format!("{e:?}");
    let end = text.find(['(', ' ', '{']).unwrap_or(text.len());
    format!("parse:{}", &text[..end])
}

/// Everything a file goes through; returns the outcome's name.
fn exercise(bytes: Vec<u8>) -> String {
    let g = match GgufFile::from_bytes(bytes) {
        Ok(g) => g,
        Err(e) => return kind(&e),
    };
    let _ = cleave_engine::inspect::inspect(&g).to_string();
    let tok = Tokenizer::from_gguf(&g).ok();
    if let Some(tok) = &tok {
        let ids = tok.encode("Hello wörld 😀 <s> \u{0}", false);
        let _ = tok.decode(&ids);
        let _ = ChatTemplate::from_gguf(&g, tok);
    }
    let model = match Model::load(&g, Arc::new(SingleRank), Threads::single()) {
        Ok(m) => m,
        Err(_) => return format!("parsed, tokenizer {}, model refused", tok.is_some()),
    };
    // It loaded: one prefill of three tokens must run (shapes were checked at load).
    let vocab = model.config.vocab.max(1) as u32;
    let tokens = [1 % vocab, 2 % vocab, 3 % vocab];
    let layout = model.kv_layout(16, KvDtype::F32);
    let mut cache = KvCache::on_heap(layout, 1);
    let mut ws = Workspace::new();
    let chunk = SeqChunk {
        tokens: &tokens,
        start_pos: 0,
        blocks: &[BlockId(0)],
        logits: Logits::Last,
    };
    match model.forward(&[chunk], &mut cache, &mut ws) {
        Ok(_) => "loaded and ran".into(),
        Err(_) => "loaded, forward refused".into(),
    }
}

/// Mutates a copy of `seed`, mostly in its header.
fn mutant(rng: &mut StdRng, seed: &Seed) -> Vec<u8> {
    let header = seed.header;
    let mut b = seed.bytes.clone();
    if rng.gen_bool(0.8) {
        // Edit only a window of the header, then put it back.
        let at = rng.gen_range(0..header);
        let end = (at + rng.gen_range(1..256)).min(header);
        let mut window = b[at..end].to_vec();
        mutate::bytes(rng, &mut window);
        b.splice(at..end, window);
    } else {
        mutate::bytes(rng, &mut b);
    }
    if rng.gen_bool(0.3) {
        // A length, count or offset field at a random aligned spot in the header.
        let at = rng.gen_range(0..header.saturating_sub(8).max(1)) & !7;
        if at + 8 <= b.len() {
            b[at..at + 8].copy_from_slice(&mutate::edge_u64(rng).to_le_bytes());
        }
    }
    b
}

/// The campaign.
pub fn fuzz(cases: Cases) -> anyhow::Result<Tally> {
    let seeds = seeds();
    let mut tally = Tally::new("gguf");
    for i in cases.range() {
        let rng = &mut cases.rng(i);
        let seed = seeds.choose(rng).expect("seeds");
        let name = seed.name;
        let bytes = mutant(rng, seed);
        let started = Instant::now();
        let result = super::unwound(|| exercise(bytes));
        let took = started.elapsed();
        match result {
            Err(p) => tally.fail(i, format!("panicked on a mutant of {name}: {p}")),
            Ok(_) if took > SLOW => tally.fail(i, format!("{name} mutant took {took:?}")),
            Ok(outcome) => tally.ok(outcome),
        }
    }
    Ok(tally)
}
