//! The endpoint picker protocol on top of Envoy's ext_proc messages: the names the Gateway API
//! Inference Extension fixes (its proposal 004, "Endpoint Picker Protocol") and the
//! `ProcessingResponse`s the picker sends.
//!
//! - The picked endpoints go out twice with the same value: as the request header
//!   [`DESTINATION_HEADER`] and as dynamic metadata `{"envoy.lb": {DESTINATION_HEADER: value}}`
//!   ([`LB_NAMESPACE`]). The value is `ip:port` or a comma-separated list, primary first.
//! - The proxy may restrict the choice with filter metadata
//!   `{"envoy.lb.subset_hint": {"x-gateway-destination-endpoint-subset": [ip:port, ...]}}` in the
//!   request's `metadata_context` ([`subset_hint`]).
//! - No ready endpoint: an immediate 503; a shed request: an immediate 429.

use envoy_types::pb::envoy::config::core::v3::{
    header_value_option::HeaderAppendAction, HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation,
    HeadersResponse, ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The request header (and metadata key) naming the picked endpoints.
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace of the picked endpoints.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter metadata namespace of the proxy's subset hint.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the candidate endpoint list inside [`SUBSET_NAMESPACE`].
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The key (in [`LB_NAMESPACE`] of the response's `metadata_context`) of the endpoint that
/// actually served the request.
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";

/// `{namespace: {key: value}}` as a protobuf `Struct`.
fn nested(namespace: &str, key: &str, value: &str) -> Struct {
    let inner = Struct {
        fields: [(
            key.to_string(),
            Value {
                kind: Some(Kind::StringValue(value.to_string())),
            },
        )]
        .into(),
    };
    Struct {
        fields: [(
            namespace.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn set_header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..Default::default()
    }
}

/// The common part of a response that routes to `destination`: the header set, and the route
/// cache cleared so the route sees it.
fn routed(destination: &str) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: vec![set_header(DESTINATION_HEADER, destination)],
            remove_headers: Vec::new(),
        }),
        clear_route_cache: true,
        ..Default::default()
    }
}

/// The request-headers answer naming `destination` (`ip:port[,ip:port...]`) in the header and
/// in the `envoy.lb` dynamic metadata.
pub fn headers_routed(destination: &str) -> ProcessingResponse {
    ProcessingResponse {
        dynamic_metadata: Some(nested(LB_NAMESPACE, DESTINATION_HEADER, destination)),
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(routed(destination)),
            },
        )),
        ..Default::default()
    }
}

/// The answer to a buffered request body (BUFFERED mode, where the headers waited for it)
/// naming `destination` like [`headers_routed`].
pub fn body_routed(destination: &str) -> ProcessingResponse {
    ProcessingResponse {
        dynamic_metadata: Some(nested(LB_NAMESPACE, DESTINATION_HEADER, destination)),
        response: Some(processing_response::Response::RequestBody(BodyResponse {
            response: Some(routed(destination)),
        })),
        ..Default::default()
    }
}

/// Request headers passed on unchanged.
pub fn headers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(
            HeadersResponse {
                response: Some(CommonResponse::default()),
            },
        )),
        ..Default::default()
    }
}

/// Response headers passed on unchanged.
pub fn response_headers_continue() -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(
            HeadersResponse {
                response: Some(CommonResponse::default()),
            },
        )),
        ..Default::default()
    }
}

fn streamed(body: Vec<u8>, end_of_stream: bool) -> BodyResponse {
    BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(
                    StreamedBodyResponse {
                        body,
                        end_of_stream,
                    },
                )),
            }),
            ..Default::default()
        }),
    }
}

/// One request body chunk sent back in FULL_DUPLEX_STREAMED mode.
pub fn request_body_chunk(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::RequestBody(streamed(
            body,
            end_of_stream,
        ))),
        ..Default::default()
    }
}

/// One response body chunk sent back in FULL_DUPLEX_STREAMED mode.
pub fn response_body_chunk(body: Vec<u8>, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseBody(streamed(
            body,
            end_of_stream,
        ))),
        ..Default::default()
    }
}

/// A body message of a non-duplex mode passed on unchanged (`request`: the request's body,
/// else the response's).
pub fn body_continue(request: bool) -> ProcessingResponse {
    let body = BodyResponse {
        response: Some(CommonResponse::default()),
    };
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestBody(body)
        } else {
            processing_response::Response::ResponseBody(body)
        }),
        ..Default::default()
    }
}

/// Trailers passed on unchanged (`request`: the request's, else the response's).
pub fn trailers_continue(request: bool) -> ProcessingResponse {
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestTrailers(t)
        } else {
            processing_response::Response::ResponseTrailers(t)
        }),
        ..Default::default()
    }
}

/// A locally generated response with `status` and a JSON `body` (OpenAI's error shape).
pub fn immediate(status: u16, body: Vec<u8>) -> ProcessingResponse {
    let mut headers = vec![set_header("content-type", "application/json")];
    if status == 429 {
        headers.push(set_header("retry-after", "1"));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers: headers,
                    remove_headers: Vec::new(),
                }),
                body,
                grpc_status: None,
                details: format!("cleave endpoint picker: {status}"),
            },
        )),
        ..Default::default()
    }
}

/// The value of header `name` (lowercase) in `headers`: `raw_value` (what Envoy sends) or
/// `value`.
pub fn header(headers: Option<&HeaderMap>, name: &str) -> Option<String> {
    let h = headers?.headers.iter().find(|h| h.key == name)?;
    if h.raw_value.is_empty() {
        Some(h.value.clone())
    } else {
        Some(String::from_utf8_lossy(&h.raw_value).into_owned())
    }
}

/// The proxy's subset hint: `None` when the key is not set (pick from the whole pool);
/// `Some(list)` when it is (pick only from `list`; empty means none is eligible). A string
/// value is read as a comma-separated list.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let ns = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?;
    let value = ns.fields.get(SUBSET_KEY)?;
    let split = |s: &str| -> Vec<String> {
        s.split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .map(String::from)
            .collect()
    };
    Some(match &value.kind {
        Some(Kind::ListValue(list)) => list
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                _ => None,
            })
            .filter(|s| !s.is_empty())
            .collect(),
        Some(Kind::StringValue(s)) => split(s),
        _ => Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::google::protobuf::ListValue;

    use super::*;

    fn string(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn hint(value: Value) -> Metadata {
        Metadata {
            filter_metadata: [(
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET_KEY.to_string(), value)].into(),
                },
            )]
            .into(),
            ..Default::default()
        }
    }

    #[test]
    fn subset_hint_reads_lists_and_strings() {
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        let list = hint(Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string("10.0.0.1:8000"), string(" 10.0.0.2:8000 ")],
            })),
        });
        assert_eq!(
            subset_hint(Some(&list)),
            Some(vec!["10.0.0.1:8000".into(), "10.0.0.2:8000".into()])
        );
        let s = hint(string("10.0.0.3:8000, 10.0.0.4:8000"));
        assert_eq!(
            subset_hint(Some(&s)),
            Some(vec!["10.0.0.3:8000".into(), "10.0.0.4:8000".into()])
        );
        let empty = hint(Value {
            kind: Some(Kind::ListValue(ListValue::default())),
        });
        assert_eq!(subset_hint(Some(&empty)), Some(vec![]));
    }

    #[test]
    fn routed_headers_carry_the_same_value_twice() {
        let r = headers_routed("10.0.0.1:8000,10.0.0.2:8000");
        let Some(processing_response::Response::RequestHeaders(h)) = &r.response else {
            panic!("not a request headers response: {r:?}");
        };
        let common = h.response.as_ref().expect("common response");
        assert!(common.clear_route_cache);
        let set = &common
            .header_mutation
            .as_ref()
            .expect("mutation")
            .set_headers[0];
        let header = set.header.as_ref().expect("header");
        assert_eq!(header.key, DESTINATION_HEADER);
        assert_eq!(header.raw_value, b"10.0.0.1:8000,10.0.0.2:8000");
        let md = r.dynamic_metadata.as_ref().expect("metadata");
        let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else {
            panic!("no envoy.lb struct");
        };
        assert_eq!(
            lb.fields[DESTINATION_HEADER].kind,
            Some(Kind::StringValue("10.0.0.1:8000,10.0.0.2:8000".into()))
        );
    }

    #[test]
    fn header_prefers_raw_value() {
        let map = HeaderMap {
            headers: vec![
                HeaderValue {
                    key: ":path".into(),
                    value: String::new(),
                    raw_value: b"/v1/completions".to_vec(),
                },
                HeaderValue {
                    key: ":method".into(),
                    value: "POST".into(),
                    raw_value: Vec::new(),
                },
            ],
        };
        assert_eq!(
            header(Some(&map), ":path").as_deref(),
            Some("/v1/completions")
        );
        assert_eq!(header(Some(&map), ":method").as_deref(), Some("POST"));
        assert_eq!(header(Some(&map), "x-missing"), None);
    }
}
