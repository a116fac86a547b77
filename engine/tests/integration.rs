//! The integration tests of this crate, compiled as one binary (`cargo test --test
//! integration`, a module path filters: `-- archs::`): one link, and the
//! shared helpers and the dependencies' generic code compiled once instead of once per file.
//! `cleave/tests/layout.rs` checks that every file under tests/ is declared here.

mod archs;
mod chat_templates;
mod common;
mod constrained;
mod disaggregated;
mod engine;
mod gguf_moe;
mod group;
mod hf_tokenizer;
mod kquant_reference;
mod llama_ref;
mod llama_vocab;
mod mixed_quant;
mod moe;
mod reference;
mod resume;
mod tensor_parallel;
mod tiers;
mod tiny;
mod tp_dense;
