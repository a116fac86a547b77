//! Constrained decoding end to end on the default model: the output matches its JSON schema,
//! regex, grammar or choice under greedy and seeded sampling, and a constrained request gives the
//! same tokens alone, batched with others (each with its own schema), under a small chunk
//! budget, after a prefix-cache hit and when preempted.

use crate::common;

use cleave_engine::engine::{EngineError, FinishReason, GenerateRequest};
use cleave_text::constrain::Constraint;
use cleave_text::sample::SamplingParams;
use common::{collect, engine, prompt, run_all, Outcome};
use serde_json::{json, Value};

fn constrained(c: Constraint, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        constraint: Some(c),
        ..Default::default()
    }
}

fn schema(s: Value) -> Constraint {
    Constraint::JsonSchema { schema: s }
}

fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": false
    })
}

/// Sixteen schemas, different from each other, each small enough for a short completion.
fn schemas() -> Vec<Value> {
    let mut v = vec![person()];
    for i in 0..15 {
        let key = format!("field_{i}");
        let s = match i % 5 {
            0 => {
                json!({"type": "object", "properties": {key.clone(): {"type": "integer"}}, "required": [key], "additionalProperties": false})
            }
            1 => {
                json!({"type": "object", "properties": {key.clone(): {"type": "boolean"}, "note": {"type": "string", "maxLength": 8}}, "required": [key, "note"], "additionalProperties": false})
            }
            2 => {
                json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4})
            }
            3 => {
                json!({"type": "object", "properties": {key.clone(): {"enum": ["red", "green", "blue"]}}, "required": [key], "additionalProperties": false})
            }
            _ => {
                json!({"type": "object", "properties": {key.clone(): {"anyOf": [{"type": "null"}, {"type": "number"}]}}, "required": [key], "additionalProperties": false})
            }
        };
        v.push(s);
    }
    v
}

fn parsed(o: &Outcome) -> Value {
    assert_eq!(o.reason, FinishReason::Stop, "ended early: {:?}", o.text);
    serde_json::from_str(&o.text).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", o.text))
}

const ASK: &str = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn json_schema_output_parses_and_follows_the_schema() {
    let e = engine(256, 256, true);
    let p = common::loaded().tokenizer.encode(ASK, true);
    let out = run_all(&e, vec![(p, constrained(schema(person()), 96))]).await;
    let v = parsed(&out[0]);
    let obj = v.as_object().expect("an object");
    assert_eq!(obj.len(), 3, "{v}");
    assert!(
        obj["name"]
            .as_str()
            .is_some_and(|s| s.chars().count() <= 20),
        "{v}"
    );
    assert!(
        obj["age"].as_i64().is_some_and(|a| (0..=150).contains(&a)),
        "{v}"
    );
    for pet in obj["pets"].as_array().expect("pets is an array") {
        assert!(
            ["cat", "dog", "fish"].contains(&pet.as_str().unwrap()),
            "{v}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn regex_choice_and_lark_constrain_the_whole_output() {
    let e = engine(256, 256, true);
    let cases = [
        (
            Constraint::Regex {
                pattern: r"[0-9]{3}-[0-9]{4}".into(),
            },
            r"^[0-9]{3}-[0-9]{4}$",
        ),
        (
            Constraint::Choice {
                choices: vec!["Paris".into(), "London".into(), "Rome".into()],
            },
            "^(Paris|London|Rome)$",
        ),
        (
            Constraint::Lark {
                grammar: "start: \"yes\" | \"no\" | \"maybe \" NUM\nNUM: /[0-9]+/".into(),
            },
            "^(yes|no|maybe [0-9]+)$",
        ),
        (Constraint::JsonObject, r"^\{.*\}$"),
    ];
    for (c, want) in cases {
        let p = prompt("The capital of France is");
        let out = run_all(&e, vec![(p, constrained(c.clone(), 48))]).await;
        let re = fancy_regex::Regex::new(want).unwrap();
        assert!(
            re.is_match(&out[0].text).unwrap(),
            "{c:?} gave {:?}",
            out[0].text
        );
        assert_eq!(
            out[0].reason,
            FinishReason::Stop,
            "{c:?}: {:?}",
            out[0].text
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn seeded_sampling_stays_inside_the_schema() {
    let e = engine(256, 256, true);
    let p = common::loaded().tokenizer.encode(ASK, true);
    for seed in 0..4 {
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(seed),
            logprobs: Some(2),
            ..constrained(schema(person()), 128)
        };
        let out = run_all(&e, vec![(p.clone(), params)]).await;
        if out[0].reason == FinishReason::Stop {
            parsed(&out[0]);
        } else {
            // A sampled string may run to max_tokens; what there is must still be a prefix
            // the schema allows (it starts the object).
            assert!(
                out[0].text.starts_with("{\"name\": \""),
                "{:?}",
                out[0].text
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn sixteen_schemas_batched_give_each_ones_alone_tokens() {
    let reqs: Vec<(Vec<u32>, SamplingParams)> = schemas()
        .into_iter()
        .enumerate()
        .map(|(i, s)| {
            let text = format!(
                "<|im_start|>user\nRequest {i}: answer in JSON.<|im_end|>\n<|im_start|>assistant\n"
            );
            (
                common::loaded().tokenizer.encode(&text, true),
                constrained(schema(s), 64),
            )
        })
        .collect();
    let alone_engine = engine(512, 256, false);
    let mut alone = Vec::new();
    for r in &reqs {
        alone.extend(run_all(&alone_engine, vec![r.clone()]).await);
    }
    // Batched, with a chunk budget that splits prompts, and the prefix cache on.
    let batched = run_all(&engine(512, 16, true), reqs.clone()).await;
    for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
        assert_eq!(a.ids, b.ids, "request {i}");
        if a.reason == FinishReason::Stop {
            parsed(a);
        }
    }
    let done = alone
        .iter()
        .filter(|o| o.reason == FinishReason::Stop)
        .count();
    assert!(
        done >= 12,
        "only {done} of 16 finished their JSON within 64 tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn preemption_and_prefix_hits_keep_constrained_tokens() {
    let tok = &common::loaded().tokenizer;
    let mut reqs: Vec<(Vec<u32>, SamplingParams)> = ["a cat", "a dog", "a teacher", "a sailor", "a child", "a king"]
        .iter()
        .map(|who| {
            let text = format!("<|im_start|>user\nDescribe {who} who lives by the sea, in a long and friendly way, as JSON.<|im_end|>\n<|im_start|>assistant\n");
            (tok.encode(&text, true), constrained(schema(person()), 96))
        })
        .collect();
    // The first prompt again: a prefix-cache hit.
    reqs.push(reqs[0].clone());
    let roomy = engine(512, 256, true);
    let mut want = Vec::new();
    for r in &reqs {
        want.extend(run_all(&roomy, vec![r.clone()]).await);
    }
    // 14 blocks of 16 tokens cannot hold seven of these at once: some are preempted and
    // recomputed (their grammar state must survive).
    let tight = engine(14, 64, true);
    let got = run_all(&tight, reqs).await;
    let c = tight.stats().counters;
    assert!(c.preemptions > 0, "no preemption: {c:?}");
    assert!(c.prefix_hit_tokens > 0, "no prefix hit: {c:?}");
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.ids, g.ids, "request {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn bad_constraints_are_refused_and_endless_ones_stop_at_max_tokens() {
    let e = engine(256, 256, true);
    let bad = [
        (
            schema(
                json!({"type": "object", "uniqueItems": true, "properties": {"a": {"type": "array", "uniqueItems": true}}}),
            ),
            "uniqueItems",
        ),
        (schema(json!({"type": "nonsense"})), "nonsense"),
        (schema(json!(7)), "JSON schema must be an object"),
        (
            Constraint::Regex {
                pattern: "(unclosed".into(),
            },
            "",
        ),
        (
            Constraint::Lark {
                grammar: "start: undefined_rule".into(),
            },
            "undefined_rule",
        ),
        (Constraint::Choice { choices: vec![] }, "at least one"),
    ];
    for (c, needle) in bad {
        let r = e.submit(GenerateRequest::new(prompt("x"), constrained(c.clone(), 8)));
        match r {
            Err(EngineError::BadConstraint(e)) => {
                let msg = e.to_string();
                assert!(msg.contains(needle), "{c:?}: {msg}")
            }
            other => panic!("{c:?} was not refused: {:?}", other.map(|_| ())),
        }
    }
    // `a+` never has to end: max_tokens ends it, with what was generated so far.
    let (_, rx) = e
        .submit(GenerateRequest::new(
            prompt("x"),
            constrained(
                Constraint::Regex {
                    pattern: "a+".into(),
                },
                8,
            ),
        ))
        .unwrap();
    let out = collect(rx).await;
    assert_eq!(out.reason, FinishReason::Length);
    assert_eq!(out.ids.len(), 8);
    assert!(
        !out.text.is_empty() && out.text.chars().all(|c| c == 'a'),
        "{:?}",
        out.text
    );
    // A constrained request beside a free one: the free one is unaffected.
    let free = run_all(
        &e,
        vec![(prompt("The capital of France is"), common::greedy(8))],
    )
    .await;
    let both = run_all(
        &e,
        vec![
            (prompt("The capital of France is"), common::greedy(8)),
            (
                prompt("x"),
                constrained(
                    Constraint::Regex {
                        pattern: "a+".into(),
                    },
                    8,
                ),
            ),
        ],
    )
    .await;
    assert_eq!(free[0].ids, both[0].ids);
}
