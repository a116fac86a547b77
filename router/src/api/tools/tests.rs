use super::*;

fn tool(name: &str) -> Value {
    json!({"type": "function", "function": {"name": name, "description": "d",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

fn param_of(e: ApiError) -> String {
    match e {
        ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
        other => panic!("not a 400: {other:?}"),
    }
}

#[test]
fn tool_choice_forms() {
    assert_eq!(parse(None, None, None).unwrap(), None);
    let t = parse(Some(vec![tool("a"), tool("b")]), None, None)
        .unwrap()
        .unwrap();
    assert_eq!((t.choice.clone(), t.parallel), (ToolChoice::Auto, true));
    assert_eq!(
        parse(Some(vec![tool("a")]), Some(json!("none")), None).unwrap(),
        None
    );
    let t = parse(Some(vec![tool("a")]), Some(json!("required")), Some(false))
        .unwrap()
        .unwrap();
    assert_eq!(
        (t.choice.clone(), t.parallel),
        (ToolChoice::Required, false)
    );
    let named = json!({"type": "function", "function": {"name": "b"}});
    let t = parse(Some(vec![tool("a"), tool("b")]), Some(named), None)
        .unwrap()
        .unwrap();
    assert_eq!(t.choice, ToolChoice::Named(1));
}

#[test]
fn bad_tools_name_the_field() {
    let unknown = json!({"type": "function", "function": {"name": "zzz"}});
    assert_eq!(
        param_of(parse(Some(vec![tool("a")]), Some(unknown), None).unwrap_err()),
        "tool_choice"
    );
    assert_eq!(
        param_of(parse(None, Some(json!("required")), None).unwrap_err()),
        "tool_choice"
    );
    assert_eq!(
        param_of(parse(Some(vec![tool("a")]), Some(json!("sometimes")), None).unwrap_err()),
        "tool_choice"
    );
    assert_eq!(
        param_of(parse(Some(vec![tool("bad name!")]), None, None).unwrap_err()),
        "tools[0].function.name"
    );
    assert_eq!(
        param_of(parse(Some(vec![tool("a"), tool("a")]), None, None).unwrap_err()),
        "tools[1].function.name"
    );
    let no_fn = json!({"type": "function"});
    assert_eq!(
        param_of(parse(Some(vec![no_fn]), None, None).unwrap_err()),
        "tools[0].function"
    );
    let retrieval = json!({"type": "retrieval"});
    assert_eq!(
        param_of(parse(Some(vec![retrieval]), None, None).unwrap_err()),
        "tools[0].type"
    );
    let bad_params = json!({"type": "function", "function": {"name": "f", "parameters": 3}});
    assert_eq!(
        param_of(parse(Some(vec![bad_params]), None, None).unwrap_err()),
        "tools[0].function.parameters"
    );
}

#[test]
fn forced_choices_get_a_call_grammar_and_auto_none() {
    let auto = parse(Some(vec![tool("a")]), None, None).unwrap().unwrap();
    assert_eq!(auto.constraint().unwrap(), None);
    let req = parse(
        Some(vec![tool("a"), tool("b")]),
        Some(json!("required")),
        None,
    )
    .unwrap()
    .unwrap();
    let Some(Constraint::Lark { grammar }) = req.constraint().unwrap() else {
        panic!("no grammar")
    };
    assert!(
        grammar.starts_with("start: call (\"\\n\" call)*"),
        "{grammar}"
    );
    assert!(grammar.contains("\\\"name\\\": \\\"b\\\""), "{grammar}");
    assert!(grammar.contains("args_1: %json"), "{grammar}");
}

#[test]
fn templates_without_tools_get_the_calls_as_text() {
    let t = parse(Some(vec![tool("get_weather")]), None, None)
        .unwrap()
        .unwrap();
    let mut asst = ChatMessage::new("assistant", "");
    asst.tool_calls = Some(vec![json!({"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}})]);
    let mut result = ChatMessage::new("tool", "{\"temp\": 21}");
    result.tool_call_id = Some("call_1".into());
    let msgs = vec![ChatMessage::new("user", "Weather in Paris?"), asst, result];
    let out = fallback_messages(msgs, Some(&t));
    assert_eq!(out[0].role, "system");
    assert!(
        out[0].content.contains("<tools>\n{\"type\":\"function\""),
        "{}",
        out[0].content
    );
    assert_eq!(
        out[2].content,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\"}}\n</tool_call>"
    );
    assert_eq!(
        (out[3].role.as_str(), out[3].content.as_str()),
        ("user", "<tool_response>\n{\"temp\": 21}\n</tool_response>")
    );
}
