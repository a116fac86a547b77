//! cleave's model runtime, shared by the prefill and decode workers.
//!
//! The text layer (GGUF and safetensors readers, tokenizer, chat templates, grammars, sampling)
//! is `cleave-text`'s, which the router uses without linking this crate. The path of a request
//! through the engine, in module order:
//! - [`load`] reads a model (GGUF file or Hugging Face directory) into [`model`]'s weights, with
//!   its tokenizer and chat template from `cleave-text`;
//! - [`kv`] is the paged KV cache: a block pool over a caller-provided memory region, reference
//!   counts, the chained block hashes of the prefix cache and the stored/removed events;
//! - [`schedule`] decides each step's batch (continuous batching, chunked prefill, preemption);
//! - [`model`] runs the forward pass over that batch with [`kernels`] (quantized matmuls) and a
//!   paged-attention kernel that reads keys and values straight from block slots;
//! - `cleave_text::sample` turns logits into tokens (under a `cleave_text::constrain` grammar's
//!   mask when the request has one); [`engine`] is the handle async callers use.

pub mod engine;
pub mod inspect;
pub mod kernels;
pub mod kv;
pub mod load;
pub mod model;
pub mod schedule;
