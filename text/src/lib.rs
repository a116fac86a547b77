//! `cleave-text`: the model's text layer, shared by the router (which never loads weights) and
//! the engine. On the request's path it is the first step: the router renders a chat with the
//! model's template, tokenizes it, checks the sampling parameters and compiles a grammar; the
//! engine samples under the same parameters and grammar.
//!
//! - [`gguf`] and [`safetensors`] read model files (metadata, vocabulary, tensors by name,
//!   memory-mapped); [`tiny`] writes tiny Hugging Face models for tests;
//! - [`tokenizer`] turns text into token ids and back exactly as llama.cpp does (BPE and
//!   SentencePiece vocabularies);
//! - [`chat`] renders chat messages with a model's Jinja template;
//! - [`constrain`] compiles JSON schemas, regexes and grammars into per-step token masks;
//! - [`sample`] holds the sampling parameters with their one set of checks, and the sampler;
//! - [`model_text`] bundles what the front end needs of a model: tokenizer, template, context.

// Unsafe only where a model file is memory-mapped (allowed at those two calls).
#![deny(unsafe_code)]

pub mod chat;
pub mod constrain;
pub mod gguf;
pub mod model_text;
pub mod safetensors;
pub mod sample;
pub mod tiny;
pub mod tokenizer;

pub use model_text::{ModelText, TextError};
