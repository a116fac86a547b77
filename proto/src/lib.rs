//! cleave's control-plane API, generated from `proto/cleave/v1/worker.proto` (the documented
//! contract): the decode worker's `Generate`/`Watch`, the prefill worker's `Prefill`/`Watch`.

#![forbid(unsafe_code)]
#![allow(missing_docs, clippy::all)]

/// Package `cleave.v1`.
pub mod v1 {
    tonic::include_proto!("cleave.v1");
}

/// Between the wire's sampling parameters and the engine's, in both directions.
pub mod convert {
    use cleave_text::constrain::Constraint;
    use cleave_text::sample::SamplingParams;
    use cleave_types::FinishReason;

    use crate::v1 as pb;

    /// The engine's sampling parameters from the wire (`top_p` 0 means unset); validation is
    /// the caller's (`SamplingParams::validate`). Fails only on a JSON schema that is not JSON.
    pub fn sampling_from_wire(p: pb::SamplingParams) -> Result<SamplingParams, WireError> {
        let constraint = p.constraint.map(constraint_from_wire).transpose()?;
        Ok(SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
            seed: p.seed,
            max_tokens: p.max_tokens as usize,
            stop: p.stop,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs.map(|n| n as usize),
            constraint,
        })
    }

    fn constraint_from_wire(c: pb::Constraint) -> Result<Constraint, WireError> {
        use pb::constraint::Kind;
        Ok(match c.kind {
            None => return Err(WireError::ConstraintKind),
            Some(Kind::JsonObject(_)) => Constraint::JsonObject,
            Some(Kind::JsonSchema(s)) => Constraint::JsonSchema {
                schema: serde_json::from_str(&s).map_err(WireError::SchemaNotJson)?,
            },
            Some(Kind::Regex(pattern)) => Constraint::Regex { pattern },
            Some(Kind::Lark(grammar)) => Constraint::Lark { grammar },
            Some(Kind::Choice(c)) => Constraint::Choice { choices: c.choices },
        })
    }

    /// A wire message the engine's types cannot hold.
    #[derive(Debug, thiserror::Error)]
    pub enum WireError {
        /// A `Constraint` with none of its `kind` set.
        #[error("constraint: no kind is set")]
        ConstraintKind,
        /// `constraint.json_schema` that does not parse.
        #[error("constraint.json_schema is not JSON: {0}")]
        SchemaNotJson(#[source] serde_json::Error),
    }

    fn constraint_to_wire(c: &Constraint) -> pb::Constraint {
        use pb::constraint::Kind;
        let kind = match c {
            Constraint::JsonObject => Kind::JsonObject(true),
            Constraint::JsonSchema { schema } => Kind::JsonSchema(schema.to_string()),
            Constraint::Regex { pattern } => Kind::Regex(pattern.clone()),
            Constraint::Lark { grammar } => Kind::Lark(grammar.clone()),
            Constraint::Choice { choices } => Kind::Choice(pb::constraint::Choices {
                choices: choices.clone(),
            }),
        };
        pb::Constraint { kind: Some(kind) }
    }

    /// The wire form of the engine's sampling parameters.
    pub fn sampling_to_wire(p: &SamplingParams) -> pb::SamplingParams {
        pb::SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as u32,
            top_p: p.top_p,
            seed: p.seed,
            max_tokens: p.max_tokens as u32,
            stop: p.stop.clone(),
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs.map(|n| n as u32),
            constraint: p.constraint.as_ref().map(constraint_to_wire),
        }
    }

    /// The wire form of a finish reason.
    pub fn finish_to_wire(r: FinishReason) -> pb::FinishReason {
        match r {
            FinishReason::Stop => pb::FinishReason::Stop,
            FinishReason::Length => pb::FinishReason::Length,
            FinishReason::Cancelled => pb::FinishReason::Cancelled,
            FinishReason::Aborted => pb::FinishReason::Aborted,
        }
    }

    /// A finish reason from the wire; an unset one (or one this build does not know, which
    /// prost reads as unset) counts as aborted: the worker did not say the request succeeded.
    pub fn finish_from_wire(r: pb::FinishReason) -> FinishReason {
        match r {
            pb::FinishReason::Stop => FinishReason::Stop,
            pb::FinishReason::Length => FinishReason::Length,
            pb::FinishReason::Cancelled => FinishReason::Cancelled,
            pb::FinishReason::Aborted | pb::FinishReason::Unspecified => FinishReason::Aborted,
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn finish_reasons_round_trip_and_unset_is_aborted() {
            for r in FinishReason::ALL {
                assert_eq!(finish_from_wire(finish_to_wire(r)), r);
            }
            assert_eq!(
                finish_from_wire(pb::Finished::default().reason()),
                FinishReason::Aborted
            );
            let unknown = pb::Finished {
                reason: 99,
                ..Default::default()
            };
            assert_eq!(finish_from_wire(unknown.reason()), FinishReason::Aborted);
        }

        #[test]
        fn round_trip() {
            let p = SamplingParams {
                temperature: 0.7,
                top_k: 40,
                top_p: 0.9,
                seed: Some(3),
                max_tokens: 12,
                stop: vec!["x".into()],
                stop_token_ids: vec![2],
                ignore_eos: true,
                logprobs: Some(2),
                constraint: None,
            };
            assert_eq!(sampling_from_wire(sampling_to_wire(&p)).unwrap(), p);
            assert_eq!(
                sampling_from_wire(pb::SamplingParams::default())
                    .unwrap()
                    .top_p,
                1.0
            );
            let constraints = [
                Constraint::JsonObject,
                Constraint::JsonSchema {
                    schema: serde_json::json!({"type": "object", "required": ["a"]}),
                },
                Constraint::Regex {
                    pattern: "[0-9]+".into(),
                },
                Constraint::Lark {
                    grammar: "start: \"x\"".into(),
                },
                Constraint::Choice {
                    choices: vec!["yes".into(), "no".into()],
                },
            ];
            for c in constraints {
                let q = SamplingParams {
                    constraint: Some(c),
                    ..p.clone()
                };
                assert_eq!(sampling_from_wire(sampling_to_wire(&q)).unwrap(), q);
            }
        }

        #[test]
        fn a_schema_that_is_not_json_is_refused_by_name() {
            let p = pb::SamplingParams {
                constraint: Some(pb::Constraint {
                    kind: Some(pb::constraint::Kind::JsonSchema("{not json".into())),
                }),
                ..Default::default()
            };
            let e = sampling_from_wire(p).unwrap_err();
            assert!(matches!(e, WireError::SchemaNotJson(_)), "{e}");
            assert!(e.to_string().starts_with("constraint.json_schema "), "{e}");
        }
    }
}
