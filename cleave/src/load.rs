//! Resolving `--model` (default: the cached default model, fetched on first use) and loading it.

use anyhow::Context;
use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;

use crate::ModelArgs;

/// Loads the model the arguments name.
pub fn load(args: &ModelArgs) -> anyhow::Result<Loaded> {
    let path = match &args.model {
        Some(p) => p.clone(),
        None => crate::fetch::fetch_default_model(false)?,
    };
    let threads = if args.threads <= 1 {
        Threads::single()
    } else {
        Threads::new(args.threads)
    };
    Loaded::open(&path, threads).with_context(|| format!("loading {}", path.display()))
}
