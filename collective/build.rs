//! `have_ucx` where `cleave-ucx-sys` found UCX: the UCX transport compiles only there.

#![allow(clippy::disallowed_methods)] // a build script reads Cargo's and the system's environment

include!("../ucx-sys/have_ucx_cfg.rs");
