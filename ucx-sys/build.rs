//! Probes for UCX with pkg-config and, when it is found, generates bindings for the `ucp_*` and
//! `ucs_*` items cleave uses. Without UCX (or without libclang for bindgen) the crate builds
//! empty and tells dependents through the `links` metadata `DEP_UCP_HAVE_UCX=0`, so they can
//! fall back to another transport. Set `CLEAVE_NO_UCX=1` to force the empty build.

#![allow(clippy::disallowed_methods)] // a build script reads Cargo's and the system's environment

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rustc-check-cfg=cfg(have_ucx)");
    println!("cargo:rerun-if-env-changed=CLEAVE_NO_UCX");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    if env::var_os("CLEAVE_NO_UCX").is_some_and(|v| v != "0") {
        return absent("CLEAVE_NO_UCX is set");
    }
    let lib = match pkg_config::Config::new()
        .atleast_version("1.10")
        .cargo_metadata(false)
        .probe("ucx")
    {
        Ok(lib) => lib,
        Err(e) => return absent(&format!("pkg-config found no ucx: {e}")),
    };
    let mut builder = bindgen::Builder::default()
        .header_contents("wrapper.h", "#include <ucp/api/ucp.h>\n")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_status_t")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .allowlist_var("UCT_.*")
        .newtype_enum("ucs_status_t")
        .newtype_enum("ucs_thread_mode_t")
        .newtype_enum("ucp_err_handling_mode_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false);
    for path in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => return absent(&format!("bindgen failed (is libclang installed?): {e}")),
    };
    let out = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("writing bindings.rs into OUT_DIR");
    for path in &lib.link_paths {
        println!("cargo:rustc-link-search=native={}", path.display());
    }
    // ucp's public API lives in libucp; ucs_status_string in libucs.
    println!("cargo:rustc-link-lib=ucp");
    println!("cargo:rustc-link-lib=ucs");
    println!("cargo:rustc-cfg=have_ucx");
    println!("cargo:have_ucx=1");
}

fn absent(why: &str) {
    println!("cargo:warning=building without UCX: {why}");
    println!("cargo:have_ucx=0");
}
