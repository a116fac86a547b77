//! Decoding the golden payloads that `msgspec` wrote (router/tests/data/vllm-kv-events/gen.py),
//! and building the same bytes by hand to pin the encodings down byte for byte.

use rmpv::Value;

use super::*;

const ARRAY_0: &[u8] = include_bytes!("../../tests/data/vllm-kv-events/array-0.msgpack");
const ARRAY_1: &[u8] = include_bytes!("../../tests/data/vllm-kv-events/array-1.msgpack");
const ARRAY_2: &[u8] = include_bytes!("../../tests/data/vllm-kv-events/array-2.msgpack");
const MAP_0: &[u8] = include_bytes!("../../tests/data/vllm-kv-events/map-0.msgpack");
const MAP_1: &[u8] = include_bytes!("../../tests/data/vllm-kv-events/map-1.msgpack");

fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encode");
    out
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn tokens(start: u32, n: u32) -> Vec<u32> {
    (start..start + n).collect()
}

fn int_list(xs: impl IntoIterator<Item = u64>) -> Value {
    Value::Array(xs.into_iter().map(Value::from).collect())
}

fn map(kv: Vec<(&str, Value)>) -> Value {
    Value::Map(kv.into_iter().map(|(k, v)| (s(k), v)).collect())
}

/// What msgspec writes for vLLM's array-like `BlockStored` (every field, defaults included).
fn array_stored(hashes: Value, parent: Value, toks: &[u32], group_idx: Value) -> Value {
    Value::Array(vec![
        s("BlockStored"),
        hashes,
        parent,
        int_list(toks.iter().map(|&t| u64::from(t))),
        Value::from(16),
        Value::Nil,
        s("GPU"),
        Value::Nil,
        Value::Nil,
        group_idx,
    ])
}

fn bin(b: &[u8]) -> Value {
    Value::Binary(b.to_vec())
}

fn h0() -> Vec<u8> {
    (0u8..32).collect()
}

fn h1() -> Vec<u8> {
    (1u8..33).collect()
}

#[test]
fn array_like_payloads_are_byte_exact_and_decode() {
    let big = (1u64 << 63) + 12;
    let built0 = Value::Array(vec![
        Value::F64(1700000000.5),
        Value::Array(vec![array_stored(
            int_list([11, big]),
            Value::Nil,
            &tokens(100, 32),
            Value::Nil,
        )]),
        Value::from(0),
    ]);
    assert_eq!(encode(&built0), ARRAY_0);
    let built1 = Value::Array(vec![
        Value::F64(1700000001.25),
        Value::Array(vec![
            array_stored(int_list([13]), Value::from(big), &tokens(132, 16), 0.into()),
            Value::Array(vec![
                s("BlockRemoved"),
                int_list([13]),
                s("GPU"),
                Value::Nil,
            ]),
        ]),
        Value::from(0),
    ]);
    assert_eq!(encode(&built1), ARRAY_1);
    let built2 = Value::Array(vec![
        Value::F64(1700000002.0),
        Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
        Value::from(0),
    ]);
    assert_eq!(encode(&built2), ARRAY_2);

    let b0 = decode_batch(ARRAY_0).unwrap();
    assert_eq!(b0.ts, 1700000000.5);
    assert_eq!(b0.dp_rank, Some(0));
    assert_eq!(
        b0.events,
        vec![EngineEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash::Int(11), EngineHash::Int(big)],
            parent: None,
            token_ids: tokens(100, 32),
            block_size: 16,
            medium: Some("GPU".into()),
            ..Default::default()
        })]
    );
    let b1 = decode_batch(ARRAY_1).unwrap();
    let EngineEvent::BlockStored(stored) = &b1.events[0] else {
        panic!("not stored: {:?}", b1.events[0]);
    };
    assert_eq!(stored.parent, Some(EngineHash::Int(big)));
    assert_eq!(stored.group_idx, Some(0));
    assert_eq!(
        b1.events[1],
        EngineEvent::BlockRemoved {
            block_hashes: vec![EngineHash::Int(13)],
            medium: Some("GPU".into()),
            group_idx: None,
        }
    );
    assert_eq!(
        decode_batch(ARRAY_2).unwrap().events,
        vec![EngineEvent::AllBlocksCleared]
    );
}

#[test]
fn map_payloads_are_byte_exact_and_decode() {
    let stored = |hash: Vec<u8>,
                  parent: Value,
                  toks: &[u32],
                  medium: Value,
                  rest: Vec<(&'static str, Value)>| {
        let mut kv = vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![bin(&hash)])),
            ("parent_block_hash", parent),
            ("token_ids", int_list(toks.iter().map(|&t| u64::from(t)))),
            ("block_size", Value::from(16)),
            ("lora_id", Value::Nil),
            ("medium", medium),
            ("lora_name", Value::Nil),
        ];
        kv.extend(rest);
        map(kv)
    };
    let built0 = map(vec![
        ("ts", Value::F64(1700000003.5)),
        (
            "events",
            Value::Array(vec![
                stored(h0(), Value::Nil, &tokens(100, 16), s("GPU"), vec![]),
                stored(
                    h1(),
                    bin(&h0()),
                    &tokens(116, 16),
                    Value::Nil,
                    vec![
                        ("group_idx", Value::from(0)),
                        ("kv_cache_spec_kind", s("full_attention")),
                    ],
                ),
            ]),
        ),
        ("data_parallel_rank", Value::from(0)),
    ]);
    assert_eq!(encode(&built0), MAP_0);
    let built1 = map(vec![
        ("ts", Value::F64(1700000004.0)),
        (
            "events",
            Value::Array(vec![
                map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", Value::Array(vec![bin(&h1())])),
                    ("medium", Value::Nil),
                ]),
                map(vec![("type", s("AllBlocksCleared"))]),
            ]),
        ),
        ("data_parallel_rank", Value::from(0)),
    ]);
    assert_eq!(encode(&built1), MAP_1);

    let b0 = decode_batch(MAP_0).unwrap();
    assert_eq!(b0.ts, 1700000003.5);
    let EngineEvent::BlockStored(second) = &b0.events[1] else {
        panic!("not stored: {:?}", b0.events[1]);
    };
    assert_eq!(second.block_hashes, vec![EngineHash::Bytes(h1().into())]);
    assert_eq!(second.parent, Some(EngineHash::Bytes(h0().into())));
    assert_eq!(second.token_ids, tokens(116, 16));
    assert_eq!(
        (second.medium.as_deref(), second.group_idx),
        (None, Some(0))
    );
    let b1 = decode_batch(MAP_1).unwrap();
    assert_eq!(
        b1.events,
        vec![
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash::Bytes(h1().into())],
                medium: None,
                group_idx: None,
            },
            EngineEvent::AllBlocksCleared
        ]
    );
}

#[test]
fn older_and_sglang_shapes_decode() {
    // vLLM 0.9 / SGLang: no medium and later fields, BlockRemoved with hashes only, no dp
    // rank, negative (signed) hashes.
    let batch = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![
            Value::Array(vec![
                s("BlockStored"),
                Value::Array(vec![Value::from(-5i64)]),
                Value::from(-6i64),
                int_list([1, 2]),
                Value::from(2),
                Value::Nil,
            ]),
            Value::Array(vec![
                s("BlockRemoved"),
                Value::Array(vec![Value::from(-5i64)]),
            ]),
            Value::Array(vec![s("SomethingNew"), Value::from(1)]),
        ]),
    ]);
    let b = decode_batch(&encode(&batch)).unwrap();
    assert_eq!(b.dp_rank, None);
    let EngineEvent::BlockStored(st) = &b.events[0] else {
        panic!("{:?}", b.events[0]);
    };
    assert_eq!(st.block_hashes, vec![EngineHash::Int((-5i64) as u64)]);
    assert_eq!(st.parent, Some(EngineHash::Int((-6i64) as u64)));
    assert_eq!(st.medium, None);
    assert!(matches!(
        &b.events[1],
        EngineEvent::BlockRemoved { medium: None, .. }
    ));
    assert_eq!(b.events[2], EngineEvent::Unknown("SomethingNew".into()));
}

#[test]
fn bad_input_is_a_clear_error() {
    assert!(matches!(
        decode_batch(&[0x92, 0x01]),
        Err(WireError::Msgpack(_))
    ));
    let mut trailing = ARRAY_2.to_vec();
    trailing.push(0);
    assert!(matches!(
        decode_batch(&trailing),
        Err(WireError::Trailing(1))
    ));
    let not_batch = encode(&Value::from(3));
    assert!(decode_batch(&not_batch)
        .unwrap_err()
        .to_string()
        .contains("neither an array nor a map"));
    let short = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Array(vec![
            s("BlockStored"),
            int_list([1, 2]),
            Value::Nil,
            int_list([1, 2, 3]),
            Value::from(2),
        ])]),
    ]);
    let e = decode_batch(&encode(&short)).unwrap_err().to_string();
    assert!(e.contains("3 tokens for 2 blocks of 2"), "{e}");
    let bad_hash = Value::Array(vec![
        Value::F64(1.0),
        Value::Array(vec![Value::Array(vec![
            s("BlockRemoved"),
            Value::Array(vec![s("x")]),
        ])]),
    ]);
    assert!(decode_batch(&encode(&bad_hash))
        .unwrap_err()
        .to_string()
        .contains("neither an integer nor bytes"));
    let untagged = map(vec![
        ("ts", Value::F64(1.0)),
        ("events", Value::Array(vec![map(vec![])])),
    ]);
    assert!(decode_batch(&encode(&untagged))
        .unwrap_err()
        .to_string()
        .contains("\"type\""));
    assert!(matches!(
        decode_message(&[b"".as_slice(), b"x"]),
        Err(WireError::Frames(2))
    ));
    assert!(matches!(
        decode_message(&[b"".as_slice(), b"1234", ARRAY_2]),
        Err(WireError::SeqLen(4))
    ));
    let m = decode_message(&[b"kv".as_slice(), &7u64.to_be_bytes(), ARRAY_2]).unwrap();
    assert_eq!((m.topic.as_slice(), m.seq), (b"kv".as_slice(), 7));
}
