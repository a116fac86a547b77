//! Where `scripts/llama-vocab` puts llama.cpp's reference files (vocab test GGUFs, and the chat
//! templates in `templates/`): `$CLEAVE_LLAMA_VOCAB_DIR`, else `~/.cache/cleave/llama-vocab`.

#![allow(clippy::disallowed_methods)] // tests and benchmarks may read the environment and poll with sleeps

use std::path::{Path, PathBuf};

#[allow(dead_code)] // not every test binary that includes this module reads the folder
pub fn dir() -> PathBuf {
    match std::env::var_os("CLEAVE_LLAMA_VOCAB_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/cleave/llama-vocab"),
    }
}

/// Whether `path` (a file or folder `scripts/llama-vocab` writes) is there. When it is not, the
/// test fails under CI (the test command fetches the files) and says SKIPPED elsewhere.
#[allow(dead_code)]
pub fn available(path: &Path) -> bool {
    made_by(path, "scripts/llama-vocab")
}

/// Whether `path`, which `script` writes, is there: when it is not, the test fails under CI (the
/// test command runs the script) and says SKIPPED elsewhere.
pub fn made_by(path: &Path, script: &str) -> bool {
    if path.exists() {
        return true;
    }
    let msg = format!("{} missing (run {script})", path.display());
    assert!(std::env::var_os("CI").is_none(), "{msg}");
    eprintln!("SKIPPED: {msg}");
    false
}
