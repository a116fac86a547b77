//! Shared by the integration tests: the default model, loaded once per test binary.

use std::sync::{Arc, OnceLock};

use cleave_engine::gguf::default_model_path;
use cleave_engine::kernels::Threads;
use cleave_engine::load::Loaded;

pub fn loaded() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| {
        let path = default_model_path();
        assert!(
            path.exists(),
            "the default model is not at {}: run `cargo run -p cleave -- model fetch` (the test script does)",
            path.display()
        );
        Loaded::open(&path, Threads::single()).expect("loading the default model")
    })
}

#[allow(dead_code)]
pub fn model_and_tokenizer() -> (
    Arc<cleave_engine::model::Model>,
    Arc<cleave_engine::tokenizer::Tokenizer>,
) {
    let l = loaded();
    (l.model.clone(), l.tokenizer.clone())
}
