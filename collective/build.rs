//! Turns `cleave-ucx-sys`'s build-time probe (`DEP_UCP_HAVE_UCX`) into the `have_ucx` cfg, so
//! the UCX transport compiles only where UCX is installed.

#![allow(clippy::disallowed_methods)] // a build script reads Cargo's and the system's environment

fn main() {
    println!("cargo:rustc-check-cfg=cfg(have_ucx)");
    println!("cargo:rerun-if-env-changed=DEP_UCP_HAVE_UCX");
    if std::env::var("DEP_UCP_HAVE_UCX").as_deref() == Ok("1") {
        println!("cargo:rustc-cfg=have_ucx");
    }
}
