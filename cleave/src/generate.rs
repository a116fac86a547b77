//! `cleave generate` and `cleave chat`: stream text from the engine to the terminal.

use std::io::{BufRead, Write};

use anyhow::{bail, Context};
use clap::Args;
use cleave_engine::engine::{Engine, EngineConfig, GenerateRequest, SeqEvent};
use cleave_engine::load::Loaded;
use cleave_text::chat::ChatMessage;
use cleave_text::constrain::Constraint;
use cleave_text::sample::SamplingParams;

use crate::ModelArgs;

/// Sampling flags shared by generate and chat.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling threshold.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// RNG seed (reproducible sampling).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// The output must be JSON valid under this JSON schema (given as JSON text).
    #[arg(long, conflicts_with_all = ["regex", "grammar"])]
    pub json_schema: Option<String>,
    /// The whole output must match this regular expression.
    #[arg(long, conflicts_with = "grammar")]
    pub regex: Option<String>,
    /// The output must be in the language of this Lark grammar (llguidance's dialect).
    #[arg(long)]
    pub grammar: Option<String>,
}

impl SamplingArgs {
    fn params(&self) -> anyhow::Result<SamplingParams> {
        let constraint = match (&self.json_schema, &self.regex, &self.grammar) {
            (Some(s), _, _) => Some(Constraint::JsonSchema {
                schema: serde_json::from_str(s).context("--json-schema is not JSON")?,
            }),
            (_, Some(r), _) => Some(Constraint::Regex { pattern: r.clone() }),
            (_, _, Some(g)) => Some(Constraint::Lark { grammar: g.clone() }),
            _ => None,
        };
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            constraint,
            ..Default::default()
        })
    }
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    pub prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[command(flatten)]
    pub template: TemplateArgs,
    /// Print one JSON object (prompt and generated token ids, text, usage) instead of streaming.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

#[derive(Debug, Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub template: TemplateArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// `--chat-template`.
#[derive(Debug, Args)]
pub struct TemplateArgs {
    /// The chat template instead of the model's own (for a model that ships without one): a
    /// built-in name (`chatml`, `llama3`, `gemma`), a Jinja file, or the template text itself.
    #[arg(long)]
    pub chat_template: Option<String>,
}

impl TemplateArgs {
    /// Loads the model `model` names, serving with this template when one is given.
    fn load(&self, model: &ModelArgs) -> anyhow::Result<Loaded> {
        Ok(crate::load::load(model)?.with_chat_template(self.chat_template.as_deref())?)
    }
}

/// Renders messages with the model's template and tokenizes the result (special tokens parsed).
pub fn chat_prompt(loaded: &Loaded, messages: &[ChatMessage]) -> anyhow::Result<Vec<u32>> {
    let template = loaded
        .template
        .as_ref()
        .context("this model has no chat template: pass --chat-template (a built-in name, a Jinja file or the template text), or drop --chat")?;
    let text = template.render(messages, true)?;
    Ok(loaded.tokenizer.encode(&text, true))
}

fn start(loaded: &Loaded) -> Engine {
    Engine::start(
        loaded.model.clone(),
        loaded.tokenizer.clone(),
        EngineConfig::default(),
    )
}

/// Streams one request's text to `out` (when given); returns (generated ids, text, usage).
fn run_one(
    engine: &Engine,
    prompt: Vec<u32>,
    params: SamplingParams,
    mut out: Option<&mut dyn Write>,
) -> anyhow::Result<(Vec<u32>, String, cleave_engine::engine::Usage)> {
    let (_, mut rx) = engine.submit(GenerateRequest::new(prompt, params))?;
    let rt = tokio::runtime::Builder::new_current_thread().build()?;
    rt.block_on(async {
        let (mut ids, mut text) = (Vec::new(), String::new());
        while let Some(ev) = rx.recv().await {
            let piece = match ev {
                SeqEvent::Token { id, text, .. } => {
                    ids.push(id);
                    text
                }
                SeqEvent::Done {
                    usage, text: tail, ..
                } => {
                    text.push_str(&tail);
                    if let Some(o) = out.as_deref_mut() {
                        write!(o, "{tail}")?;
                        o.flush()?;
                    }
                    return Ok((ids, text, usage));
                }
                // Disaggregation events do not occur for local requests.
                _ => continue,
            };
            text.push_str(&piece);
            if let Some(o) = out.as_deref_mut() {
                write!(o, "{piece}")?;
                o.flush()?;
            }
        }
        bail!("the engine stopped before the request finished")
    })
}

pub fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let loaded = args.template.load(&args.model)?;
    let prompt = if args.chat {
        let msg = ChatMessage::new("user", args.prompt.clone());
        chat_prompt(&loaded, &[msg])?
    } else {
        loaded.encode_text(&args.prompt)
    };
    let engine = start(&loaded);
    let params = args.sampling.params()?;
    if args.json {
        let (ids, text, usage) = run_one(&engine, prompt.clone(), params, None)?;
        let v = serde_json::json!({
            "prompt_tokens": prompt, "tokens": ids, "text": text, "usage": usage,
        });
        println!("{v}");
    } else {
        let stdout = std::io::stdout();
        let mut lock = stdout.lock();
        run_one(&engine, prompt, params, Some(&mut lock))?;
        writeln!(lock)?;
    }
    Ok(())
}

pub fn chat(args: ChatArgs) -> anyhow::Result<()> {
    let loaded = args.template.load(&args.model)?;
    let engine = start(&loaded);
    let mut messages = Vec::new();
    if let Some(s) = &args.system {
        messages.push(ChatMessage::new("system", s.clone()));
    }
    let stdin = std::io::stdin();
    let stdout = std::io::stdout();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        messages.push(ChatMessage::new("user", line.trim_end().to_string()));
        let prompt = chat_prompt(&loaded, &messages)?;
        let mut lock = stdout.lock();
        let (_, text, _) = run_one(&engine, prompt, args.sampling.params()?, Some(&mut lock))?;
        writeln!(lock)?;
        messages.push(ChatMessage::new("assistant", text));
    }
}
