//! Bounds-checked parsing of the GGUF header: magic, version, metadata and tensor descriptors.
//!
//! Counts read from the file are never trusted for allocation: each is checked against the
//! smallest number of bytes its items could occupy in what remains of the input.

use std::collections::BTreeMap;

use super::{GgmlType, GgufError, MetaValue, TensorInfo};

/// How deeply metadata arrays may nest (GGUF writers produce at most 2).
const MAX_DEPTH: usize = 8;
/// ggml's limit on tensor dimensions.
const MAX_DIMS: u32 = 4;
/// Alignment of the data section when `general.alignment` is absent.
const DEFAULT_ALIGNMENT: u64 = 32;

/// The parsed header of a GGUF file.
pub(super) struct Header {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    /// Start of the data section, in bytes from the start of the file.
    pub data_offset: usize,
}

/// A position in the input.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).ok_or_else(|| truncated(what))?;
        let s = self.buf.get(self.pos..end).ok_or_else(|| truncated(what))?;
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items that each take at least `min_item` bytes; errors when they cannot fit.
    fn count(&mut self, min_item: usize, what: &str) -> Result<usize, GgufError> {
        let n = self.u64(what)?;
        let n = usize::try_from(n).map_err(|_| truncated(what))?;
        if n.saturating_mul(min_item.max(1)) > self.remaining() {
            return Err(truncated(what));
        }
        Ok(n)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.count(1, what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidString)
    }

    fn value(&mut self, ty: u32, depth: usize, what: &str) -> Result<MetaValue, GgufError> {
        Ok(match ty {
            0 => MetaValue::U8(u8::from_le_bytes(self.array(what)?)),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(u32::from_le_bytes(self.array(what)?)),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => {
                let [b] = self.array(what)?;
                MetaValue::Bool(b != 0)
            }
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(GgufError::NestingTooDeep);
                }
                let elem_ty = self.u32(what)?;
                let n = self.count(min_size(elem_ty)?, what)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1, what)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(u64::from_le_bytes(self.array(what)?)),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(GgufError::BadValueType(other)),
        })
    }
}

fn truncated(what: &str) -> GgufError {
    GgufError::Truncated {
        what: what.to_string(),
    }
}

/// The fewest bytes a value of type `ty` can occupy.
fn min_size(ty: u32) -> Result<usize, GgufError> {
    Ok(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,
        9 => 12,
        10..=12 => 8,
        other => return Err(GgufError::BadValueType(other)),
    })
}

/// Parses everything up to the start of the data section.
pub(super) fn parse_header(buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, "magic").map_err(|_| GgufError::BadMagic)?;
    if magic != b"GGUF" {
        return Err(GgufError::BadMagic);
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    // A tensor descriptor takes at least 8 (name) + 4 (n_dims) + 4 (type) + 8 (offset) bytes;
    // a key/value pair at least 8 (key) + 4 (type) + 1 (value).
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.count(13, "metadata count")?;

    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.u32("metadata value type")?;
        let value = c.value(ty, 0, &key)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }

    let n_tensors = usize::try_from(n_tensors).map_err(|_| truncated("tensor count"))?;
    if n_tensors.saturating_mul(24) > c.remaining() {
        return Err(truncated("tensor count"));
    }
    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let n_dims = c.u32(&name)?;
        if n_dims > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        let ty = GgmlType::from_id(c.u32(&name)?);
        let offset = c.u64(&name)?;
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
        });
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v.as_u64().ok_or_else(|| GgufError::WrongType {
            key: "general.alignment".to_string(),
            expected: "an unsigned integer",
        })?,
    };
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment(alignment));
    }
    let align = usize::try_from(alignment).map_err(|_| GgufError::BadAlignment(alignment))?;
    let data_offset = c
        .pos
        .checked_next_multiple_of(align)
        .ok_or(GgufError::BadAlignment(alignment))?;

    Ok(Header {
        version,
        metadata,
        tensors,
        data_offset,
    })
}
