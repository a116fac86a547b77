//! Server-sent events as OpenAI streams them: `data: {json}` lines, events separated by a blank
//! line, `data: [DONE]` at the end. Bytes arrive in arbitrary pieces; [`SseParser`] buffers
//! them and yields whole events' data.

/// What one event means to the benchmark.
#[derive(Clone, Debug, PartialEq)]
pub enum SseEvent {
    /// A chunk with generated text (completions' text or chat delta content) for some choice.
    Token,
    /// A chunk with no token (a chat role chunk, or a usage-only chunk).
    Other,
    /// The last chunk's usage: prompt, completion and cached prompt tokens.
    Usage {
        /// Prompt tokens.
        prompt: u64,
        /// Generated tokens.
        completion: u64,
        /// Prompt tokens served from the server's prefix cache, when it says.
        cached: Option<u64>,
    },
    /// An error object in the stream.
    Error(String),
    /// `[DONE]`.
    Done,
}

/// Incremental parser: feed bytes, take the data of finished events.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Appends `bytes` and returns the data of every event now complete (multi-line data joined
    /// by `\n`, per the SSE spec).
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let text = &self.buf;
            let end = find_event_end(text);
            let Some((end, sep)) = end else { break };
            let event = String::from_utf8_lossy(&text[..end]).into_owned();
            self.buf.drain(..end + sep);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

fn find_event_end(b: &[u8]) -> Option<(usize, usize)> {
    (0..b.len()).find_map(|i| {
        if b[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else if b[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else {
            None
        }
    })
}

/// Classifies one event's data.
pub fn classify(data: &str) -> SseEvent {
    if data.trim() == "[DONE]" {
        return SseEvent::Done;
    }
    let v: serde_json::Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => return SseEvent::Error(format!("unparseable chunk: {e}")),
    };
    if let Some(err) = v.get("error") {
        let msg = err
            .get("message")
            .and_then(|m| m.as_str())
            .unwrap_or("error");
        return SseEvent::Error(msg.to_string());
    }
    let token = v
        .get("choices")
        .and_then(|c| c.as_array())
        .is_some_and(|cs| {
            cs.iter().any(|c| {
                let text = c
                    .get("text")
                    .or_else(|| c.pointer("/delta/content"))
                    .and_then(|t| t.as_str());
                // A token: new text. Empty pieces are role chunks (chat's first, `content: ""`)
                // or finish chunks; servers skip empty tokens (incomplete characters) or
                // merge them into the next chunk.
                text.is_some_and(|t| !t.is_empty())
            })
        });
    if token {
        return SseEvent::Token;
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        let n = |k: &str| u.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
        return SseEvent::Usage {
            prompt: n("prompt_tokens"),
            completion: n("completion_tokens"),
            cached: u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(|x| x.as_u64()),
        };
    }
    SseEvent::Other
}
