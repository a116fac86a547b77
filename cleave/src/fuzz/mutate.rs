//! The generators every target shares: byte-level mutations, edge-case numbers and strings,
//! and mutations of JSON values.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;
use serde_json::{json, Map, Value};

/// Byte sequences that break decoders: invalid or overlong UTF-8, surrogates, NULs, JSON
/// fragments and escapes, huge digits.
const CHUNKS: &[&[u8]] = &[
    b"\xff",
    b"\xc0\x80",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe2\x82",
    b"\x00",
    b"\\u0000",
    b"\\ud800",
    b"\\udfff\\ud800",
    b"{",
    b"[",
    b"\"",
    b"}",
    b",",
    b":",
    b"99999999999999999999999999",
    b"-0.0e-999",
    b"1e999",
    b"null",
    b"<|im_start|>",
    b"{{",
    b"{%",
];

/// Overwrites random bytes, inserts, deletes, duplicates and truncates: 1 to 8 edits.
pub fn bytes(rng: &mut StdRng, data: &mut Vec<u8>) {
    for _ in 0..rng.gen_range(1..=8) {
        let len = data.len();
        let at = if len == 0 { 0 } else { rng.gen_range(0..len) };
        match rng.gen_range(0..8) {
            0 if len > 0 => data[at] ^= 1 << rng.gen_range(0..8),
            1 if len > 0 => data[at] = rng.gen(),
            2 => {
                let n = rng.gen_range(1..16);
                let extra: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                data.splice(at..at, extra);
            }
            3 if len > 0 => {
                let end = (at + rng.gen_range(1..64)).min(len);
                data.drain(at..end);
            }
            4 if len > 0 => {
                let end = (at + rng.gen_range(1..64)).min(len);
                let copy = data[at..end].to_vec();
                let to = rng.gen_range(0..=len);
                data.splice(to..to, copy);
            }
            5 => data.truncate(at),
            6 => {
                let chunk = CHUNKS.choose(rng).expect("chunks");
                data.splice(at..at, chunk.iter().copied());
            }
            _ if len >= 8 => {
                let word: u64 = *[0, u64::MAX, 0x8000_0000, u32::MAX as u64, 1 << 63, 1]
                    .choose(rng)
                    .expect("words");
                let n = rng.gen_range(1..=8).min(len - at);
                data[at..at + n].copy_from_slice(&word.to_le_bytes()[..n]);
            }
            _ => data.push(rng.gen()),
        }
    }
}

/// An integer that sits at an edge.
pub fn edge_u64(rng: &mut StdRng) -> u64 {
    *[
        0,
        1,
        2,
        7,
        255,
        256,
        65_535,
        65_536,
        i32::MAX as u64,
        u32::MAX as u64,
        u32::MAX as u64 + 1,
        i64::MAX as u64,
        u64::MAX,
    ]
    .choose(rng)
    .expect("edges")
}

/// A 32-bit integer: usually small, sometimes at an edge.
pub fn edge_u32(rng: &mut StdRng, small: u32) -> u32 {
    if rng.gen_bool(0.7) {
        rng.gen_range(0..=small)
    } else {
        edge_u64(rng) as u32
    }
}

/// A float that sits at an edge (NaN, infinities, subnormals, negatives, huge).
pub fn edge_f32(rng: &mut StdRng) -> f32 {
    *[
        0.0,
        -0.0,
        0.5,
        1.0,
        2.0,
        -1.0,
        1e-45,
        f32::MAX,
        f32::MIN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        100.0,
    ]
    .choose(rng)
    .expect("edges")
}

/// Text of the kinds that break tokenizers and templates: empty, emoji and combining marks,
/// right-to-left, NUL and control characters, special-token text, template syntax, long runs.
pub fn string(rng: &mut StdRng) -> String {
    const PIECES: &[&str] = &[
        "",
        "Hello",
        " ",
        "\n",
        "\u{0}",
        "\u{7f}\u{1b}[0m",
        "😀👩‍👩‍👧",
        "e\u{301}\u{301}",
        "\u{202e}abc",
        "\u{feff}",
        "日本語",
        "<|im_start|>",
        "<|im_end|>",
        "</s>",
        "{{ messages }}",
        "{% for %}",
        "\\u0000",
        "\"}",
        "```json\n{\"a\": 1}\n```",
        "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
        "\u{10ffff}",
    ];
    let mut s = String::new();
    for _ in 0..rng.gen_range(0..6) {
        s.push_str(PIECES.choose(rng).expect("pieces"));
    }
    if rng.gen_bool(0.02) {
        let unit = PIECES.choose(rng).expect("pieces");
        s.push_str(&unit.repeat(rng.gen_range(1..20_000)));
    }
    s
}

/// Keys the API and templates look for, so random objects hit real fields.
const KEYS: &[&str] = &[
    "role",
    "content",
    "type",
    "text",
    "name",
    "arguments",
    "function",
    "tool_calls",
    "tool_call_id",
    "id",
    "parameters",
    "json_schema",
    "schema",
    "strict",
    "properties",
    "items",
    "required",
    "enum",
    "anyOf",
    "$ref",
    "max_tokens",
    "n",
    "stop",
    "stream",
    "logprobs",
    "top_logprobs",
    "include_usage",
    "image_url",
];

/// A placeholder that [`render`] turns into a number JSON values cannot hold (`1e999`, a
/// 20-digit integer) or into `depth` nested arrays.
const RAW: char = '\u{1}';

/// A random JSON value, `depth` levels deep at most.
pub fn value(rng: &mut StdRng, depth: u32) -> Value {
    match rng.gen_range(0..if depth == 0 { 7 } else { 9 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.gen()),
        2 => json!(edge_u64(rng)),
        3 => json!(-(edge_u64(rng) as i64).saturating_abs()),
        4 => json!([0.5, -1.5, 1e300, -1e-300, 3.0][rng.gen_range(0..5)]),
        5 => Value::String(string(rng)),
        6 => {
            let raw = ["1e999", "-1e999", "18446744073709551616", "1.0e-400", "-0"];
            match rng.gen_range(0..4) {
                0 => Value::String(format!(
                    "{RAW}DEEP:{}",
                    [64, 127, 129, 1_000, 100_000][rng.gen_range(0..5)]
                )),
                _ => Value::String(format!("{RAW}{}", raw.choose(rng).expect("raw"))),
            }
        }
        7 => Value::Array(
            (0..rng.gen_range(0..4))
                .map(|_| value(rng, depth - 1))
                .collect(),
        ),
        _ => {
            let mut m = Map::new();
            for _ in 0..rng.gen_range(0..4) {
                let key = if rng.gen_bool(0.8) {
                    KEYS.choose(rng).expect("keys").to_string()
                } else {
                    string(rng)
                };
                m.insert(key, value(rng, depth - 1));
            }
            Value::Object(m)
        }
    }
}

/// Mutates `v` in place at one random node: replaces, deletes or adds a member, or changes a
/// value's type.
pub fn json(rng: &mut StdRng, v: &mut Value) {
    // Walk down a random path, stopping with probability 1/3 at each level.
    let descend = !rng.gen_bool(0.33);
    match v {
        Value::Object(m) if descend && !m.is_empty() => {
            let keys: Vec<String> = m.keys().cloned().collect();
            let key = keys.choose(rng).expect("non-empty");
            if let Some(child) = m.get_mut(key) {
                json(rng, child);
            }
        }
        Value::Array(a) if descend && !a.is_empty() => {
            let at = rng.gen_range(0..a.len());
            json(rng, &mut a[at]);
        }
        Value::Object(m) => match rng.gen_range(0..4) {
            0 if !m.is_empty() => {
                let keys: Vec<String> = m.keys().cloned().collect();
                m.remove(keys.choose(rng).expect("non-empty"));
            }
            1 => {
                let key = KEYS.choose(rng).expect("keys").to_string();
                m.insert(key, value(rng, 3));
            }
            _ => *v = value(rng, 3),
        },
        Value::Array(a) => match rng.gen_range(0..4) {
            0 if !a.is_empty() => {
                a.remove(rng.gen_range(0..a.len()));
            }
            1 => a.push(value(rng, 3)),
            2 if !a.is_empty() => {
                let copy = a[rng.gen_range(0..a.len())].clone();
                a.extend(std::iter::repeat_n(copy, rng.gen_range(1..64)));
            }
            _ => *v = value(rng, 3),
        },
        _ => *v = value(rng, 3),
    }
}

/// `v` as JSON text, with the placeholders of [`value`] expanded.
pub fn render(v: &Value) -> Vec<u8> {
    let text = v.to_string();
    if !text.contains("\\u0001") {
        return text.into_bytes();
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("\"\\u0001") {
        out.push_str(&rest[..at]);
        let body = &rest[at + 7..];
        let end = body.find('"').unwrap_or(body.len());
        let raw = &body[..end];
        match raw
            .strip_prefix("DEEP:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(n) => {
                out.push_str(&"[".repeat(n));
                out.push_str(&"]".repeat(n));
            }
            None => out.push_str(raw),
        }
        rest = body.get(end + 1..).unwrap_or("");
    }
    out.push_str(rest);
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn placeholders_become_raw_numbers_and_nesting() {
        let v = json!({"a": format!("{RAW}1e999"), "b": [format!("{RAW}DEEP:3")], "c": "x"});
        assert_eq!(
            String::from_utf8(render(&v)).unwrap(),
            r#"{"a":1e999,"b":[[[[]]]],"c":"x"}"#
        );
    }

    #[test]
    fn mutations_change_the_input_and_stay_reproducible() {
        let base = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec();
        let run = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut b = base.clone();
            bytes(&mut rng, &mut b);
            let mut v: Value = serde_json::from_slice(&base).unwrap();
            json(&mut rng, &mut v);
            (b, v)
        };
        assert_eq!(run(7), run(7));
        let changed = (0..50).filter(|&s| run(s).0 != base).count();
        assert!(
            changed > 40,
            "{changed} of 50 byte mutations changed nothing"
        );
    }
}
