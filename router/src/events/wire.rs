//! The vLLM KV-event wire format (also SGLang's): ZMQ frames and their msgpack payload.
//!
//! One published message is three frames, `[topic, seq, payload]`: `seq` is the batch's
//! sequence number as 8 bytes big-endian (0, 1, 2, … per publisher), `payload` one msgpack
//! batch. vLLM encodes its `msgspec` structs in one of two shapes, depending on the release,
//! and both are accepted here, per value:
//!
//! - array-like (vLLM up to 0.11, SGLang): batch `[ts, events, dp_rank?]`, each event a
//!   positional array with its tag first, e.g. `["BlockStored", block_hashes,
//!   parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
//!   group_idx, …]` (older releases stop after `lora_id`; newer ones may append fields, which
//!   are ignored);
//! - map (current vLLM): batch `{"ts", "events", "data_parallel_rank"}`, each event a map whose
//!   `"type"` names it; fields at their default are omitted.
//!
//! Block hashes are integers (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, SGLang; signed or
//! unsigned) or byte strings (sha256 digests); they are opaque ids ([`EngineHash`]).
//! Unknown event tags decode to [`EngineEvent::Unknown`] so a newer engine's extra event
//! kinds do not stop the stream.

use rmpv::Value;

/// Deepest msgpack nesting accepted (a batch of events with extra keys needs about 6).
const MAX_DEPTH: usize = 16;

/// A payload, or a message, that is not a vLLM KV-event batch.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The message does not have the three frames `[topic, seq, payload]`.
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    Frames(usize),
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame is {0} bytes, expected 8")]
    SeqLen(usize),
    /// The payload is not msgpack.
    #[error("payload is not msgpack")]
    Msgpack(#[source] rmpv::decode::Error),
    /// Bytes follow the batch.
    #[error("{0} bytes after the batch")]
    Trailing(usize),
    /// The msgpack does not have the shape of a batch or an event.
    #[error("{what}: {found}")]
    Shape {
        /// What was expected where.
        what: String,
        /// What was found instead (a short rendering).
        found: String,
    },
}

/// An engine's block hash: opaque, compared for equality only.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EngineHash {
    /// An integer hash (a negative one is kept by its two's-complement bits).
    Int(u64),
    /// A byte-string hash (e.g. a sha256 digest).
    Bytes(Box<[u8]>),
}

/// One batch of events, as published under one sequence number.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// The publisher's timestamp (seconds since the epoch).
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank that published it, when given.
    pub dp_rank: Option<i64>,
}

/// Blocks an engine stored in its prefix cache: a chain of full blocks after `parent`.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BlockStored {
    /// The hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// The block the first one extends (`None`: the chain starts at the root).
    pub parent: Option<EngineHash>,
    /// The tokens of all the blocks (`block_size` per block).
    pub token_ids: Vec<u32>,
    /// Tokens per block.
    pub block_size: usize,
    /// The LoRA adapter id, if any.
    pub lora_id: Option<i64>,
    /// Where the blocks live (`"GPU"`, `"CPU"`, …), if said.
    pub medium: Option<String>,
    /// The LoRA adapter name, if any.
    pub lora_name: Option<String>,
    /// Per block, whether it has extra hash keys (multimodal inputs, cache salt, …); empty when
    /// the event carries none.
    pub extra_keys: Vec<bool>,
    /// The KV cache group (hybrid models have several), if said.
    pub group_idx: Option<i64>,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Blocks were stored.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved {
        /// Their hashes.
        block_hashes: Vec<EngineHash>,
        /// Where they lived, if said.
        medium: Option<String>,
        /// Their KV cache group, if said.
        group_idx: Option<i64>,
    },
    /// The whole cache was reset.
    AllBlocksCleared,
    /// An event kind this router does not know (its tag).
    Unknown(String),
}

/// A decoded ZMQ message: topic, sequence number, batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Message {
    /// The topic frame.
    pub topic: Vec<u8>,
    /// The batch's sequence number.
    pub seq: u64,
    /// The batch.
    pub batch: Batch,
}

/// Decodes the 8-byte big-endian sequence frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, WireError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| WireError::SeqLen(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decodes a published message's frames `[topic, seq, payload]`.
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<Message, WireError> {
    let [topic, seq, payload] = frames else {
        return Err(WireError::Frames(frames.len()));
    };
    Ok(Message {
        topic: topic.as_ref().to_vec(),
        seq: decode_seq(seq.as_ref())?,
        batch: decode_batch(payload.as_ref())?,
    })
}

/// Decodes one msgpack batch payload.
pub fn decode_batch(payload: &[u8]) -> Result<Batch, WireError> {
    let mut rd = payload;
    let value =
        rmpv::decode::read_value_with_max_depth(&mut rd, MAX_DEPTH).map_err(WireError::Msgpack)?;
    if !rd.is_empty() {
        return Err(WireError::Trailing(rd.len()));
    }
    batch(&value)
}

fn shape(what: impl Into<String>, found: &Value) -> WireError {
    let mut found = found.to_string();
    if found.len() > 80 {
        let mut cut = 80;
        while !found.is_char_boundary(cut) {
            cut -= 1;
        }
        found.truncate(cut);
        found.push('…');
    }
    WireError::Shape {
        what: what.into(),
        found,
    }
}

/// A struct's fields, positional (array-like) or by name (map).
enum Fields<'a> {
    Positional(&'a [Value]),
    Named(&'a [(Value, Value)]),
}

impl<'a> Fields<'a> {
    /// The field at `pos` (positional) or named `name`; `None` when absent (a default).
    fn get(&self, pos: usize, name: &str) -> Option<&'a Value> {
        match self {
            Fields::Positional(v) => v.get(pos),
            Fields::Named(m) => m
                .iter()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| v),
        }
    }

    fn required(&self, pos: usize, name: &str, of: &str) -> Result<&'a Value, WireError> {
        self.get(pos, name)
            .ok_or_else(|| shape(format!("{of} without {name}"), &Value::Nil))
    }
}

fn batch(v: &Value) -> Result<Batch, WireError> {
    let fields = match v {
        Value::Array(a) => Fields::Positional(a),
        Value::Map(m) => Fields::Named(m),
        other => return Err(shape("batch is neither an array nor a map", other)),
    };
    let ts_v = fields.required(0, "ts", "batch")?;
    let ts = number(ts_v).ok_or_else(|| shape("batch ts is not a number", ts_v))?;
    let events_v = fields.required(1, "events", "batch")?;
    let events = events_v
        .as_array()
        .ok_or_else(|| shape("batch events is not an array", events_v))?
        .iter()
        .map(event)
        .collect::<Result<_, _>>()?;
    // vLLM names it `data_parallel_rank`, SGLang `attn_dp_rank`.
    let dp = fields
        .get(2, "data_parallel_rank")
        .or_else(|| fields.get(2, "attn_dp_rank"));
    let dp_rank = opt_int(dp, "batch data_parallel_rank")?;
    Ok(Batch {
        ts,
        events,
        dp_rank,
    })
}

fn event(v: &Value) -> Result<EngineEvent, WireError> {
    let (tag, fields) = match v {
        // Array-like tagged struct: the tag, then the fields in declaration order.
        Value::Array(a) => {
            let tag = a
                .first()
                .and_then(Value::as_str)
                .ok_or_else(|| shape("event array does not start with its tag", v))?;
            (tag, Fields::Positional(&a[1..]))
        }
        Value::Map(m) => {
            let tag = m
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, t)| t.as_str())
                .ok_or_else(|| shape("event map without a \"type\" tag", v))?;
            (tag, Fields::Named(m))
        }
        other => return Err(shape("event is neither an array nor a map", other)),
    };
    Ok(match tag {
        "BlockStored" => EngineEvent::BlockStored(block_stored(&fields)?),
        "BlockRemoved" => EngineEvent::BlockRemoved {
            block_hashes: hashes(fields.required(0, "block_hashes", "BlockRemoved")?)?,
            medium: opt_str(fields.get(1, "medium"), "BlockRemoved medium")?,
            group_idx: opt_int(fields.get(2, "group_idx"), "BlockRemoved group_idx")?,
        },
        "AllBlocksCleared" => EngineEvent::AllBlocksCleared,
        other => EngineEvent::Unknown(other.to_string()),
    })
}

fn block_stored(f: &Fields<'_>) -> Result<BlockStored, WireError> {
    const OF: &str = "BlockStored";
    let block_hashes = hashes(f.required(0, "block_hashes", OF)?)?;
    let parent = match f.get(1, "parent_block_hash") {
        None | Some(Value::Nil) => None,
        Some(h) => Some(hash(h)?),
    };
    let tokens_v = f.required(2, "token_ids", OF)?;
    let token_ids = tokens_v
        .as_array()
        .ok_or_else(|| shape("BlockStored token_ids is not an array", tokens_v))?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| shape("BlockStored token id is not a u32", t))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let size_v = f.required(3, "block_size", OF)?;
    let block_size = size_v
        .as_u64()
        .and_then(|s| usize::try_from(s).ok())
        .filter(|&s| s > 0)
        .ok_or_else(|| shape("BlockStored block_size is not a positive integer", size_v))?;
    if block_hashes.len().checked_mul(block_size) != Some(token_ids.len()) {
        return Err(WireError::Shape {
            what: format!(
                "BlockStored has {} tokens for {} blocks of {block_size}",
                token_ids.len(),
                block_hashes.len()
            ),
            found: String::from("token_ids"),
        });
    }
    let extra_keys = match f.get(7, "extra_keys") {
        None | Some(Value::Nil) => Vec::new(),
        Some(Value::Array(a)) => a.iter().map(|k| !k.is_nil()).collect(),
        Some(other) => return Err(shape("BlockStored extra_keys is not an array", other)),
    };
    Ok(BlockStored {
        block_hashes,
        parent,
        token_ids,
        block_size,
        lora_id: opt_int(f.get(4, "lora_id"), "BlockStored lora_id")?,
        medium: opt_str(f.get(5, "medium"), "BlockStored medium")?,
        lora_name: opt_str(f.get(6, "lora_name"), "BlockStored lora_name")?,
        extra_keys,
        group_idx: opt_int(f.get(8, "group_idx"), "BlockStored group_idx")?,
    })
}

fn hashes(v: &Value) -> Result<Vec<EngineHash>, WireError> {
    v.as_array()
        .ok_or_else(|| shape("block_hashes is not an array", v))?
        .iter()
        .map(hash)
        .collect()
}

fn hash(v: &Value) -> Result<EngineHash, WireError> {
    if let Some(u) = v.as_u64() {
        return Ok(EngineHash::Int(u));
    }
    if let Some(i) = v.as_i64() {
        return Ok(EngineHash::Int(i as u64));
    }
    match v {
        Value::Binary(b) => Ok(EngineHash::Bytes(b.clone().into_boxed_slice())),
        other => Err(shape("block hash is neither an integer nor bytes", other)),
    }
}

fn number(v: &Value) -> Option<f64> {
    match v {
        Value::F64(f) => Some(*f),
        Value::F32(f) => Some(f64::from(*f)),
        Value::Integer(i) => i.as_f64(),
        _ => None,
    }
}

fn opt_int(v: Option<&Value>, what: &str) -> Result<Option<i64>, WireError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| shape(format!("{what} is not an integer"), v)),
    }
}

fn opt_str(v: Option<&Value>, what: &str) -> Result<Option<String>, WireError> {
    match v {
        None | Some(Value::Nil) => Ok(None),
        Some(v) => v
            .as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| shape(format!("{what} is not a string"), v)),
    }
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
