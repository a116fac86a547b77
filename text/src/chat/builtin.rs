//! Chat templates built into cleave, for models whose file carries none (`--chat-template NAME`,
//! as llama-server's built-in names). Each renders the format its model family was trained on.

/// `(name, Jinja source)` of every built-in template.
const BUILTINS: &[(&str, &str)] = &[
    // ChatML (Qwen, SmolLM, Hermes, ...).
    (
        "chatml",
        concat!(
            "{% for message in messages %}",
            "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
            "{% endfor %}",
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        ),
    ),
    // Llama 3.x instruct.
    (
        "llama3",
        concat!(
            "{{ bos_token }}",
            "{% for message in messages %}",
            "{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' ",
            "+ message.content | trim + '<|eot_id|>' }}",
            "{% endfor %}",
            "{% if add_generation_prompt %}",
            "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}",
            "{% endif %}",
        ),
    ),
    // Gemma 2 and 3: no system role (a system message opens the first user turn); the
    // assistant's turns are `model`'s.
    (
        "gemma",
        concat!(
            "{{ bos_token }}",
            "{% if messages and messages[0].role == 'system' %}",
            "{% set first = messages[0].content | trim + '\\n\\n' %}{% set rest = messages[1:] %}",
            "{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}",
            "{% for message in rest %}",
            "{{ '<start_of_turn>' + ('model' if message.role == 'assistant' else message.role) ",
            "+ '\\n' + (first if loop.first else '') + message.content | trim + '<end_of_turn>\\n' }}",
            "{% endfor %}",
            "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}",
        ),
    ),
];

/// The built-in template called `name`.
pub fn source(name: &str) -> Option<&'static str> {
    BUILTINS.iter().find(|(n, _)| *n == name).map(|(_, s)| *s)
}

/// Every built-in template, `(name, Jinja source)`.
pub fn all() -> &'static [(&'static str, &'static str)] {
    BUILTINS
}

/// The built-in names, comma-separated (for help texts and errors).
pub fn names() -> String {
    BUILTINS
        .iter()
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}
