//! `have_ucx` where `cleave-ucx-sys` found UCX: the UCX backend compiles only there, and the
//! crate falls back to TCP elsewhere.

#![allow(clippy::disallowed_methods)] // a build script reads Cargo's and the system's environment

include!("../ucx-sys/have_ucx_cfg.rs");
