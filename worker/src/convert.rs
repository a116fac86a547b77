//! Between the gRPC messages and the engine's types, in one place.

use cleave_engine::engine::{SeqEvent, Usage};
use cleave_proto::v1 as pb;
use cleave_text::sample::{SamplingParams, TokenLogprob};
use tonic::Status;

pub mod kv;

/// The engine's sampling parameters from the wire; `InvalidArgument` names a bad field.
// tonic's `Status` is every handler's error type; boxing it here would only be unboxed again.
#[allow(clippy::result_large_err)]
pub fn sampling(p: Option<pb::SamplingParams>) -> Result<SamplingParams, Status> {
    let p = p.ok_or_else(|| invalid_argument("params is required"))?;
    let params = cleave_proto::convert::sampling_from_wire(p).map_err(invalid_argument)?;
    params.validate().map_err(invalid_argument)?;
    Ok(params)
}

/// An `INVALID_ARGUMENT` status whose message may quote the caller's input. tonic sends the
/// message as `grpc-message` percent-encoding control characters and spaces but not `%` itself,
/// while the receiving side percent-decodes it: a quoted `%e2` would arrive as a lone byte that is
/// not UTF-8 and the client would get `UNKNOWN` instead of the message (found by `cleave fuzz
/// --target grpc`). Writing `%` as `%25` makes the decoded message the original text.
pub fn invalid_argument(message: impl std::fmt::Display) -> Status {
    Status::invalid_argument(message.to_string().replace('%', "%25"))
}

/// The gRPC status of a refused submission: the caller's mistakes are `INVALID_ARGUMENT`; an
/// engine that stopped (or whose group failed) is `UNAVAILABLE`, so the router places the
/// request elsewhere.
pub fn submit_error(e: cleave_engine::engine::EngineError) -> Status {
    use cleave_engine::engine::EngineError;
    match e {
        EngineError::Stopped | EngineError::GroupFailed => Status::unavailable(e.to_string()),
        _ => invalid_argument(e),
    }
}

/// `(logprob, top)` of a token, for the wire.
pub fn logprob(lp: Option<TokenLogprob>) -> (Option<f32>, Vec<pb::TopLogprob>) {
    match lp {
        None => (None, Vec::new()),
        Some(lp) => (
            Some(lp.logprob),
            lp.top
                .into_iter()
                .map(|(token, logprob)| pb::TopLogprob { token, logprob })
                .collect(),
        ),
    }
}

/// A streamed token or the end, for the decode worker's `Generate` stream (`None` for events
/// that stay inside the worker).
pub fn generate_event(
    ev: SeqEvent,
    disaggregated: bool,
    ttft: Option<pb::TtftBreakdown>,
) -> Option<pb::GenerateEvent> {
    use pb::generate_event::Event;
    let event = match ev {
        SeqEvent::Token {
            id,
            text,
            logprob: lp,
        } => {
            let (logprob, top) = logprob(lp);
            Event::Token(pb::Token {
                id,
                text,
                logprob,
                top,
            })
        }
        SeqEvent::Done {
            reason: r,
            usage:
                Usage {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                },
            text,
        } => Event::Finished(pb::Finished {
            reason: cleave_proto::convert::finish_to_wire(r).into(),
            prompt_tokens: prompt_tokens as u32,
            completion_tokens: completion_tokens as u32,
            cached_tokens: cached_tokens as u32,
            text,
            disaggregated,
            ttft,
        }),
        _ => return None,
    };
    Some(pb::GenerateEvent { event: Some(event) })
}

/// The W3C `traceparent` of a call, if it carries one.
pub fn traceparent(meta: &tonic::metadata::MetadataMap) -> Option<String> {
    meta.get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

/// The trace id part of a `traceparent` (empty when absent), for log spans.
pub fn trace_id(traceparent: Option<&str>) -> &str {
    traceparent.and_then(|t| t.split('-').nth(1)).unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a client reads back from the status's trailers.
    fn round_trip(s: &Status) -> Status {
        let mut headers = tonic::metadata::MetadataMap::new().into_headers();
        s.add_header(&mut headers).expect("encodes");
        Status::from_header_map(&headers).expect("a status")
    }

    #[test]
    fn a_quoted_percent_reaches_the_client_as_written() {
        let text = "destination.worker_address.tcp: \"1%e2%82:9\" is not an ip:port address";
        let back = round_trip(&invalid_argument(text));
        assert_eq!(back.code(), tonic::Code::InvalidArgument);
        assert_eq!(back.message(), text);
        // tonic alone: the client cannot decode the message (this is what the helper is for).
        assert_ne!(round_trip(&Status::invalid_argument(text)).message(), text);
    }
}
