//! Chat templates render exactly as the reference Jinja does: every template in llama.cpp's
//! `models/templates` collection (real models' `chat_template`s: Gemma 2 and 4, Phi-3.5,
//! Llama 3.x, Mistral, Qwen, DeepSeek, SmolLM3, Granite, ...; `scripts/llama-vocab` fetches
//! them) is rendered by cleave (minijinja) and by Python's Jinja2 configured as Hugging Face's
//! `apply_chat_template` (tests/chat_reference.py), on the same conversations, with and
//! without the generation prompt. Equal text, or both raise (Gemma 2 rejects a system turn
//! with `raise_exception`) with the same message, or both fail.

use crate::llama_ref;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use cleave_text::chat::{ChatError, ChatMessage, ChatTemplate};
use serde_json::{json, Value};

/// Templates whose rendering differs from the reference today, with the reason. The test
/// fails when one of them starts matching, so the list stays true.
const KNOWN_DIFFERENT: &[(&str, &str)] = &[
    (
        "CohereForAI-c4ai-command-r-plus-tool_use",
        "without tools Jinja2 fails iterating `tools` = None; minijinja loops over none as empty",
    ),
    (
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
        "without tools Jinja2 fails iterating `tools` = None; minijinja loops over none as empty",
    ),
    (
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
        "without tools Jinja2 fails iterating `tools` = None; minijinja loops over none as empty",
    ),
    (
        "tencent-Hy3",
        "Python's str.format is not among the string methods provided",
    ),
];

fn templates_dir() -> PathBuf {
    llama_ref::dir().join("templates")
}

fn conversations() -> Vec<Vec<ChatMessage>> {
    vec![
        vec![ChatMessage::new("user", "Hello!")],
        vec![
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "Hi, who are you?"),
        ],
        vec![
            ChatMessage::new("user", "2+2?"),
            ChatMessage::new("assistant", "4"),
            ChatMessage::new("user", "Thanks — and ünïcode?"),
        ],
    ]
}

const BOS: &str = "<s>";
const EOS: &str = "</s>";

/// What one rendering gave. Failures compare equal whatever their messages (the two
/// renderers word them differently); the message is kept for the report.
#[derive(Debug)]
enum Outcome {
    Text(String),
    Raised(String),
    Failed(String),
}

impl PartialEq for Outcome {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Outcome::Text(a), Outcome::Text(b)) | (Outcome::Raised(a), Outcome::Raised(b)) => {
                a == b
            }
            (Outcome::Failed(_), Outcome::Failed(_)) => true,
            _ => false,
        }
    }
}

fn reference(cases: &[Value]) -> Vec<Outcome> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/chat_reference.py");
    let mut child = Command::new("python3")
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("python3 runs (the reference renderer needs python3 with jinja2)");
    let input = serde_json::to_vec(&json!({ "cases": cases })).expect("json");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(&input)
        .expect("write cases");
    let out = child.wait_with_output().expect("reference output");
    assert!(
        out.status.success(),
        "tests/chat_reference.py failed (is jinja2 installed?)"
    );
    let v: Vec<Value> = serde_json::from_slice(&out.stdout).expect("reference json");
    v.into_iter()
        .map(|o| {
            if let Some(t) = o.get("text").and_then(Value::as_str) {
                Outcome::Text(t.to_string())
            } else if let Some(m) = o.get("raised").and_then(Value::as_str) {
                Outcome::Raised(m.to_string())
            } else {
                let e = o.get("error").and_then(Value::as_str).unwrap_or_default();
                Outcome::Failed(e.to_string())
            }
        })
        .collect()
}

fn cleave(source: &str, messages: &[ChatMessage], agp: bool) -> Outcome {
    let t = match ChatTemplate::new(source, BOS, EOS) {
        Ok(t) => t,
        Err(e) => return Outcome::Failed(e.to_string()),
    };
    match t.render(messages, agp) {
        Ok(s) => Outcome::Text(s),
        Err(ChatError::Raised(m)) => Outcome::Raised(m),
        Err(e) => Outcome::Failed(e.to_string()),
    }
}

/// Where two texts first differ (in characters), with a little context from each.
fn first_difference(a: &str, b: &str) -> String {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let i = (0..a.len().min(b.len()))
        .find(|&i| a[i] != b[i])
        .unwrap_or(a.len().min(b.len()));
    let around = |s: &[char]| -> String {
        s[i.saturating_sub(40).min(s.len())..(i + 40).min(s.len())]
            .iter()
            .collect()
    };
    format!(
        "at char {i}: cleave {:?} / reference {:?}",
        around(&a),
        around(&b)
    )
}

#[test]
fn templates_render_as_the_reference_jinja_does() {
    let dir = templates_dir();
    if !llama_ref::available(&dir) {
        return;
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("read the templates folder")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jinja"))
        .collect();
    assert!(!files.is_empty(), "no .jinja files in {}", dir.display());
    files.sort();
    let convs = conversations();
    let templates: Vec<(String, String)> = files
        .iter()
        .map(|f| {
            let name = f.file_stem().unwrap().to_string_lossy().to_string();
            (name, std::fs::read_to_string(f).expect("read template"))
        })
        .collect();
    let mut cases = Vec::new();
    let mut keys = Vec::new();
    for (ti, (_, source)) in templates.iter().enumerate() {
        for (ci, c) in convs.iter().enumerate() {
            for agp in [true, false] {
                cases.push(json!({
                    "source": source, "messages": c, "add_generation_prompt": agp,
                    "bos_token": BOS, "eos_token": EOS,
                }));
                keys.push((ti, ci, agp));
            }
        }
    }
    let want = reference(&cases);
    assert_eq!(want.len(), keys.len(), "one reference answer per case");

    let mut differing: Vec<(String, String)> = Vec::new();
    let (mut texts, mut raised) = (0, 0);
    for (&(ti, ci, agp), want) in keys.iter().zip(want) {
        let (name, source) = &templates[ti];
        let got = cleave(source, &convs[ci], agp);
        match &want {
            Outcome::Text(_) => texts += 1,
            Outcome::Raised(_) => raised += 1,
            Outcome::Failed(_) => {}
        }
        if got == want || differing.iter().any(|(n, _)| n == name) {
            continue;
        }
        let why = match (&got, &want) {
            (Outcome::Text(a), Outcome::Text(b)) => first_difference(a, b),
            (Outcome::Failed(m), _) => format!("cleave failed ({m}) / reference {want:?}"),
            _ => format!("cleave {got:?} / reference {want:?}"),
        };
        differing.push((
            name.clone(),
            format!("{name} (conversation {ci}, generation prompt {agp}): {why}"),
        ));
    }
    eprintln!(
        "{} templates, {} renderings: {texts} texts and {raised} raised as the reference; {} templates differ",
        files.len(),
        keys.len(),
        differing.len()
    );
    let mut failures: Vec<String> = differing
        .iter()
        .filter(|(n, _)| !KNOWN_DIFFERENT.iter().any(|(k, _)| k == n))
        .map(|(_, m)| m.clone())
        .collect();
    for (k, why) in KNOWN_DIFFERENT {
        if !differing.iter().any(|(n, _)| n == k) {
            failures.push(format!(
                "{k} now renders as the reference: remove it from KNOWN_DIFFERENT ({why})"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Gemma 2's template rejects a system turn: the error is the template's own message, which
/// the API reports as a 400 naming it.
#[test]
fn gemma_2_rejects_a_system_turn_with_its_own_message() {
    let path = templates_dir().join("google-gemma-2-2b-it.jinja");
    if !llama_ref::available(&path) {
        return;
    }
    let source = std::fs::read_to_string(&path).expect("read template");
    let t = ChatTemplate::new(&source, BOS, EOS).expect("compiles");
    let e = t
        .render(&conversations()[1], true)
        .expect_err("system turn");
    assert!(
        matches!(&e, ChatError::Raised(m) if m.contains("System role not supported")),
        "{e}"
    );
}

/// The built-in templates (`--chat-template NAME`) render what the real models' own templates
/// render, where the formats agree: `gemma` as Gemma 2's on conversations without a system turn
/// (Gemma 2 rejects one; the built-in folds it into the first user turn as Gemma 3 does),
/// `chatml` as Qwen 2.5's once a system turn is given (Qwen's adds its own default otherwise).
#[test]
fn builtin_templates_match_the_models_they_stand_in_for() {
    let cases = [
        ("gemma", "google-gemma-2-2b-it", [0, 2].as_slice()),
        ("chatml", "Qwen-Qwen2.5-7B-Instruct", [1].as_slice()),
    ];
    let convos = conversations();
    for (name, model, which) in cases {
        let path = templates_dir().join(format!("{model}.jinja"));
        if !llama_ref::available(&path) {
            return;
        }
        let source = std::fs::read_to_string(&path).expect("read template");
        let real = ChatTemplate::new(&source, BOS, EOS).expect("compiles");
        let ours = ChatTemplate::new(
            cleave_text::chat::builtin::source(name).expect("built in"),
            BOS,
            EOS,
        )
        .expect("compiles");
        for &i in which {
            for agp in [false, true] {
                assert_eq!(
                    ours.render(&convos[i], agp).unwrap(),
                    real.render(&convos[i], agp).unwrap(),
                    "{name} vs {model}, conversation {i}, generation prompt {agp}"
                );
            }
        }
    }
}
