//! What `cleave model inspect FILE` reports about a GGUF file without loading its weights: the
//! architecture, a histogram of tensor types, context length, vocabulary type, and whether
//! cleave can run it — and if not, every reason why (unsupported architecture, tokenizer or
//! tensor type, a tensor that lies outside the file or whose size does not fit its type).

use std::collections::BTreeMap;
use std::fmt;

use crate::model::config::ModelConfig;
use cleave_text::gguf::{GgmlType, GgufFile};
use cleave_text::tokenizer::Tokenizer;

/// Tensor types the loader accepts (F16/BF16 are converted to F32).
fn loadable(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | IQ4_NL
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
    )
}

/// Per tensor type: how many tensors, their elements and bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TypeCount {
    /// Number of tensors.
    pub tensors: usize,
    /// Their elements.
    pub elements: u64,
    /// Their bytes (0 for types whose size is unknown).
    pub bytes: u64,
}

/// The report on one file.
#[derive(Clone, Debug)]
pub struct Inspection {
    /// `general.architecture`, if present.
    pub architecture: Option<String>,
    /// `general.name`, if present.
    pub name: Option<String>,
    /// Tensor type name → counts.
    pub types: BTreeMap<String, TypeCount>,
    /// `{arch}.context_length`, if present.
    pub context_length: Option<u64>,
    /// `tokenizer.ggml.model` (and `.pre`), with the vocabulary size.
    pub vocabulary: Option<String>,
    /// Whether the file carries a chat template that compiles, and what to do if not.
    pub chat_template: String,
    /// Why cleave cannot run the file; empty when it can.
    pub problems: Vec<String>,
}

/// The chat-template line of the report: chat requests need one that compiles.
fn chat_template_state(g: &GgufFile) -> String {
    let fix = format!(
        "/v1/chat/completions and `--chat` need --chat-template (built in: {}; a Jinja file; or \
         the template text)",
        cleave_text::chat::builtin::names()
    );
    match g.get_str("tokenizer.chat_template") {
        Ok(source) => match cleave_text::chat::ChatTemplate::new(source, "", "") {
            Ok(_) => format!("yes ({} bytes)", source.len()),
            Err(e) => format!("present, but {e}: {fix}"),
        },
        Err(_) => format!("none: {fix}"),
    }
}

impl Inspection {
    /// Whether cleave can load and serve the file.
    pub fn runnable(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Inspects a parsed GGUF file (its header; tensor bytes are only bounds-checked).
pub fn inspect(g: &GgufFile) -> Inspection {
    let architecture = g.architecture().ok().map(str::to_string);
    let meta_u64 = |k: &str| g.meta(k).and_then(|v| v.as_u64());
    let context_length = architecture
        .as_ref()
        .and_then(|a| meta_u64(&format!("{a}.context_length")));
    let vocabulary = g.get_str("tokenizer.ggml.model").ok().map(|m| {
        let n = g
            .meta("tokenizer.ggml.tokens")
            .and_then(|v| v.as_array())
            .map_or(0, <[_]>::len);
        match g.get_str("tokenizer.ggml.pre") {
            Ok(pre) => format!("{m} (pre-tokenizer {pre}), {n} tokens"),
            Err(_) => format!("{m}, {n} tokens"),
        }
    });
    let mut types: BTreeMap<String, TypeCount> = BTreeMap::new();
    let mut problems = Vec::new();
    if let Err(e) = ModelConfig::from_gguf(g) {
        problems.push(format!("model: {e}"));
    }
    if let Err(e) = Tokenizer::from_gguf(g) {
        problems.push(format!("tokenizer: {e}"));
    }
    // Unsupported types, grouped: type → (count, first tensor).
    let mut unsupported: BTreeMap<String, (usize, String)> = BTreeMap::new();
    for t in &g.tensors {
        let c = types.entry(t.ty.to_string()).or_default();
        c.tensors += 1;
        // Saturating: a corrupt header can claim sizes whose sum overflows.
        c.elements = c.elements.saturating_add(t.n_elements());
        c.bytes = c.bytes.saturating_add(t.n_bytes().unwrap_or(0));
        if !loadable(t.ty) {
            let u = unsupported
                .entry(t.ty.to_string())
                .or_insert((0, t.name.clone()));
            u.0 += 1;
        } else if let Err(e) = g.tensor_data(&t.name) {
            problems.push(e.to_string());
        }
    }
    for (ty, (n, first)) in unsupported {
        problems.push(format!(
            "{n} tensor(s) of type {ty} (first: {first}): cleave has no kernel for {ty}"
        ));
    }
    Inspection {
        architecture,
        name: g.get_str("general.name").ok().map(str::to_string),
        types,
        context_length,
        vocabulary,
        chat_template: chat_template_state(g),
        problems,
    }
}

impl fmt::Display for Inspection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let or_none = |v: &Option<String>| v.clone().unwrap_or_else(|| "(none)".into());
        writeln!(f, "architecture:   {}", or_none(&self.architecture))?;
        if let Some(n) = &self.name {
            writeln!(f, "name:           {n}")?;
        }
        let ctx = self
            .context_length
            .map_or("(none)".into(), |c| c.to_string());
        writeln!(f, "context length: {ctx}")?;
        writeln!(f, "vocabulary:     {}", or_none(&self.vocabulary))?;
        writeln!(f, "chat template:  {}", self.chat_template)?;
        let (params, bytes) = self.types.values().fold((0u64, 0u64), |(p, b), c| {
            (p.saturating_add(c.elements), b.saturating_add(c.bytes))
        });
        writeln!(
            f,
            "tensors:        {} ({:.1} M parameters, {:.1} MiB)",
            self.types.values().map(|c| c.tensors).sum::<usize>(),
            params as f64 / 1e6,
            bytes as f64 / (1 << 20) as f64
        )?;
        for (ty, c) in &self.types {
            writeln!(
                f,
                "  {ty:<8} {:>5} tensors {:>8.1} M parameters {:>9.1} MiB",
                c.tensors,
                c.elements as f64 / 1e6,
                c.bytes as f64 / (1 << 20) as f64
            )?;
        }
        if self.runnable() {
            write!(f, "runnable:       yes")
        } else {
            write!(f, "runnable:       no")?;
            for p in &self.problems {
                write!(f, "\n  - {p}")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inspect_survives_sizes_whose_sum_overflows() {
        // Two tensors of a type cleave does not know, each claiming 2^63 elements: their sum
        // does not fit a u64 (`cleave fuzz --target gguf` found the overflow).
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes()); // version
        b.extend(2u64.to_le_bytes()); // tensors
        b.extend(0u64.to_le_bytes()); // metadata pairs
        for name in ["a", "b"] {
            b.extend((name.len() as u64).to_le_bytes());
            b.extend(name.as_bytes());
            b.extend(2u32.to_le_bytes());
            b.extend((1u64 << 32).to_le_bytes());
            b.extend((1u64 << 31).to_le_bytes());
            b.extend(200u32.to_le_bytes()); // an unknown type
            b.extend(0u64.to_le_bytes()); // offset
        }
        b.resize(b.len().next_multiple_of(32), 0);
        let g = GgufFile::from_bytes(b).expect("unknown types are parsed, not sized");
        let text = inspect(&g).to_string();
        assert!(text.contains("tensors:"), "{text}");
    }
}
