//! Reader for GGUF model files (versions 2 and 3).
//!
//! A GGUF file is a little-endian header (magic, version, counts), a list of typed metadata
//! key/value pairs, a list of tensor descriptors, and an aligned data section holding the tensor
//! bytes. [`GgufFile::open`] memory-maps the file and parses the header; tensor bytes are handed
//! out as slices of the mapping, never copied.
//!
//! Every read is bounds-checked against the bytes that remain, so a truncated or corrupt file
//! yields a [`GgufError`] rather than a panic, and element counts are capped by the remaining
//! bytes before anything is allocated.

mod parse;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// Errors from reading a GGUF file or looking things up in it.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be opened, inspected or mapped.
    #[error("cannot read the file")]
    Io(#[from] std::io::Error),
    /// The first four bytes are not `GGUF`.
    #[error("not a gguf file (bad magic)")]
    BadMagic,
    /// The header names a GGUF version this reader does not handle (only 2 and 3 are).
    #[error("unsupported gguf version {0}")]
    UnsupportedVersion(u32),
    /// The file ended (or a count claimed more than the remaining bytes) while reading `what`.
    #[error("file truncated while reading {what}")]
    Truncated {
        /// The item that was being read.
        what: String,
    },
    /// A string in the header is not valid UTF-8.
    #[error("invalid utf-8 in a gguf string")]
    InvalidString,
    /// A metadata value has a type id this reader does not know.
    #[error("bad metadata value type {0}")]
    BadValueType(u32),
    /// Metadata arrays nest deeper than this reader allows.
    #[error("metadata arrays nested too deeply")]
    NestingTooDeep,
    /// The same metadata key appears twice.
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    /// The same tensor name appears twice.
    #[error("duplicate tensor {0:?}")]
    DuplicateTensor(String),
    /// A tensor claims more dimensions than ggml supports.
    #[error("tensor {tensor:?} has {n_dims} dimensions (at most 4 are supported)")]
    TooManyDims {
        /// The tensor's name.
        tensor: String,
        /// The number of dimensions it claims.
        n_dims: u32,
    },
    /// `general.alignment` is zero or not a power of two.
    #[error("invalid alignment {0} (must be a nonzero power of two)")]
    BadAlignment(u64),
    /// A required metadata key is absent.
    #[error("missing metadata key {0:?}")]
    MissingKey(String),
    /// A metadata value does not have (or does not fit) the requested type.
    #[error("metadata key {key:?} is not {expected}")]
    WrongType {
        /// The key that was looked up.
        key: String,
        /// What the caller asked for.
        expected: &'static str,
    },
    /// No tensor has this name.
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    /// The tensor's type cannot be used for the requested operation.
    #[error("tensor {tensor:?} has unsupported type {ty}")]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// Its ggml type.
        ty: GgmlType,
    },
    /// The tensor's bytes do not lie inside the file, or its shape does not fit its type.
    #[error("tensor {0:?} lies outside the file or has an invalid shape")]
    TensorOutOfBounds(String),
    /// The tensor's row length is not a whole number of its type's blocks.
    #[error("tensor {tensor:?} of type {ty} has dims {dims:?}: rows of {block}-element blocks need dims[0] to be a multiple of {block}")]
    BadShape {
        /// The tensor's name.
        tensor: String,
        /// Its ggml type.
        ty: GgmlType,
        /// Its dimensions.
        dims: Vec<u64>,
        /// Elements per block of the type.
        block: usize,
    },
    /// The bytes a tensor's type and shape imply run into the next tensor's data.
    #[error("tensor {tensor:?} of type {ty} and dims {dims:?} needs {needs} bytes, but the next tensor starts {room} bytes after it")]
    TensorSize {
        /// The tensor's name.
        tensor: String,
        /// Its ggml type.
        ty: GgmlType,
        /// Its dimensions.
        dims: Vec<u64>,
        /// Bytes its type and shape imply.
        needs: u64,
        /// Bytes between its offset and the next tensor's.
        room: u64,
    },
}

/// A typed metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    /// GGUF type 0.
    U8(u8),
    /// GGUF type 1.
    I8(i8),
    /// GGUF type 2.
    U16(u16),
    /// GGUF type 3.
    I16(i16),
    /// GGUF type 4.
    U32(u32),
    /// GGUF type 5.
    I32(i32),
    /// GGUF type 10.
    U64(u64),
    /// GGUF type 11.
    I64(i64),
    /// GGUF type 6.
    F32(f32),
    /// GGUF type 12.
    F64(f64),
    /// GGUF type 7.
    Bool(bool),
    /// GGUF type 8.
    String(String),
    /// GGUF type 9 (elements all of one type).
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, for any integer variant whose value is non-negative.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, for any integer variant that fits in `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, for the `F32` and `F64` variants.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The value as a string slice, for the `String` variant.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, for the `Array` variant.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A ggml tensor element type (named as ggml names them).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float (id 0).
    F32,
    /// 16-bit IEEE float (id 1).
    F16,
    /// 4-bit blocks of 32 with an f16 scale (id 2).
    Q4_0,
    /// 4-bit blocks of 32 with an f16 scale and minimum (id 3).
    Q4_1,
    /// 5-bit blocks of 32 with an f16 scale (id 6).
    Q5_0,
    /// 5-bit blocks of 32 with an f16 scale and minimum (id 7).
    Q5_1,
    /// 8-bit blocks of 32 with an f16 scale (id 8).
    Q8_0,
    /// 2-bit super-blocks of 256 (id 10).
    Q2_K,
    /// 3-bit super-blocks of 256 (id 11).
    Q3_K,
    /// 4-bit super-blocks of 256 with 6-bit sub-block scales and minimums (id 12).
    Q4_K,
    /// 5-bit super-blocks of 256 with 6-bit sub-block scales and minimums (id 13).
    Q5_K,
    /// 6-bit super-blocks of 256 with 8-bit sub-block scales (id 14).
    Q6_K,
    /// 8-bit super-blocks of 256 with an f32 scale (id 15; activations in ggml).
    Q8_K,
    /// 4-bit non-linear blocks of 32 (id 20).
    IQ4_NL,
    /// bfloat16 (id 30).
    BF16,
    /// Any other ggml type id.
    Other(u32),
}

impl GgmlType {
    /// The type for a ggml type id.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2_K,
            11 => GgmlType::Q3_K,
            12 => GgmlType::Q4_K,
            13 => GgmlType::Q5_K,
            14 => GgmlType::Q6_K,
            15 => GgmlType::Q8_K,
            20 => GgmlType::IQ4_NL,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// The ggml type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::Q8_K => 15,
            GgmlType::IQ4_NL => 20,
            GgmlType::BF16 => 30,
            GgmlType::Other(id) => id,
        }
    }

    /// Elements per block (1 for float types); `None` for types this crate does not handle.
    pub fn block_size(self) -> Option<usize> {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Some(1),
            GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::Q8_0
            | GgmlType::IQ4_NL => Some(32),
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::Q8_K => Some(256),
            GgmlType::Other(_) => None,
        }
    }

    /// Bytes per block; `None` for types this crate does not handle.
    pub fn type_size(self) -> Option<usize> {
        match self {
            GgmlType::F32 => Some(4),
            GgmlType::F16 => Some(2),
            GgmlType::Q4_0 => Some(18),
            GgmlType::Q4_1 => Some(20),
            GgmlType::Q5_0 => Some(22),
            GgmlType::Q5_1 => Some(24),
            GgmlType::Q8_0 => Some(34),
            GgmlType::Q2_K => Some(84),
            GgmlType::Q3_K => Some(110),
            GgmlType::Q4_K => Some(144),
            GgmlType::Q5_K => Some(176),
            GgmlType::Q6_K => Some(210),
            GgmlType::Q8_K => Some(292),
            GgmlType::IQ4_NL => Some(18),
            GgmlType::BF16 => Some(2),
            GgmlType::Other(_) => None,
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [&str; 31] = [
            "f32", "f16", "q4_0", "q4_1", "q4_2", "q4_3", "q5_0", "q5_1", "q8_0", "q8_1", "q2_K",
            "q3_K", "q4_K", "q5_K", "q6_K", "q8_K", "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s",
            "iq4_nl", "iq3_s", "iq2_s", "iq4_xs", "i8", "i16", "i32", "i64", "f64", "iq1_m",
            "bf16",
        ];
        let id = self.id();
        match (NAMES.get(id as usize), id) {
            (Some(name), _) => f.write_str(name),
            (None, 34) => f.write_str("tq1_0"),
            (None, 35) => f.write_str("tq2_0"),
            (None, 39) => f.write_str("mxfp4"),
            (None, _) => write!(f, "type {id}"),
        }
    }
}

/// Descriptor of one tensor in the file.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Byte offset of the tensor relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements (product of the dimensions; saturates on overflow).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Number of bytes the tensor occupies; `None` for unknown types, shapes whose rows are not
    /// whole blocks, or sizes that overflow.
    pub fn n_bytes(&self) -> Option<u64> {
        let block = u64::try_from(self.ty.block_size()?).ok()?;
        let size = u64::try_from(self.ty.type_size()?).ok()?;
        let row = *self.dims.first().unwrap_or(&1);
        if row / block * block != row {
            return None;
        }
        let mut n: u64 = 1;
        for &d in &self.dims {
            n = n.checked_mul(d)?;
        }
        (n / block).checked_mul(size)
    }
}

/// Where the file's bytes live: a read-only memory map of the file, or bytes owned in memory;
/// shared, so that weights kept in the file's layout can borrow them beyond the parse
/// ([`GgufFile::tensor_shared`]).
struct Storage(ByteOwner);

impl Storage {
    fn bytes(&self) -> &[u8] {
        (*self.0).as_ref()
    }
}

/// A parsed GGUF file: metadata, tensor descriptors and access to the tensor bytes.
pub struct GgufFile {
    /// GGUF format version (2 or 3).
    pub version: u32,
    /// All metadata key/value pairs.
    pub metadata: BTreeMap<String, MetaValue>,
    /// Tensor descriptors in file order.
    pub tensors: Vec<TensorInfo>,
    storage: Storage,
    data_offset: usize,
    index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps the file at `path` and parses its header.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path)?;
        // SAFETY: the map is read-only and private to this struct. Modifying the file while it
        // is mapped is undefined behaviour; model files are treated as immutable, as every
        // mmap-based GGUF loader does.
        #[allow(unsafe_code)]
        let map = unsafe { memmap2::Mmap::map(&file)? };
        Self::from_storage(Storage(std::sync::Arc::new(map)))
    }

    /// Parses a GGUF file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::from_storage(Storage(std::sync::Arc::new(bytes)))
    }

    fn from_storage(storage: Storage) -> Result<Self, GgufError> {
        let header = parse::parse_header(storage.bytes())?;
        let mut index = HashMap::with_capacity(header.tensors.len());
        for (i, t) in header.tensors.iter().enumerate() {
            if index.insert(t.name.clone(), i).is_some() {
                return Err(GgufError::DuplicateTensor(t.name.clone()));
            }
        }
        check_sizes(&header.tensors)?;
        Ok(GgufFile {
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            storage,
            data_offset: header.data_offset,
            index,
        })
    }

    /// The metadata value for `key`, if present.
    pub fn meta(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.meta(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
        }
    }

    /// An integer value of any integer type that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.require(key)?
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| Self::wrong(key, "an integer fitting u32"))
    }

    /// A float value (`F32` or `F64`).
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        self.require(key)?
            .as_f64()
            .map(|v| v as f32)
            .ok_or_else(|| Self::wrong(key, "a float"))
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        self.require(key)?
            .as_str()
            .ok_or_else(|| Self::wrong(key, "a string"))
    }

    /// A boolean value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            MetaValue::Bool(b) => Ok(*b),
            _ => Err(Self::wrong(key, "a bool")),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<String>, GgufError> {
        let arr = self
            .require(key)?
            .as_array()
            .ok_or_else(|| Self::wrong(key, "an array of strings"))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Self::wrong(key, "an array of strings"))
            })
            .collect()
    }

    /// An array of integers that all fit in `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        let arr = self
            .require(key)?
            .as_array()
            .ok_or_else(|| Self::wrong(key, "an array of i32"))?;
        arr.iter()
            .map(|v| {
                v.as_i64()
                    .and_then(|x| i32::try_from(x).ok())
                    .ok_or_else(|| Self::wrong(key, "an array of i32"))
            })
            .collect()
    }

    /// The model architecture (`general.architecture`), e.g. `llama`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// The descriptor of the tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.index
            .get(name)
            .and_then(|&i| self.tensors.get(i))
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))
    }

    /// The raw bytes of the tensor called `name`.
    pub fn tensor_data(&self, name: &str) -> Result<&[u8], GgufError> {
        let range = self.tensor_range(name)?;
        Ok(&self.storage.bytes()[range])
    }

    /// The raw bytes of the tensor called `name`, borrowed from the file's map for as long as
    /// the returned value lives (the map outlives this `GgufFile` then): no copy.
    pub fn tensor_shared(&self, name: &str) -> Result<SharedBytes, GgufError> {
        let range = self.tensor_range(name)?;
        Ok(SharedBytes::new(self.storage.0.clone(), range))
    }

    /// Where the tensor called `name` lies in the file, checked to lie inside it.
    fn tensor_range(&self, name: &str) -> Result<std::ops::Range<usize>, GgufError> {
        let info = self.tensor(name)?;
        let oob = || GgufError::TensorOutOfBounds(name.to_string());
        let n_bytes = match info.n_bytes() {
            Some(n) => n,
            None => match info.ty.block_size() {
                None => {
                    return Err(GgufError::UnsupportedTensorType {
                        tensor: name.to_string(),
                        ty: info.ty,
                    })
                }
                Some(block) if info.dims.first().is_some_and(|&r| r % block as u64 != 0) => {
                    return Err(GgufError::BadShape {
                        tensor: name.to_string(),
                        ty: info.ty,
                        dims: info.dims.clone(),
                        block,
                    })
                }
                Some(_) => return Err(oob()),
            },
        };
        let start = u64::try_from(self.data_offset)
            .ok()
            .and_then(|d| d.checked_add(info.offset))
            .ok_or_else(oob)?;
        let end = start.checked_add(n_bytes).ok_or_else(oob)?;
        let (start, end) = (
            usize::try_from(start).map_err(|_| oob())?,
            usize::try_from(end).map_err(|_| oob())?,
        );
        if end > self.storage.bytes().len() {
            return Err(oob());
        }
        Ok(start..end)
    }

    /// The tensor called `name` converted to `f32` values; only `F32`, `F16` and `BF16`
    /// tensors.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self.tensor(name)?;
        let ty = info.ty;
        if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
            return Err(GgufError::UnsupportedTensorType {
                tensor: name.to_string(),
                ty,
            });
        }
        let data = self.tensor_data(name)?;
        Ok(match ty {
            GgmlType::F32 => data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            GgmlType::BF16 => data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        })
    }
}

/// Checks that no tensor's implied bytes (type × shape) run into the data of the tensor stored
/// after it: a descriptor whose type or shape disagrees with the bytes the writer laid out is
/// an error naming it, found when the file is opened. Tensors of unknown types, or whose shape
/// does not fit their type, are reported when their data is read.
fn check_sizes(tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (t, next) = (pair[0], pair[1]);
        let Some(needs) = t.n_bytes() else { continue };
        let room = next.offset - t.offset;
        if needs > room {
            return Err(GgufError::TensorSize {
                tensor: t.name.clone(),
                ty: t.ty,
                dims: t.dims.clone(),
                needs,
                room,
            });
        }
    }
    Ok(())
}

/// What shared bytes belong to: a memory map of the model file, or a buffer.
pub type ByteOwner = std::sync::Arc<dyn AsRef<[u8]> + Send + Sync>;

/// Bytes borrowed from a shared owner (the memory-mapped model file), so that a matrix kept in
/// the file's own layout needs no second copy: the file's pages are the weights.
#[derive(Clone)]
pub struct SharedBytes {
    owner: ByteOwner,
    range: Range<usize>,
}

impl SharedBytes {
    /// `range` of `owner`'s bytes. Panics if the range does not lie inside them.
    pub fn new(owner: ByteOwner, range: Range<usize>) -> Self {
        assert!(
            range.start <= range.end && range.end <= (*owner).as_ref().len(),
            "shared range {range:?} outside its owner"
        );
        SharedBytes { owner, range }
    }

    /// The borrowed bytes.
    #[inline]
    pub fn bytes(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }

    /// Bytes `r` of these (relative to their start). Panics if out of range.
    pub fn sub(&self, r: Range<usize>) -> SharedBytes {
        assert!(r.start <= r.end && r.end <= self.range.len());
        SharedBytes {
            owner: self.owner.clone(),
            range: self.range.start + r.start..self.range.start + r.end,
        }
    }
}

/// Path of the default model for tests and tools: `$CLEAVE_MODEL` if set, else
/// `$CLEAVE_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf` (CLEAVE_CACHE_DIR defaults to
/// `$XDG_CACHE_HOME/cleave`, then `$HOME/.cache/cleave`).
pub fn default_model_path() -> PathBuf {
    // The model/cache locations of tools and tests (the binaries take --model).
    #[allow(clippy::disallowed_methods)]
    let non_empty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(p) = non_empty("CLEAVE_MODEL") {
        return PathBuf::from(p);
    }
    let cache = non_empty("CLEAVE_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| non_empty("XDG_CACHE_HOME").map(|x| PathBuf::from(x).join("cleave")))
        .or_else(|| non_empty("HOME").map(|h| PathBuf::from(h).join(".cache").join("cleave")))
        .unwrap_or_else(|| PathBuf::from(".cache").join("cleave"));
    cache.join("models").join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[cfg(test)]
mod tests;
