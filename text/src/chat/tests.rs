//! Tests of chat template rendering: the real model's template and Jinja/Python compatibility.

use super::*;
use crate::gguf::default_model_path;

fn real_template() -> Option<ChatTemplate> {
    let path = default_model_path();
    if !path.exists() {
        eprintln!("skipping: model not found at {}", path.display());
        return None;
    }
    let g = GgufFile::open(&path).expect("open model");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    Some(ChatTemplate::from_gguf(&g, &tok).expect("template"))
}

fn convo() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "Hello"),
        ChatMessage::new("assistant", "Hi there"),
        ChatMessage::new("user", "How are you?"),
    ]
}

#[test]
fn real_template_two_turns() {
    let Some(t) = real_template() else { return };
    assert_eq!(t.bos_token, "<|im_start|>");
    assert_eq!(t.eos_token, "<|im_end|>");
    let out = t.render(&convo(), true).unwrap();
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi \
         there<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
    );
    let no_prompt = t.render(&convo(), false).unwrap();
    assert!(no_prompt.ends_with("How are you?<|im_end|>\n"));
}

#[test]
fn real_template_explicit_system() {
    let Some(t) = real_template() else { return };
    let mut msgs = vec![ChatMessage::new("system", "Be brief.")];
    msgs.extend(convo());
    let out = t.render(&msgs, true).unwrap();
    assert!(out.starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello"));
    assert!(!out.contains("SmolLM"));
    assert_eq!(out.matches("<|im_start|>system").count(), 1);
}

#[test]
fn syntax_error_is_an_error() {
    for bad in [
        "{% for m in messages %}",
        "{{ ",
        "{% if %}{% endif %}",
        "{% endfor %}",
    ] {
        assert!(matches!(
            ChatTemplate::new(bad, "", ""),
            Err(ChatError::Syntax(_))
        ));
    }
}

#[test]
fn raise_exception_and_render_errors() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
        "",
        "",
    )
    .unwrap();
    assert_eq!(t.render(&convo(), false).unwrap(), "ok");
    match t.render(&[ChatMessage::new("assistant", "x")], false) {
        Err(ChatError::Raised(msg)) => assert_eq!(msg, "first must be user"),
        other => panic!("expected Raised, got {other:?}"),
    }
    let t = ChatTemplate::new("{{ messages[0].content.nosuchmethod() }}", "", "").unwrap();
    assert!(matches!(
        t.render(&convo(), false),
        Err(ChatError::Render(_))
    ));
}

#[test]
fn hf_jinja_settings_and_python_methods() {
    // trim_blocks and lstrip_blocks: block tags leave no whitespace behind.
    let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content.strip() }}]\n    {% endif %}\n{% endfor %}\n";
    let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
    let msgs = [
        ChatMessage::new("user", "  a  "),
        ChatMessage::new("assistant", "b"),
    ];
    assert_eq!(t.render(&msgs, false).unwrap(), "[a]\n");

    let src = concat!(
        "{{ bos_token }}",
        "{% for m in messages %}",
        "{% if loop.index0 > 1 %}{% break %}{% endif %}",
        "{% if m.role == 'system' %}{% continue %}{% endif %}",
        "{{ m.role.upper() }}:{{ m.content.lstrip('x').rstrip('!') }}|",
        "{{ m.content.startswith(('x', 'y')) }}|{{ m.content.split('x') | length }}|",
        "{{ m.content.replace('x', 'y', 1) }}|{{ ' a  b '.split() }}|{{ 'hello world'.title() }}|",
        "{{ '-'.join(['p', 'q']) }}|{{ 'abc'.find('c') }}|",
        "{% endfor %}",
        "{{ eos_token }}",
        "{% set d = {'k': 1, 'j': 'x'} %}",
        "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
        "{{ d.get('k') }}{{ d.get('z', 'dflt') }}{{ d.keys() | list | length }}",
        "|{{ {'a': [1, 'é<'], 'b': none} | tojson }}",
        "|{{ strftime_now('%Y') | length }}",
    );
    let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
    let msgs = [
        ChatMessage::new("system", "sys"),
        ChatMessage::new("user", "xxhix!"),
        ChatMessage::new("user", "never"),
    ];
    assert_eq!(
        t.render(&msgs, false).unwrap(),
        "<s>USER:hix|True|4|yxhix!|[\"a\", \"b\"]|Hello World|p-q|2|</s>k=1;j=x;1dflt2\
         |{\"a\": [1, \"é<\"], \"b\": null}|4"
    );
}

#[test]
fn chat_message_serde() {
    let m: ChatMessage = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
    assert_eq!(m, ChatMessage::new("user", "hi"));
}

#[test]
fn shared_types_are_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<ChatTemplate>();
    check::<GgufFile>();
}

/// A template in the shape of the tool-aware ChatML templates (Qwen 2.5, Hermes): tools in the
/// system turn, calls with `tojson` arguments, `tool` turns with the call id.
const TOOL_TEMPLATE: &str = "{% if tools %}<|system|>tools:{% for t in tools %}\
{{ t.function.name }}({{ t.function.parameters | tojson }});{% endfor %}\n{% endif %}\
{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\
{% if m.tool_calls %}{% for c in m.tool_calls %}[call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endif %}\
{% if m.tool_call_id is defined %}(answers {{ m.tool_call_id }}){% endif %}\n{% endfor %}";

#[test]
fn tool_aware_templates_get_the_tools_calls_and_results() {
    let t = ChatTemplate::new(TOOL_TEMPLATE, "", "").unwrap();
    assert!(t.supports_tools());
    let tools = [
        serde_json::json!({"type": "function", "function": {"name": "f",
        "parameters": {"type": "object"}}}),
    ];
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = Some(vec![serde_json::json!({"id": "call_1", "type": "function",
        "function": {"name": "f", "arguments": {"x": 1}}})]);
    let mut result = ChatMessage::new("tool", "42");
    result.tool_call_id = Some("call_1".into());
    let msgs = [ChatMessage::new("user", "hi"), call, result];
    assert_eq!(
        t.render_with_tools(&msgs, Some(&tools), false).unwrap(),
        // (trim_blocks drops the newline after each block tag, as Jinja2 does.)
        "<|system|>tools:f({\"type\": \"object\"});<|user|>hi\
         <|assistant|>[call call_1 f {\"x\": 1}]<|tool|>42(answers call_1)"
    );
    // Without tools the template's tools block is skipped (`tools` is none).
    assert!(t
        .render(&msgs[..1], false)
        .unwrap()
        .starts_with("<|user|>hi"));
    // SmolLM2's template has no tool support.
    if let Some(real) = real_template() {
        assert!(!real.supports_tools());
    }
}

#[test]
fn a_template_engine_panic_is_a_render_error() {
    // minijinja 2.24 panics slicing an empty list backwards (found by `cleave fuzz --target
    // chat` on a template of llama.cpp's test set).
    let t = ChatTemplate::new(
        "{% for m in messages[::-1] %}{{ m.content }}{% endfor %}.",
        "",
        "",
    )
    .unwrap();
    assert!(t.render(&convo(), false).unwrap().ends_with('.'));
    match t.render(&[], false) {
        Err(ChatError::Render(msg)) => assert!(msg.contains("template engine failed"), "{msg}"),
        other => panic!("expected a render error, got {other:?}"),
    }
}

fn builtin(name: &str) -> ChatTemplate {
    ChatTemplate::new(builtin::source(name).expect("built in"), "<bos>", "<eos>").unwrap()
}

fn with_system() -> Vec<ChatMessage> {
    let mut m = vec![ChatMessage::new("system", " Be brief. ")];
    m.extend(convo());
    m
}

#[test]
fn builtin_templates_render_their_formats() {
    assert_eq!(
        builtin("chatml").render(&with_system(), true).unwrap(),
        "<|im_start|>system\n Be brief. <|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
         <|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(
        builtin("llama3").render(&with_system(), true).unwrap(),
        "<bos><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    // Gemma: the system message opens the first user turn; assistant turns are `model`'s.
    assert_eq!(
        builtin("gemma").render(&with_system(), true).unwrap(),
        "<bos><start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n\
         <start_of_turn>model\nHi there<end_of_turn>\n\
         <start_of_turn>user\nHow are you?<end_of_turn>\n<start_of_turn>model\n"
    );
    assert_eq!(
        builtin("gemma").render(&convo(), false).unwrap(),
        "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\nHi \
         there<end_of_turn>\n<start_of_turn>user\nHow are you?<end_of_turn>\n"
    );
    assert_eq!(builtin::names(), "chatml, llama3, gemma");
}

/// A scratch directory of this process and test, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(test: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("cleave-chat-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A tiny Hugging Face model directory whose `tokenizer_config.json` has no chat template.
fn model_without_template(dir: &std::path::Path) -> crate::model_text::ModelText {
    crate::tiny::write_model(
        dir,
        crate::tiny::Kind::Llama,
        crate::safetensors::Dtype::F32,
        1,
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"add_bos_token": false}"#,
    )
    .unwrap();
    crate::model_text::ModelText::open(dir).unwrap()
}

#[test]
fn chat_template_flag_takes_a_name_a_file_or_the_text() {
    let tmp = Scratch::new("flag");
    let text = model_without_template(&tmp.path().join("model"));
    assert!(text.template.is_none());
    let user = [ChatMessage::new("user", "Hi")];
    let render = |flag: &str| {
        let t = crate::model_text::ModelText::open(&tmp.path().join("model"))
            .unwrap()
            .with_chat_template(Some(flag))
            .unwrap();
        t.template.expect("a template").render(&user, true).unwrap()
    };
    assert_eq!(
        render("chatml"),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    let file = tmp.path().join("t.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}[{{ m.content }}]{% endfor %}",
    )
    .unwrap();
    assert_eq!(render(file.to_str().unwrap()), "[Hi]");
    assert_eq!(render("{{ messages[0].role }}!"), "user!");
    // No flag: the model's own (here none).
    let none = text.with_chat_template(None).unwrap();
    assert!(none.template.is_none());
}

#[test]
fn a_bad_chat_template_flag_names_what_was_wrong() {
    let tmp = Scratch::new("bad-flag");
    let text = model_without_template(&tmp.path().join("model"));
    let tok = text.tokenizer.clone();
    let missing = tmp.path().join("nope.jinja");
    let e = ChatTemplate::from_flag(missing.to_str().unwrap(), &tok).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ChatError::Choice { .. }), "{e:?}");
    assert!(
        msg.contains("nope.jinja") && msg.contains("chatml, llama3, gemma"),
        "{msg}"
    );
    let e = ChatTemplate::from_flag("{% for m in messages %}", &tok).unwrap_err();
    assert!(matches!(e, ChatError::Syntax(_)), "{e:?}");
    assert!(text.with_chat_template(Some("chatm1")).is_err());
}
