//! Tools and structured output at the HTTP layer: what reaches the backend (the constraint,
//! the tool description in the prompt), tool calls parsed out of the text whole and streamed,
//! and a 400 naming the field for every bad schema, grammar, tool or history.

use axum::http::StatusCode;
use cleave_text::constrain::Constraint;
use serde_json::{json, Value};

use super::streaming::parse;
use super::{harness, hello, model, Mode, Opts, MODEL};

const CALLS: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}\n</tool_call>";

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
    ])
}

fn opts(mode: Mode) -> Opts {
    Opts {
        mode,
        ..Opts::default()
    }
}

#[tokio::test]
async fn tool_calls_are_parsed_out_of_the_reply() {
    let Some(h) = harness(opts(Mode::Text(CALLS))) else {
        return;
    };
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": hello(), "tools": tools()}),
        )
        .await;
    let v = r.json();
    assert_eq!(r.status, StatusCode::OK, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "unit": "celsius"}));
    assert_eq!(calls[1]["function"]["arguments"], "{\"zone\": \"CET\"}");
    // `auto`: no constraint; the template (SmolLM2's has no tool support) got the tools in a
    // system message.
    let req = h.fake.requests.lock().unwrap()[0].clone();
    assert_eq!(req.params.constraint, None);
    let (tok, _) = model().unwrap();
    let prompt = tok.decode(&req.prompt);
    assert!(
        prompt.contains("<tools>\n{\"type\":\"function\""),
        "{prompt}"
    );
    assert!(prompt.contains("\"name\":\"get_weather\""), "{prompt}");
}

#[tokio::test]
async fn streamed_tool_call_deltas_assemble_into_the_calls() {
    let Some(h) = harness(opts(Mode::Text(CALLS))) else {
        return;
    };
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": hello(), "tools": tools(), "stream": true}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK);
    let (chunks, done) = parse(&r.events());
    assert!(done);
    let mut calls: Vec<(String, String, String)> = Vec::new();
    let mut fragments = 0;
    for c in &chunks {
        let d = &c["choices"][0]["delta"];
        assert!(
            d["content"].as_str().is_none_or(str::is_empty),
            "content in {c}"
        );
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if let Some(id) = tc["id"].as_str() {
                assert_eq!(i, calls.len(), "a new call takes the next index");
                assert_eq!(tc["type"], "function");
                calls.push((
                    id.into(),
                    tc["function"]["name"].as_str().unwrap().into(),
                    String::new(),
                ));
            } else {
                assert!(tc["function"].get("name").is_none());
            }
            calls[i]
                .2
                .push_str(tc["function"]["arguments"].as_str().unwrap());
            fragments += 1;
        }
    }
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].1, "get_weather");
    let args: Value = serde_json::from_str(&calls[0].2).unwrap();
    assert_eq!(args, json!({"city": "Paris", "unit": "celsius"}));
    assert_eq!(calls[1].2, "{\"zone\": \"CET\"}");
    assert!(
        fragments > 4,
        "arguments arrive in fragments, not whole: {fragments}"
    );
    let last = &chunks[chunks.len() - 1]["choices"][0];
    assert_eq!(last["finish_reason"], "tool_calls");
}

#[tokio::test]
async fn required_and_named_choices_send_a_call_grammar() {
    let Some(h) = harness(opts(Mode::Text(CALLS))) else {
        return;
    };
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    for (choice, parallel, names) in [
        (json!("required"), true, vec!["get_weather", "get_time"]),
        (named, false, vec!["get_time"]),
    ] {
        let r = h
            .post(
                "/v1/chat/completions",
                json!({"model": MODEL, "messages": hello(), "tools": tools(),
                       "tool_choice": choice, "parallel_tool_calls": parallel}),
            )
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json());
        let req = h.fake.requests.lock().unwrap().last().unwrap().clone();
        let Some(Constraint::Lark { grammar }) = req.params.constraint else {
            panic!("no grammar for {choice}");
        };
        for n in ["get_weather", "get_time"] {
            assert_eq!(
                grammar.contains(&format!("\\\"{n}\\\"")),
                names.contains(&n),
                "{grammar}"
            );
        }
        assert_eq!(
            grammar.contains("call (\"\\n\" call)*"),
            parallel,
            "{grammar}"
        );
    }
}

#[tokio::test]
async fn response_formats_reach_the_backend_as_constraints() {
    let Some(h) = harness(opts(Mode::Text("{\"a\": 1}"))) else {
        return;
    };
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": false});
    let bodies = [
        (
            json!({"model": MODEL, "messages": hello(), "response_format": {"type": "json_schema",
            "json_schema": {"name": "A", "schema": schema, "strict": true}}}),
            "/v1/chat/completions",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}}),
            "/v1/completions",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}),
            "/v1/completions",
        ),
    ];
    let want = [
        Constraint::JsonSchema {
            schema: schema.clone(),
        },
        Constraint::JsonObject,
        Constraint::Choice {
            choices: vec!["a".into(), "b".into()],
        },
    ];
    for ((body, path), want) in bodies.into_iter().zip(want) {
        let r = h.post(path, body).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json());
        let req = h.fake.requests.lock().unwrap().last().unwrap().clone();
        assert_eq!(req.params.constraint, Some(want));
    }
}

#[tokio::test]
async fn bad_schemas_grammars_tools_and_histories_are_400s_naming_the_field() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let chat = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": hello()});
        b.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        b
    };
    let bad_params = json!([{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "array", "uniqueItems": true}}}}}]);
    let history = json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": "}}]}
    ]);
    let orphan = json!([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_9", "content": "21"}]);
    let cases = [
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
            "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}}),
            ),
            "response_format.json_schema.schema",
        ),
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
            "schema": {"type": "array", "uniqueItems": true}}}}),
            ),
            "response_format.json_schema.schema",
        ),
        (
            chat(json!({"structured_outputs": {"grammar": "start: nowhere"}})),
            "structured_outputs.grammar",
        ),
        (
            chat(json!({"structured_outputs": {"regex": "(unclosed"}})),
            "structured_outputs.regex",
        ),
        (
            chat(json!({"tools": bad_params})),
            "tools[0].function.parameters",
        ),
        (
            chat(
                json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            ),
            "tool_choice",
        ),
        (
            chat(json!({"tools": tools(), "response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            json!({"model": MODEL, "messages": history}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!({"model": MODEL, "messages": orphan}),
            "messages[1].tool_call_id",
        ),
        (
            json!({"model": MODEL, "prompt": "x", "tools": tools()}),
            "tools",
        ),
    ];
    for (body, field) in cases {
        let r = h.post("/v1/chat/completions", body.clone()).await;
        let r = if body.get("prompt").is_some() {
            h.post("/v1/completions", body.clone()).await
        } else {
            r
        };
        let e = r.error(StatusCode::BAD_REQUEST);
        assert_eq!(e["param"], field, "{body}: {e}");
    }
    assert!(
        h.fake.requests.lock().unwrap().is_empty(),
        "a bad request reached the backend"
    );
}

#[tokio::test]
async fn a_tool_result_turn_is_rendered_for_the_model() {
    let Some(h) = harness(Opts::default()) else {
        return;
    };
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}
    ]);
    let r = h
        .post(
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": messages, "tools": tools()}),
        )
        .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.json());
    let req = h.fake.requests.lock().unwrap()[0].clone();
    let (tok, _) = model().unwrap();
    let prompt = tok.decode(&req.prompt);
    assert!(prompt.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call><|im_end|>"), "{prompt}");
    assert!(
        prompt.contains(
            "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>"
        ),
        "{prompt}"
    );
}
