//! cleave's model runtime, shared by the prefill and decode workers.
//!
//! The path of a request through the engine, in module order:
//! - [`gguf`] reads a GGUF file (metadata and tensors) and [`tokenizer`] / [`chat`] turn text and
//!   chat messages into token ids exactly as llama.cpp does;
//! - [`kv`] is the paged KV cache: a block pool over a caller-provided memory region, reference
//!   counts, the chained block hashes of the prefix cache and the stored/removed events;
//! - [`schedule`] decides each step's batch (continuous batching, chunked prefill, preemption);
//! - [`model`] runs the forward pass over that batch with [`kernels`] (quantized matmuls) and a
//!   paged-attention kernel that reads keys and values straight from block slots;
//! - [`sample`] turns logits into tokens (under a [`constrain`] grammar's mask when the request
//!   has one); [`engine`] is the handle async callers use.

pub mod chat;
pub mod collective;
pub mod constrain;
pub mod engine;
pub mod gguf;
pub mod inspect;
pub mod kernels;
pub mod kv;
pub mod load;
pub mod model;
pub mod safetensors;
pub mod sample;
pub mod schedule;
pub mod tiny;
pub mod tokenizer;
