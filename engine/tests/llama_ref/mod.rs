//! Where `scripts/llama-vocab` puts llama.cpp's reference files (vocab test GGUFs, and the chat
//! templates in `templates/`): `$CLEAVE_LLAMA_VOCAB_DIR`, else `~/.cache/cleave/llama-vocab`.

use std::path::PathBuf;

pub fn dir() -> PathBuf {
    match std::env::var_os("CLEAVE_LLAMA_VOCAB_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/cleave/llama-vocab"),
    }
}
