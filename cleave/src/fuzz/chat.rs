//! `--target chat`: random conversations through chat templates.
//!
//! The templates are the model's and, when `scripts/llama-vocab` fetched them, the 70-odd
//! templates of llama.cpp's test set (Llama, Qwen, Gemma, DeepSeek, Mistral, Granite, ...).
//! Conversations have random roles in random order (none at all, several systems, a tool turn
//! first), contents from [`mutate::string`], tool calls whose arguments are any JSON value, and
//! random tool lists. Rendering must return text or a [`ChatError`]: a panic or a render
//! slower than 5 s fails the case.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cleave_text::chat::{ChatError, ChatMessage, ChatTemplate};
use cleave_text::ModelText;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use serde_json::{json, Value};

use super::{mutate, Cases, Tally};

/// A render slower than this counts as a hang.
const SLOW: Duration = Duration::from_secs(5);

/// The templates to fuzz: the model's, cleave's built-in ones (`--chat-template NAME`), then
/// every compiling one of llama.cpp's test set.
pub fn templates(model: &Path) -> Vec<(String, Arc<ChatTemplate>)> {
    let mut out = Vec::new();
    match ModelText::open(model) {
        Ok(text) => {
            if let Some(t) = text.template {
                out.push(("model".to_string(), t));
            }
        }
        Err(e) => eprintln!("fuzz chat: no model template ({e})"),
    }
    for (name, source) in cleave_text::chat::builtin::all() {
        let t = ChatTemplate::new(source, "<s>", "</s>").expect("built-in templates compile");
        out.push((format!("built-in {name}"), Arc::new(t)));
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(super::llama_vocab_dir().join("templates"))
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    paths.sort();
    for path in paths {
        let Ok(source) = std::fs::read_to_string(&path) else {
            continue;
        };
        if let Ok(t) = ChatTemplate::new(&source, "<s>", "</s>") {
            let name = path.file_stem().unwrap_or_default().to_string_lossy();
            out.push((name.into_owned(), Arc::new(t)));
        }
    }
    out
}

fn message(rng: &mut StdRng) -> ChatMessage {
    let role = *[
        "user",
        "assistant",
        "system",
        "tool",
        "developer",
        "ipython",
        "",
        "USER",
    ]
    .choose(rng)
    .expect("roles");
    let mut m = ChatMessage::new(role, mutate::string(rng));
    if rng.gen_bool(0.2) {
        m.tool_calls = Some(
            (0..rng.gen_range(0..3))
                .map(|i| {
                    if rng.gen_bool(0.8) {
                        json!({"id": format!("call_{i}"), "type": "function", "function": {
                            "name": mutate::string(rng), "arguments": mutate::value(rng, 3)}})
                    } else {
                        mutate::value(rng, 3)
                    }
                })
                .collect(),
        );
    }
    if rng.gen_bool(0.2) {
        m.tool_call_id = Some(mutate::string(rng));
    }
    m
}

fn tools(rng: &mut StdRng) -> Option<Vec<Value>> {
    rng.gen_bool(0.3).then(|| {
        (0..rng.gen_range(0..3))
            .map(|_| {
                let mut t = json!({"type": "function", "function": {"name": "f",
                    "description": "d", "parameters": {"type": "object",
                    "properties": {"x": {"type": "string"}}}}});
                if rng.gen_bool(0.5) {
                    mutate::json(rng, &mut t);
                }
                t
            })
            .collect()
    })
}

fn kind(e: &ChatError) -> &'static str {
    match e {
        ChatError::Missing(_) => "missing",
        ChatError::Syntax(_) => "syntax",
        ChatError::Raised(_) => "raised",
        ChatError::Render(_) => "render-error",
        ChatError::Choice { .. } => "choice",
    }
}

/// The campaign: each case renders one random conversation with one template.
pub fn fuzz(model: &Path, cases: Cases) -> anyhow::Result<Tally> {
    let templates = templates(model);
    anyhow::ensure!(!templates.is_empty(), "no chat template to fuzz");
    let mut tally = Tally::new("chat");
    for i in cases.range() {
        let rng = &mut cases.rng(i);
        let (name, t) = templates.choose(rng).expect("non-empty");
        let n = if rng.gen_bool(0.1) {
            0
        } else {
            rng.gen_range(1..8)
        };
        let messages: Vec<ChatMessage> = (0..n).map(|_| message(rng)).collect();
        let tools = tools(rng);
        let agp = rng.gen();
        let started = Instant::now();
        let result = super::unwound(|| t.render_with_tools(&messages, tools.as_deref(), agp));
        let took = started.elapsed();
        let input = || {
            format!(
                "template {name}, messages {}",
                serde_json::to_string(&messages).unwrap_or_default()
            )
        };
        match result {
            Err(p) => tally.fail(i, format!("render panicked ({p}): {}", input())),
            Ok(_) if took > SLOW => tally.fail(i, format!("render took {took:?}: {}", input())),
            Ok(Ok(_)) => tally.ok("rendered"),
            Ok(Err(e)) => tally.ok(kind(&e)),
        }
    }
    Ok(tally)
}
