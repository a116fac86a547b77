//! `cleave score`: perplexity and next-token argmax of a text file, comparable field by field
//! with llama.cpp's reference output.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use cleave_engine::kv::memory::KvDtype;
use cleave_engine::model::score::score as score_tokens;

use crate::ModelArgs;

#[derive(Debug, Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text file (tokenized as plain text: no BOS, no special-token parsing).
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per forward pass.
    #[arg(long, default_value_t = 256)]
    pub chunk: usize,
    /// KV cache element type (f16, f32 or q8_0).
    #[arg(long, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Print the full JSON object (tokens, n_scored, nll_sum, ppl, top1_next).
    #[arg(long)]
    pub json: bool,
}

pub fn score(args: ScoreArgs) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let loaded = crate::load::load(&args.model)?;
    let tokens = loaded.tokenizer.encode(&text, false);
    let bs = cleave_engine::kv::DEFAULT_BLOCK_SIZE;
    loaded.model.kv_layout(bs, args.kv_dtype).check()?;
    anyhow::ensure!(
        tokens.len() >= 2,
        "{} has fewer than 2 tokens",
        args.file.display()
    );
    let s = score_tokens(&loaded.model, tokens, args.chunk, args.kv_dtype)?;
    if args.json {
        println!("{}", serde_json::to_string(&s)?);
    } else {
        println!(
            "tokens {}  scored {}  nll_sum {:.3}  ppl {:.4}",
            s.tokens.len(),
            s.n_scored,
            s.nll_sum,
            s.ppl
        );
    }
    Ok(())
}
