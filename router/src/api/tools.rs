//! Function tools: validating `tools` / `tool_choice`, describing the tools to the model (through
//! the chat template's `tools` variable, or a system message for templates without tool
//! support), and the grammar that makes `required` and named choices always produce a valid
//! call.
//!
//! Calls use the Hermes / Qwen format: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`
//! ([`super::toolparse`] reads it back).

use cleave_text::chat::ChatMessage;
use cleave_text::constrain::{lark_json, lark_literal, Constraint, LazyGrammars};
use serde_json::{json, Value};

use super::error::ApiError;
use super::openai::ToolCall;

/// One function tool.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// The function's name.
    pub name: String,
    /// Its parameters' JSON schema (`{"type": "object"}` when the request gave none).
    pub parameters: Value,
    /// The tool as the request gave it (`{"type": "function", "function": {...}}`), for
    /// templates.
    pub definition: Value,
}

/// What `tool_choice` asks for.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// The model may answer or call tools; its output is parsed for calls.
    Auto,
    /// The model must call at least one tool (enforced by a grammar).
    Required,
    /// The model must call this tool (index into the tools), once.
    Named(usize),
}

/// A request's tools and how they may be used.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The tools, in request order.
    pub tools: Vec<Tool>,
    /// What `tool_choice` asks for.
    pub choice: ToolChoice,
    /// Whether several calls may come in one turn.
    pub parallel: bool,
}

/// The Hermes format's markers around a call.
pub const OPEN: &str = "<tool_call>";
/// The closing marker.
pub const CLOSE: &str = "</tool_call>";

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`. `None`: no tools in play (none
/// given, or `tool_choice: "none"`).
pub fn parse(
    tools: Option<Vec<Value>>,
    choice: Option<Value>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    let defs = tools.unwrap_or_default();
    let mut out = Vec::with_capacity(defs.len());
    for (i, t) in defs.into_iter().enumerate() {
        let at = |f: &str| format!("tools[{i}]{f}");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::invalid(
                at(".type"),
                "only tools of type `function` are supported",
            ));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                ApiError::invalid(at(".function"), "a tool needs a `function` object")
            })?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if !valid_name(name) {
            return Err(ApiError::invalid(
                at(".function.name"),
                format!(
                    "`{name}` is not a valid function name: use 1 to 64 of a-z, A-Z, 0-9, _ and -"
                ),
            ));
        }
        if out.iter().any(|o: &Tool| o.name == name) {
            return Err(ApiError::invalid(
                at(".function.name"),
                format!("two tools are named `{name}`"),
            ));
        }
        let parameters = match f.get("parameters") {
            None => json!({"type": "object", "properties": {}}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return Err(ApiError::invalid(
                    at(".function.parameters"),
                    "`parameters` must be a JSON schema object",
                ))
            }
        };
        out.push(Tool {
            name: name.to_string(),
            parameters,
            definition: t.clone(),
        });
    }
    let choice = match choice {
        None if out.is_empty() => return Ok(None),
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!(
                        "`tool_choice` must be none, auto, required or a function, got `{other}`"
                    ),
                ))
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    ApiError::invalid(
                        "tool_choice",
                        "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            let i = out.iter().position(|t| t.name == name).ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not one of the tools"),
                )
            })?;
            ToolChoice::Named(i)
        }
    };
    if out.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` needs `tools`",
        ));
    }
    Ok(Some(Tools {
        tools: out,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

impl Tools {
    /// Checks that every tool's parameter schema compiles (each error names its tool).
    pub fn check(&self, grammars: &LazyGrammars) -> Result<(), ApiError> {
        for (i, t) in self.tools.iter().enumerate() {
            let c = Constraint::JsonSchema {
                schema: t.parameters.clone(),
            };
            grammars.compile(&c).map_err(|e| {
                ApiError::invalid(
                    format!("tools[{i}].function.parameters"),
                    format!("the parameters schema of `{}` cannot be used: {e}", t.name),
                )
            })?;
        }
        Ok(())
    }

    /// The grammar of `required` and named choices: one call (or, with parallel calls and
    /// `required`, one or more) in the Hermes format, arguments valid under the tool's schema.
    /// `auto` has none: the model decides.
    pub fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        let which: Vec<usize> = match self.choice {
            ToolChoice::Auto => return Ok(None),
            ToolChoice::Required => (0..self.tools.len()).collect(),
            ToolChoice::Named(i) => vec![i],
        };
        let mut rules = Vec::new();
        let mut alts = Vec::new();
        for (k, &i) in which.iter().enumerate() {
            let t = &self.tools[i];
            let head = format!("{OPEN}\n{{\"name\": {}, \"arguments\": ", json!(t.name));
            alts.push(format!(
                "{} args_{k} {}",
                lark_literal(&head),
                lark_literal(&format!("}}\n{CLOSE}"))
            ));
            let body = lark_json(&t.parameters).map_err(|e| {
                ApiError::invalid(format!("tools[{i}].function.parameters"), e.to_string())
            })?;
            rules.push(format!("args_{k}: {body}"));
        }
        let start = if self.parallel && self.choice == ToolChoice::Required {
            "start: call (\"\\n\" call)*"
        } else {
            "start: call"
        };
        let grammar = format!("{start}\ncall: {}\n{}", alts.join(" | "), rules.join("\n"));
        Ok(Some(Constraint::Lark { grammar }))
    }

    /// The tool definitions as the chat template gets them.
    pub fn definitions(&self) -> Vec<Value> {
        self.tools.iter().map(|t| t.definition.clone()).collect()
    }
}

/// The system text that describes `tools` to a model whose template cannot (the Hermes
/// function-calling prompt's shape).
pub fn system_prompt(tools: &Tools) -> String {
    let defs: Vec<String> = tools.definitions().iter().map(Value::to_string).collect();
    format!(
        "You are a function calling AI model. You may call one or more functions to assist \
         with the user query. The functions you can call, as JSON schemas:\n<tools>\n{}\n</tools>\n\
         For each function call, reply with a JSON object with the function name and arguments \
         inside {OPEN}{CLOSE} tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}",
        defs.join("\n")
    )
}

/// The arguments of a call in the history, parsed (templates expect an object).
pub fn history_call(call: &ToolCall, at: &str) -> Result<Value, ApiError> {
    let args: Value = serde_json::from_str(&call.function.arguments).map_err(|e| {
        ApiError::invalid(
            format!("{at}.function.arguments"),
            format!("the arguments of a tool call must be a JSON object: {e}"),
        )
    })?;
    if !args.is_object() {
        return Err(ApiError::invalid(
            format!("{at}.function.arguments"),
            "the arguments of a tool call must be a JSON object",
        ));
    }
    Ok(json!({
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": args},
    }))
}

/// The conversation rewritten for a template without tool support: the tool description
/// joins (or becomes) the system message, assistant tool calls become `<tool_call>` text and
/// tool results become user turns in `<tool_response>` tags.
pub fn fallback_messages(messages: Vec<ChatMessage>, tools: Option<&Tools>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = messages
        .into_iter()
        .map(|m| match (m.role.as_str(), &m.tool_calls) {
            ("assistant", Some(calls)) => {
                let mut text = m.content.clone();
                for c in calls {
                    let f = &c["function"];
                    // Name first, as the format (and the grammar) has it.
                    let call = format!(
                        "{{\"name\": {}, \"arguments\": {}}}",
                        f["name"], f["arguments"]
                    );
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("{OPEN}\n{call}\n{CLOSE}"));
                }
                ChatMessage::new("assistant", text)
            }
            ("tool", _) => ChatMessage::new(
                "user",
                format!("<tool_response>\n{}\n</tool_response>", m.content),
            ),
            _ => ChatMessage::new(m.role, m.content),
        })
        .collect();
    if let Some(tools) = tools {
        let prompt = system_prompt(tools);
        match out.first_mut() {
            Some(first) if first.role == "system" || first.role == "developer" => {
                first.content = format!("{}\n\n{prompt}", first.content);
            }
            _ => out.insert(0, ChatMessage::new("system", prompt)),
        }
    }
    out
}

#[cfg(test)]
mod tests;
