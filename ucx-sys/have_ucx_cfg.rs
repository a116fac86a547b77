// The build script of every crate with a UCX backend (`include!`d by `collective/build.rs` and
// `kv-transfer/build.rs`): turns this crate's build-time probe (`DEP_UCP_HAVE_UCX`, from
// `links = "ucp"`) into the `have_ucx` cfg, so the UCX code compiles only where UCX is
// installed.

fn main() {
    println!("cargo:rustc-check-cfg=cfg(have_ucx)");
    println!("cargo:rerun-if-env-changed=DEP_UCP_HAVE_UCX");
    if std::env::var("DEP_UCP_HAVE_UCX").as_deref() == Ok("1") {
        println!("cargo:rustc-cfg=have_ucx");
    }
}
