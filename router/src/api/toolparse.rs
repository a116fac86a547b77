//! Reading tool calls out of generated text as it streams: Hermes / Qwen
//! `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` blocks, text around them.
//!
//! The same parser serves streamed and whole responses, so both give the same calls. Argument
//! text streams as it arrives when the call starts `{"name": ..., "arguments": ` (always so
//! under the `required`/named grammars); any other well-formed block (keys in another order,
//! `parameters` for `arguments`) is read whole at its closing tag.

use serde_json::Value;

use super::openai::{Delta, FunctionCall, FunctionDelta, ToolCall, ToolCallDelta};
use super::tools::{CLOSE, OPEN};

/// A fresh tool-call id.
pub fn call_id() -> String {
    format!("call_{}", &super::ids::random_hex()[..24])
}

/// The finish reason of a choice that made `calls` tool calls and ended for `reason`.
pub fn finish_reason(reason: &'static str, calls: usize) -> &'static str {
    if calls > 0 && reason == "stop" {
        "tool_calls"
    } else {
        reason
    }
}

/// A whole message's text split into content (null when only calls, or nothing, remain) and
/// its tool calls.
pub fn split_message(text: &str) -> (Option<String>, Vec<ToolCall>) {
    let mut p = CallParser::new();
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let mut content = String::new();
    let mut calls: Vec<ToolCall> = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(name) => calls.push(ToolCall {
                id: call_id(),
                kind: "function".into(),
                function: FunctionCall {
                    name,
                    arguments: String::new(),
                },
            }),
            Piece::Args(a) => {
                if let Some(c) = calls.last_mut() {
                    c.function.arguments.push_str(&a);
                }
            }
        }
    }
    let content = if calls.is_empty() || !content.trim().is_empty() {
        Some(content)
    } else {
        None
    };
    (content, calls)
}

/// The streamed delta of one piece; `calls` is the number of calls begun before it.
pub fn delta(piece: Piece, calls: usize) -> Delta {
    let (tool_calls, content) = match piece {
        Piece::Text(t) => (None, Some(t)),
        Piece::Call(name) => (
            Some(vec![ToolCallDelta {
                index: calls,
                id: Some(call_id()),
                kind: Some("function"),
                function: FunctionDelta {
                    name: Some(name),
                    arguments: String::new(),
                },
            }]),
            None,
        ),
        Piece::Args(a) => (
            Some(vec![ToolCallDelta {
                index: calls.saturating_sub(1),
                id: None,
                kind: None,
                function: FunctionDelta {
                    name: None,
                    arguments: a,
                },
            }]),
            None,
        ),
    };
    Delta {
        role: None,
        content,
        tool_calls,
    }
}

/// What a piece of generated text turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text for the message's `content`.
    Text(String),
    /// A new call to this function begins.
    Call(String),
    /// More argument text of the current call.
    Args(String),
}

#[derive(Clone, Debug, PartialEq)]
enum State {
    /// Outside a call.
    Text,
    /// After `<tool_call>`, before the arguments.
    Header,
    /// Inside the arguments; `sent` bytes of them have been handed out.
    Args { sent: usize },
}

/// Incremental tool-call parser for one choice.
#[derive(Debug)]
pub struct CallParser {
    buf: String,
    state: State,
    calls: usize,
}

impl Default for CallParser {
    fn default() -> Self {
        Self::new()
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&k| s.ends_with(&marker[..k]))
        .unwrap_or(0)
}

/// `{"name": "<name>", "arguments": ` at the start of `s` (whitespace allowed between tokens):
/// the name and the header's length.
fn header(s: &str) -> Option<(String, usize)> {
    let mut rest = s.trim_start().strip_prefix('{')?.trim_start();
    rest = rest.strip_prefix("\"name\"")?.trim_start();
    rest = rest.strip_prefix(':')?.trim_start();
    let body = rest.strip_prefix('"')?;
    // The end of the JSON string: the first quote not escaped.
    let mut escaped = false;
    let end = body.char_indices().find_map(|(i, c)| match (escaped, c) {
        (false, '\\') => {
            escaped = true;
            None
        }
        (false, '"') => Some(i),
        _ => {
            escaped = false;
            None
        }
    })?;
    let name: String = serde_json::from_str(&rest[..end + 2]).ok()?;
    rest = body[end + 1..].trim_start().strip_prefix(',')?.trim_start();
    rest = rest.strip_prefix("\"arguments\"")?.trim_start();
    rest = rest.strip_prefix(':')?;
    let rest = rest.trim_start();
    // Wait for the first byte of the arguments so that trailing whitespace is consumed.
    if rest.is_empty() {
        return None;
    }
    Some((name, s.len() - rest.len()))
}

/// A whole call block in any key order: its name and arguments as JSON text.
fn whole_call(block: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(block.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters"))?;
    let args = match args {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some((name, args))
}

impl CallParser {
    /// A parser at the start of a message.
    pub fn new() -> Self {
        CallParser {
            buf: String::new(),
            state: State::Text,
            calls: 0,
        }
    }

    /// Calls begun so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Feeds new text; returns what became certain.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                State::Text => {
                    if let Some(i) = self.buf.find(OPEN) {
                        let before: String = self.buf.drain(..i + OPEN.len()).collect();
                        // Whitespace between calls is not content.
                        if !(self.calls > 0 && before[..i].trim().is_empty()) {
                            self.text(&before[..i], &mut out);
                        }
                        self.state = State::Header;
                        continue;
                    }
                    let keep = partial_suffix(&self.buf, OPEN);
                    let cut = self.buf.len() - keep;
                    // After a call, whitespace waits: it is dropped unless text follows.
                    if self.calls > 0 && self.buf[..cut].trim().is_empty() {
                        return out;
                    }
                    let before: String = self.buf.drain(..cut).collect();
                    self.text(&before, &mut out);
                    return out;
                }
                State::Header => {
                    if let Some((name, len)) = header(&self.buf) {
                        self.buf.drain(..len);
                        self.calls += 1;
                        out.push(Piece::Call(name));
                        self.state = State::Args { sent: 0 };
                        continue;
                    }
                    let Some(i) = self.buf.find(CLOSE) else {
                        return out;
                    };
                    let block: String = self.buf.drain(..i + CLOSE.len()).collect();
                    let block = &block[..i];
                    match whole_call(block) {
                        Some((name, args)) => {
                            self.calls += 1;
                            out.push(Piece::Call(name));
                            out.push(Piece::Args(args));
                        }
                        // Not a call after all: it is text.
                        None => self.text(&format!("{OPEN}{block}{CLOSE}"), &mut out),
                    }
                    self.state = State::Text;
                }
                State::Args { sent } => {
                    if let Some(i) = self.buf.find(CLOSE) {
                        let args = self.buf[..i].trim_end();
                        // The wrapper's own closing brace ends the block.
                        let args = args.strip_suffix('}').unwrap_or(args).trim_end();
                        if args.len() > sent {
                            out.push(Piece::Args(args[sent..].to_string()));
                        }
                        self.buf.drain(..i + CLOSE.len());
                        self.state = State::Text;
                        continue;
                    }
                    // Hold back from the last `}` on (it may be the wrapper's) and anything that
                    // may start the closing tag.
                    let safe = self
                        .buf
                        .rfind('}')
                        .unwrap_or(self.buf.len())
                        .min(self.buf.len() - partial_suffix(&self.buf, CLOSE));
                    if safe > sent {
                        out.push(Piece::Args(self.buf[sent..safe].to_string()));
                        self.state = State::Args { sent: safe };
                    }
                    return out;
                }
            }
        }
    }

    /// The end of the text: whatever is still held.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        match std::mem::replace(&mut self.state, State::Text) {
            State::Text => {
                if !(self.calls > 0 && rest.trim().is_empty()) {
                    self.text(&rest, &mut out);
                }
            }
            // A call that never got its arguments is text.
            State::Header => self.text(&format!("{OPEN}{rest}"), &mut out),
            // Cut off inside the arguments (max_tokens): what there is.
            State::Args { sent } => {
                if rest.len() > sent {
                    out.push(Piece::Args(rest[sent..].to_string()));
                }
            }
        }
        out
    }

    fn text(&self, s: &str, out: &mut Vec<Piece>) {
        if !s.is_empty() {
            out.push(Piece::Text(s.to_string()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `n` bytes (at char boundaries) and joins the result per kind.
    fn run(text: &str, n: usize) -> (String, Vec<(String, String)>) {
        let mut p = CallParser::new();
        let mut pieces = Vec::new();
        let mut start = 0;
        while start < text.len() {
            let mut end = (start + n).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            pieces.extend(p.push(&text[start..end]));
            start = end;
        }
        pieces.extend(p.finish());
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for piece in pieces {
            match piece {
                Piece::Text(t) => content.push_str(&t),
                Piece::Call(name) => calls.push((name, String::new())),
                Piece::Args(a) => calls.last_mut().expect("args after a call").1.push_str(&a),
            }
        }
        (content, calls)
    }

    #[test]
    fn calls_parse_the_same_whatever_the_chunking() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": {\"n\": 3}}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n";
        for n in [1, 2, 3, 7, 1000] {
            let (content, calls) = run(text, n);
            assert_eq!(content, "Let me check.\n", "chunk {n}");
            assert_eq!(
                calls,
                vec![
                    (
                        "get_weather".into(),
                        "{\"city\": \"Paris\", \"days\": {\"n\": 3}}".into()
                    ),
                    ("get_time".into(), "{}".into()),
                ],
                "chunk {n}"
            );
        }
    }

    #[test]
    fn other_key_orders_and_plain_text_and_cut_off_calls() {
        let (c, calls) = run(
            "<tool_call>{\"arguments\": {\"a\": 1}, \"name\": \"f\"}</tool_call>",
            4,
        );
        assert_eq!(
            (c.as_str(), calls),
            ("", vec![("f".into(), "{\"a\":1}".into())])
        );
        let (c, calls) = run("a < b, and <tool_call> is a tag 😀", 3);
        assert_eq!(
            (c.as_str(), calls.len()),
            ("a < b, and <tool_call> is a tag 😀", 0)
        );
        let (c, calls) = run("<tool_call>not json</tool_call> after", 5);
        assert_eq!(
            (c.as_str(), calls.len()),
            ("<tool_call>not json</tool_call> after", 0)
        );
        let (_, calls) = run(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": \"unfinis",
            4,
        );
        assert_eq!(calls, vec![("f".into(), "{\"x\": \"unfinis".into())]);
        let (_, calls) = run(
            "<tool_call>\n{\"name\": \"a\\\"b\", \"arguments\": {}}\n</tool_call>",
            2,
        );
        assert_eq!(calls, vec![("a\"b".into(), "{}".into())]);
    }
}
