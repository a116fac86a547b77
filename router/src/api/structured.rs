//! Structured output: OpenAI's `response_format` and vLLM's `structured_outputs` / `guided_*`
//! extensions, read into the engine's [`Constraint`] (compiled, and so checked, before the
//! request is placed).

use cleave_text::constrain::Constraint;
use serde_json::Value;

use super::error::ApiError;
use super::openai::CompletionRequest;

/// A request's output constraint and the request field it came from (for error messages).
#[derive(Clone, Debug, PartialEq)]
pub struct Requested {
    /// The constraint.
    pub constraint: Constraint,
    /// `response_format`, `structured_outputs.json`, `guided_regex`, ...
    pub field: String,
}

/// A schema given as an object or as JSON text.
fn schema_value(v: &Value, field: &str) -> Result<Value, ApiError> {
    match v {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| ApiError::invalid(field, format!("`{field}` is not valid JSON: {e}"))),
        Value::Object(_) | Value::Bool(true) => Ok(v.clone()),
        _ => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a JSON schema object"),
        )),
    }
}

fn response_format(v: &Value) -> Result<Option<Requested>, ApiError> {
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::invalid(
            "response_format.type",
            "`response_format.type` must be text, json_object or json_schema",
        )
    })?;
    let constraint = match kind {
        "text" => return Ok(None),
        "json_object" => Constraint::JsonObject,
        "json_schema" => {
            let js = v.get("json_schema").ok_or_else(|| {
                ApiError::invalid(
                    "response_format.json_schema",
                    "`response_format.json_schema` is required with type json_schema",
                )
            })?;
            if !js.get("name").is_some_and(Value::is_string) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "`response_format.json_schema.name` is required",
                ));
            }
            let schema = js.get("schema").ok_or_else(|| {
                ApiError::invalid(
                    "response_format.json_schema.schema",
                    "`response_format.json_schema.schema` is required",
                )
            })?;
            Constraint::JsonSchema {
                schema: schema_value(schema, "response_format.json_schema.schema")?,
            }
        }
        other => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!(
                "`response_format.type` must be text, json_object or json_schema, got `{other}`"
            ),
            ))
        }
    };
    let field = if kind == "json_schema" {
        "response_format.json_schema.schema"
    } else {
        "response_format"
    };
    Ok(Some(Requested {
        constraint,
        field: field.into(),
    }))
}

fn string_field(v: &Value, field: &str) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| ApiError::invalid(field, format!("`{field}` must be a string")))
}

fn choices(v: &Value, field: &str) -> Result<Vec<String>, ApiError> {
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        ApiError::invalid(
            field,
            format!("`{field}` must be a non-empty list of strings"),
        )
    })?;
    list.iter().map(|c| string_field(c, field)).collect()
}

/// vLLM's `structured_outputs`: exactly one of `json`, `regex`, `grammar`, `choice`,
/// `json_object`.
fn structured_outputs(v: &Value) -> Result<Requested, ApiError> {
    let obj = v.as_object().ok_or_else(|| {
        ApiError::invalid(
            "structured_outputs",
            "`structured_outputs` must be an object",
        )
    })?;
    let set: Vec<(&String, &Value)> = obj.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(key, value)] = set.as_slice() else {
        return Err(ApiError::invalid(
            "structured_outputs",
            "`structured_outputs` must set exactly one of json, regex, grammar, choice, json_object",
        ));
    };
    let field = format!("structured_outputs.{key}");
    let constraint = match key.as_str() {
        "json" => Constraint::JsonSchema {
            schema: schema_value(value, &field)?,
        },
        "regex" => Constraint::Regex {
            pattern: string_field(value, &field)?,
        },
        "grammar" => Constraint::Lark {
            grammar: string_field(value, &field)?,
        },
        "choice" => Constraint::Choice {
            choices: choices(value, &field)?,
        },
        "json_object" if value.as_bool() == Some(true) => Constraint::JsonObject,
        other => {
            return Err(ApiError::invalid(
                field.clone(),
                format!("`structured_outputs.{other}` is not supported: use json, regex, grammar, choice or json_object"),
            ))
        }
    };
    Ok(Requested { constraint, field })
}

/// The output constraint a request asks for, if any; asking in two ways is a 400.
pub fn requested(req: &CompletionRequest) -> Result<Option<Requested>, ApiError> {
    let mut found = Vec::new();
    if let Some(v) = &req.response_format {
        found.extend(response_format(v)?);
    }
    if let Some(v) = &req.structured_outputs {
        found.push(structured_outputs(v)?);
    }
    if let Some(v) = &req.guided_json {
        found.push(Requested {
            constraint: Constraint::JsonSchema {
                schema: schema_value(v, "guided_json")?,
            },
            field: "guided_json".into(),
        });
    }
    if let Some(p) = &req.guided_regex {
        found.push(Requested {
            constraint: Constraint::Regex { pattern: p.clone() },
            field: "guided_regex".into(),
        });
    }
    if let Some(g) = &req.guided_grammar {
        found.push(Requested {
            constraint: Constraint::Lark { grammar: g.clone() },
            field: "guided_grammar".into(),
        });
    }
    if let Some(c) = &req.guided_choice {
        found.push(Requested {
            constraint: Constraint::Choice { choices: c.clone() },
            field: "guided_choice".into(),
        });
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::invalid(
            found[1].field.clone(),
            format!(
                "`{}` and `{}` both constrain the output: give one",
                found[0].field, found[1].field
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn req(v: Value) -> CompletionRequest {
        serde_json::from_value(v).unwrap()
    }

    fn param(e: ApiError) -> String {
        match e {
            ApiError::InvalidRequest { param, .. } => param.unwrap_or_default(),
            other => panic!("not a 400: {other:?}"),
        }
    }

    #[test]
    fn every_way_of_asking_reads_into_a_constraint() {
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(Constraint::JsonObject),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}}}),
                Some(Constraint::JsonSchema {
                    schema: json!({"type": "object"}),
                }),
            ),
            (
                json!({"structured_outputs": {"regex": "a+"}}),
                Some(Constraint::Regex {
                    pattern: "a+".into(),
                }),
            ),
            (
                json!({"structured_outputs": {"choice": ["a", "b"]}}),
                Some(Constraint::Choice {
                    choices: vec!["a".into(), "b".into()],
                }),
            ),
            (
                json!({"structured_outputs": {"json": "{\"type\": \"integer\"}"}}),
                Some(Constraint::JsonSchema {
                    schema: json!({"type": "integer"}),
                }),
            ),
            (
                json!({"guided_grammar": "start: \"x\""}),
                Some(Constraint::Lark {
                    grammar: "start: \"x\"".into(),
                }),
            ),
        ];
        for (body, want) in cases {
            let got = requested(&req(body.clone())).unwrap().map(|r| r.constraint);
            assert_eq!(got, want, "{body}");
        }
    }

    #[test]
    fn bad_requests_name_the_field() {
        let cases = [
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": 4}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"xml": "a"}}),
                "structured_outputs.xml",
            ),
            (
                json!({"structured_outputs": {"choice": []}}),
                "structured_outputs.choice",
            ),
            (
                json!({"guided_regex": "a", "response_format": {"type": "json_object"}}),
                "guided_regex",
            ),
        ];
        for (body, field) in cases {
            assert_eq!(
                param(requested(&req(body.clone())).unwrap_err()),
                field,
                "{body}"
            );
        }
    }
}
