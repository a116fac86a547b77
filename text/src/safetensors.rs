//! Hugging Face safetensors checkpoints: a directory of one `model.safetensors` or several
//! shards listed by `model.safetensors.index.json`, memory-mapped, with tensors read in f32
//! from F32, F16 or BF16 storage. Only the requested rows/columns of a tensor are converted, so
//! each rank of a group touches only its shard of the weights.
//!
//! File format: an 8-byte little-endian header length, a JSON header mapping each tensor name to
//! `{dtype, shape, data_offsets: [begin, end]}` (offsets relative to the end of the header),
//! then the data.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};

use half::{bf16, f16};

/// Errors reading safetensors files.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    /// The file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The header is malformed.
    #[error("{path}: bad safetensors header: {why}")]
    BadHeader {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// No file of the checkpoint holds this tensor.
    #[error("tensor {0} is not in the checkpoint")]
    Missing(String),
    /// The tensor's dtype is not one the loader converts.
    #[error("tensor {name} has unsupported dtype {dtype} (supported: F32, F16, BF16)")]
    UnsupportedDtype {
        /// The tensor.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// The tensor's shape is not what the model needs.
    #[error("tensor {name}: expected shape {expected:?}, found {found:?}")]
    Shape {
        /// The tensor.
        name: String,
        /// The shape the model's configuration implies.
        expected: Vec<usize>,
        /// The stored shape.
        found: Vec<usize>,
    },
}

/// Element types the loader converts to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    fn parse(s: &str) -> Option<Self> {
        match s {
            "F32" => Some(Dtype::F32),
            "F16" => Some(Dtype::F16),
            "BF16" => Some(Dtype::BF16),
            _ => None,
        }
    }

    /// The header's name of this dtype.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }

    fn load(self, b: &[u8]) -> f32 {
        match self {
            Dtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Dtype::F16 => f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
            Dtype::BF16 => bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        }
    }

    /// Encodes f32 values in this dtype (for writing checkpoints).
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * self.size());
        for &v in values {
            match self {
                Dtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
                Dtype::F16 => out.extend_from_slice(&f16::from_f32(v).to_bits().to_le_bytes()),
                Dtype::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_bits().to_le_bytes()),
            }
        }
        out
    }
}

struct Entry {
    file: usize,
    dtype: Result<Dtype, String>,
    shape: Vec<usize>,
    /// Absolute byte range in the file.
    range: Range<usize>,
}

/// A checkpoint: every tensor of its files by name.
pub struct SafeTensors {
    maps: Vec<memmap2::Mmap>,
    tensors: HashMap<String, Entry>,
}

#[derive(serde::Deserialize)]
struct Index {
    weight_map: BTreeMap<String, String>,
}

impl SafeTensors {
    /// Opens the checkpoint in `dir`: `model.safetensors`, or the shards named by
    /// `model.safetensors.index.json`.
    pub fn open_dir(dir: &Path) -> Result<Self, SafetensorsError> {
        let index = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|source| SafetensorsError::Io {
                path: index.clone(),
                source,
            })?;
            let idx: Index =
                serde_json::from_str(&text).map_err(|e| SafetensorsError::BadHeader {
                    path: index.clone(),
                    why: e.to_string(),
                })?;
            let mut names: Vec<&String> = idx.weight_map.values().collect();
            names.sort();
            names.dedup();
            names.into_iter().map(|n| dir.join(n)).collect()
        } else {
            vec![dir.join("model.safetensors")]
        };
        Self::open_files(&files)
    }

    /// Opens these files as one checkpoint.
    pub fn open_files(files: &[PathBuf]) -> Result<Self, SafetensorsError> {
        let mut st = SafeTensors {
            maps: Vec::new(),
            tensors: HashMap::new(),
        };
        for path in files {
            let io = |source| SafetensorsError::Io {
                path: path.clone(),
                source,
            };
            let file = std::fs::File::open(path).map_err(io)?;
            // SAFETY: read-only private map; checkpoint files are treated as immutable while
            // loaded (as every mmap-based loader does).
            #[allow(unsafe_code)]
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
            st.parse(path, &map)?;
            st.maps.push(map);
        }
        Ok(st)
    }

    fn parse(&mut self, path: &Path, map: &[u8]) -> Result<(), SafetensorsError> {
        let bad = |why: String| SafetensorsError::BadHeader {
            path: path.to_path_buf(),
            why,
        };
        if map.len() < 8 {
            return Err(bad(format!("file is {} bytes long", map.len())));
        }
        let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
        let data_start = 8usize
            .checked_add(n)
            .filter(|&e| e <= map.len())
            .ok_or_else(|| bad(format!("header length {n} exceeds the file")))?;
        let header: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&map[8..data_start]).map_err(|e| bad(e.to_string()))?;
        let file = self.maps.len();
        for (name, v) in header {
            if name == "__metadata__" {
                continue;
            }
            let dtype_s = v["dtype"]
                .as_str()
                .ok_or_else(|| bad(format!("{name}: no dtype")))?;
            let shape: Vec<usize> = serde_json::from_value(v["shape"].clone())
                .map_err(|e| bad(format!("{name}: shape: {e}")))?;
            let offs: [usize; 2] = serde_json::from_value(v["data_offsets"].clone())
                .map_err(|e| bad(format!("{name}: data_offsets: {e}")))?;
            let dtype = Dtype::parse(dtype_s).ok_or_else(|| dtype_s.to_string());
            let range = data_start + offs[0]..data_start + offs[1];
            if offs[0] > offs[1] || range.end > map.len() {
                return Err(bad(format!("{name}: data {offs:?} outside the file")));
            }
            if let Ok(d) = dtype {
                let want = shape
                    .iter()
                    .try_fold(d.size(), |a, &n| a.checked_mul(n))
                    .ok_or_else(|| bad(format!("{name}: shape {shape:?} is too large")))?;
                if range.len() != want {
                    return Err(bad(format!(
                        "{name}: {} data bytes for shape {shape:?} of {dtype_s}",
                        range.len()
                    )));
                }
            }
            self.tensors.insert(
                name,
                Entry {
                    file,
                    dtype,
                    shape,
                    range,
                },
            );
        }
        Ok(())
    }

    /// Whether the checkpoint has this tensor.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The stored shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<&[usize], SafetensorsError> {
        Ok(&self.entry(name)?.shape)
    }

    fn entry(&self, name: &str) -> Result<&Entry, SafetensorsError> {
        self.tensors
            .get(name)
            .ok_or_else(|| SafetensorsError::Missing(name.to_string()))
    }

    /// Rows `rows` and columns `cols` of a 2-D tensor that must have shape `[n_rows, n_cols]`
    /// (a 1-D tensor is read as one row), converted to f32, row-major.
    pub fn read_f32(
        &self,
        name: &str,
        shape: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Vec<f32>, SafetensorsError> {
        let e = self.entry(name)?;
        if e.shape != shape {
            return Err(SafetensorsError::Shape {
                name: name.into(),
                expected: shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        let dtype = e
            .dtype
            .clone()
            .map_err(|dtype| SafetensorsError::UnsupportedDtype {
                name: name.into(),
                dtype,
            })?;
        let n_cols = shape.last().copied().unwrap_or(1);
        let bytes = &self.maps[e.file][e.range.clone()];
        let sz = dtype.size();
        let mut out = Vec::with_capacity(rows.len() * cols.len());
        for r in rows {
            let row = &bytes[r * n_cols * sz..(r + 1) * n_cols * sz];
            out.extend(
                row[cols.start * sz..cols.end * sz]
                    .chunks_exact(sz)
                    .map(|b| dtype.load(b)),
            );
        }
        Ok(out)
    }
}

/// Writes tensors (name, dtype, shape, f32 values encoded in that dtype) as one safetensors
/// file. Used to make checkpoints for tests.
pub fn write_file(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<f32>)],
) -> std::io::Result<()> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, values) in tensors {
        assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
        let begin = data.len();
        data.extend(dtype.encode(values));
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + data.len());
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bad_files() {
        let dir = std::env::temp_dir().join(format!("cleave-st-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vals = vec![1.0, -2.5, 3.25, 0.5, 7.0, -1.0];
        let t = |d: Dtype| (format!("w.{}", d.name()), d, vec![2, 3], vals.clone());
        write_file(
            &dir.join("model.safetensors"),
            &[t(Dtype::F32), t(Dtype::F16), t(Dtype::BF16)],
        )
        .unwrap();
        let st = SafeTensors::open_dir(&dir).unwrap();
        for d in ["F32", "F16", "BF16"] {
            let name = format!("w.{d}");
            assert_eq!(st.read_f32(&name, &[2, 3], 0..2, 0..3).unwrap(), vals);
            assert_eq!(
                st.read_f32(&name, &[2, 3], 1..2, 1..3).unwrap(),
                vec![7.0, -1.0]
            );
        }
        let e = st.read_f32("w.F32", &[3, 2], 0..3, 0..2).unwrap_err();
        assert!(e.to_string().contains("expected shape [3, 2]"), "{e}");
        assert!(matches!(
            st.read_f32("nope", &[1], 0..1, 0..1),
            Err(SafetensorsError::Missing(_))
        ));
        // Truncated and garbage files are errors, not panics.
        let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        for cut in [0, 4, 8, 20, bytes.len() - 1] {
            std::fs::write(dir.join("model.safetensors"), &bytes[..cut]).unwrap();
            assert!(SafeTensors::open_dir(&dir).is_err(), "cut at {cut}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
